"""`diloco submit` and `diloco status`: the command lines over the Ray Jobs client (orchestrator.deploy.jobs).

The addresses' environment fallbacks ($RAY_API_SERVER_ADDRESS, $RAY_ADDRESS) are read here, at the edge.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from orchestrator.config import ConfigError
from orchestrator.deploy.jobs import (
    DEFAULT_DASHBOARD,
    JobError,
    RecordedRun,
    connect,
    format_view,
    live_runs,
    pick_run,
    plan_job,
    recorded_run,
    run_view,
    submit,
)

SUBMIT_EXAMPLES = """examples:
  diloco submit --address http://HEAD:8265 --config configs/default.yaml
  diloco submit --address http://127.0.0.1:8265 --set run.token_budget=1000000 --run-dir /data/runs/r1 --no-wait
"""
STATUS_EXAMPLES = """examples:
  diloco status                          # the run in ./runs/latest, where it runs (else: this machine's cluster)
  diloco status runs/20261121-070000     # a run directory's run, on the Ray it recorded
  diloco status --address HEAD:6379 --run-id r1-3fa2c1
"""
LATEST_RUN = Path("runs") / "latest"  # `diloco train`'s link to its newest run, beside the default runs/<timestamp>


def _cmd_submit(args: argparse.Namespace) -> int:
    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or DEFAULT_DASHBOARD
    try:
        plan = plan_job(address=address, config=args.config, overrides=args.set, run_dir=args.run_dir,
                        working_dir=args.working_dir, env=args.env)
        print(f"equivalent: {plan.ray_job_submit_line(no_wait=args.no_wait)}", flush=True)
        return submit(plan, wait=not args.no_wait)
    except (ConfigError, JobError) as err:
        print(f"diloco submit: {err}", file=sys.stderr)
        return 2


def _where(args: argparse.Namespace) -> tuple[str | None, str | None, str, RecordedRun | None]:
    """(address, run id, how to name the place, the recorded run): --address or $RAY_ADDRESS first; else the Ray the
    run in RUN_DIR (default ./runs/latest) recorded; else this machine's cluster (`auto`, e.g. on a cluster node)."""
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        return address, args.run_id, address, None
    run_dir = Path(args.run_dir) if args.run_dir else LATEST_RUN
    mine = recorded_run(run_dir)
    if mine is not None:
        return mine.address, args.run_id or mine.run_id, f"{mine.address} (the Ray {run_dir}'s run recorded)", mine
    if args.run_dir:
        raise JobError(f"{run_dir} records no Ray address (no run.json with one: not a run directory, or a run from "
                       "before runs recorded it); pass --address HEAD:6379")
    return None, args.run_id, "this machine's cluster (auto)", None


def _cmd_status(args: argparse.Namespace) -> int:
    try:
        address, run_id, where, mine = _where(args)
        try:
            connect(address)
        except JobError:
            if mine is None:
                raise
            raise JobError(f"the run in {mine.run_dir} ({mine.run_id}) is not running: its Ray at {mine.address} does not "
                           f"answer (a local run's Ray stops with it); `diloco report {mine.run_dir}` shows how it ended, "
                           f"or pass --address HEAD:6379 for a run elsewhere") from None
        run_id = pick_run(live_runs(), run_id, where)
        print(format_view(run_view(run_id)))
    except JobError as err:
        print(f"diloco status: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - an actor gone mid-read, a timeout: one line for the user
        first = str(err).strip().splitlines()[-1][:300] if str(err).strip() else ""
        print(f"diloco status: could not read the run ({type(err).__name__}: {first}); it may have just ended",
              file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    """Add `submit` and `status` to the `diloco` parser."""
    s = subparsers.add_parser("submit", help="run `diloco train` on a Ray cluster as a job (Ray Jobs API)",
                              description="Submit a training run as a Ray job: the project is the job's working_dir; "
                                          "the job log streams here and the exit code is the job's (0 = SUCCEEDED). "
                                          "Ctrl-C stops following, not the job.",
                              epilog=SUBMIT_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--address", help=f"Ray dashboard URL (default: $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, "
                                     f"else {DEFAULT_DASHBOARD})")
    s.add_argument("--config", help="YAML run config inside the project (it travels with the working_dir)")
    s.add_argument("--run-dir", help="run directory on the cluster's head node, absolute or ~/... "
                                     "(default: ~/diloco-runs/<submission id>)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set outer.min_quorum=2 (repeatable)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the job's processes (repeatable)")
    s.add_argument("--working-dir", help="project root to ship (default: this checkout)")
    s.add_argument("--no-wait", action="store_true", help="submit and return; do not stream the log")
    s.set_defaults(func=_cmd_submit)
    t = subparsers.add_parser("status", help="versions, islands, rounds, tokens and goodput of a live run",
                              description="Attach to a live run's outer optimizer and health monitor and print "
                                          "where it stands.",
                              epilog=STATUS_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                   help="a run directory on this machine: attach to the Ray its run recorded (default: runs/latest when "
                        "there)")
    t.add_argument("--address", help="cluster address HEAD:6379 (default: $RAY_ADDRESS, else the Ray RUN_DIR's run "
                                     "recorded, else this machine's cluster)")
    t.add_argument("--run-id", help="which run, when several are live (they are listed if you leave it out)")
    t.set_defaults(func=_cmd_status)
