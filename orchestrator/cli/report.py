"""`diloco report`: plots and a markdown summary of a finished run (orchestrator.run.report)."""

from __future__ import annotations

import argparse
import sys


def _cmd_report(args: argparse.Namespace) -> int:
    from orchestrator.run.report import PLOTS_HINT, ReportError, baseline_line, have_matplotlib, write_report

    try:
        paths = write_report(args.run_dir, args.out, baseline=args.baseline)
        against = baseline_line(args.run_dir, args.baseline) if args.baseline else None
    except ReportError as err:
        print(f"diloco report: {err}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(path)
    if against:
        print(against)
    if not have_matplotlib():  # the basic install: report.md is written, the plots need the extra
        print(f"diloco report: no plots: {PLOTS_HINT}", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    """Add `report` to the `diloco` parser's subparsers."""
    r = subparsers.add_parser("report", help="plots and a markdown summary of a finished run",
                              description="Write loss.png, timeline.png and report.md for a run directory.\n\nExamples:\n"
                                          "  diloco report runs/demo --out /tmp/demo-report\n"
                                          "  diloco report runs/demo --baseline runs/dp   # how far from `diloco baseline-dp`",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by `diloco train`")
    r.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/report)")
    r.add_argument("--baseline", metavar="OTHER_RUN_DIR",
                   help="another finished run (e.g. `diloco baseline-dp`'s): say how far this run is from it at equal "
                        "tokens (held-out loss, bytes per token, time to its loss)")
    r.set_defaults(func=_cmd_report)
