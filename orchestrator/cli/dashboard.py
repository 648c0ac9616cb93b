"""`diloco dashboard install`: put the run-metrics Grafana dashboard where Ray's Grafana provisioning reads it.

Ray's default temp dir ($RAY_TMPDIR, else $TMPDIR, else /tmp; then `ray`) is read here, at the edge.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from orchestrator.deploy.dashboard import DashboardError, install_dashboard, session_dashboards_dir

EXAMPLES = """examples:
  diloco dashboard install                      # into this node's current Ray session (/tmp/ray/session_latest)
  diloco dashboard install --temp-dir /data/ray # a Ray started with --temp-dir /data/ray
  diloco dashboard install --dir /etc/grafana/dashboards
"""


def default_ray_temp_dir() -> Path:
    """Ray's default temp dir on Linux and macOS, as ray._common.utils.get_default_ray_temp_dir computes it (without
    importing Ray, seconds on a small machine)."""
    if "RAY_TMPDIR" in os.environ:
        return Path(os.environ["RAY_TMPDIR"]) / "ray"
    if sys.platform.startswith("linux") and "TMPDIR" in os.environ:
        return Path(os.environ["TMPDIR"]) / "ray"
    return Path("/tmp") / "ray"


def _cmd_install(args: argparse.Namespace) -> int:
    try:
        target_dir = Path(args.dir) if args.dir else session_dashboards_dir(Path(args.temp_dir) if args.temp_dir
                                                                            else default_ray_temp_dir())
        written = install_dashboard(target_dir)
    except DashboardError as err:
        print(f"diloco dashboard install: {err}", file=sys.stderr)
        return 2
    print(f"installed {written}: Grafana lists it as \"Decoupled DiLoCo\"")
    return 0


def register(subparsers) -> None:
    """Add `dashboard` (with `install`) to the `diloco` parser's subparsers."""
    d = subparsers.add_parser("dashboard", help="the Grafana dashboard of a run's ray_diloco_* metrics",
                              description="The Grafana dashboard of a run's ray_diloco_* metrics (docs/metrics.md, Grafana).")
    sub = d.add_subparsers(dest="dashboard_command", required=True)
    i = sub.add_parser("install", help="copy the dashboard JSON where Ray's Grafana provisioning reads dashboards",
                       description="Copy the dashboard JSON into the folder that the current Ray session's Grafana "
                       "provisioning (metrics/grafana/provisioning/dashboards/default.yml) reads, or into --dir. Ray "
                       "rewrites that folder each time its dashboard starts: install again after `ray start`.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = i.add_mutually_exclusive_group()
    where.add_argument("--dir", help="copy into this existing folder instead (a Grafana dashboards folder of yours)")
    where.add_argument("--temp-dir", help="the Ray temp dir the session is under (ray start --temp-dir; default "
                       "$RAY_TMPDIR or /tmp, then ray)")
    i.set_defaults(func=_cmd_install)
