"""Goodput under failures: decoupled vs synchronous DiLoCo under the same fault tape, and failure-free.

Runs the default model and data three ways in one local Ray session (same token budget each), and
all three `--repeats` times (default 3), then prints every row and a table of medians:
  1. decoupled without faults (the quality reference; its length sets the tape's horizon),
  2. decoupled (the default config) under a fault tape in which every island is killed N times,
  3. sync-diloco under the same tape.
The tape spreads its kills over (10 s, 85% of the failure-free run's wall time) unless --horizon-s
says otherwise, so every kill fires on a machine of any speed. Prints a markdown table (goodput,
uptime, pipeline fill, faults fired, detect and rejoin times, final held-out loss and its gap to the
failure-free run) and writes JSON. Pool speeds are EMULATED by throttling (labelled in the output).

  python benchmarks/chaos.py                       # 3 repeats at the default 3M budget, medians: ~25 minutes on 2 cores
  python benchmarks/chaos.py --repeats 1           # one side by side (~8 minutes)
  python benchmarks/chaos.py --budget 9000000 --repeats 1   # the same 3 kills per island over a 3x longer run
  python benchmarks/chaos.py --quick               # a smoke run (~4 minutes)
  python benchmarks/chaos.py --failures 3 --json /tmp/chaos.json
  python benchmarks/chaos.py --salvage-every 0     # without salvage (a dead island's unsubmitted work is lost)
  python benchmarks/chaos.py --set outer.adoption=overwrite --skip-sync   # an A/B of one decoupled setting
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import orchestrator  # noqa: E402,F401 - before ray: it sets Ray's log filter (orchestrator/__init__.py)
from orchestrator.actors.remote import WORKER_ENV  # noqa: E402
from orchestrator.config import ConfigError, RunConfig, load_config  # noqa: E402
from orchestrator.core.eventlog import read_events  # noqa: E402
from orchestrator.run.driver import emulation_note, train  # noqa: E402
from policies.chaos import fixed_tape  # noqa: E402


def run_one(name: str, overrides: list[str], root: Path) -> dict:
    """Train one run in `root / name`; its summary, with the longest wait between version advances added."""
    cfg = load_config(overrides=overrides)
    t0 = time.monotonic()
    summary = train(cfg, root / name)
    # The longest wait between two global version advances: a stall measure that, unlike uptime (whose
    # window follows each run's own median gap), is the same yardstick for every method.
    # The final flush merges after the islands stopped: its wait is the stop, not a stall.
    rounds = read_events(root / name, "rounds").to_pylist()
    times = sorted({r["wall_time"] for r in rounds if r["reason"] != "final flush"})
    summary["longest_gap_s"] = max((b - a for a, b in zip(times, times[1:])), default=None)
    print(f"  {name}: {time.monotonic() - t0:.0f}s, goodput {summary['goodput']:.3f}, "
          f"loss {summary['eval_loss']:.4f}", file=sys.stderr)
    return summary


FIELDS = ("goodput", "uptime", "fill_s", "longest_gap_s", "faults_injected", "failures", "restarts", "mean_time_to_detect_s",
          "mean_time_to_rejoin_s", "eval_loss", "eval_bits_per_byte", "tokens_lost", "tokens_overwritten", "salvaged_tokens", "salvage_snapshot_s",
          "time_by_state_s", "wall_s")
METHODS = ("decoupled + faults", "sync-diloco + faults", "decoupled, no faults")


class ChaosPlan(NamedTuple):
    """What every repeat runs: the token budget, kills per island, salvage period and the methods shown."""

    # A NamedTuple, not a dataclass: tests load benchmarks by file path, without the sys.modules entry a dataclass needs.
    budget: int
    failures: int
    salvage: int
    methods: tuple[str, ...]
    common: list[str]  # overrides every run gets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad --repeats or --set fails here, in one line, before any run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--failures", type=int, default=3, help="kills per island on the tape (default 3)")
    ap.add_argument("--budget", type=int, default=None, help="tokens per run (default: the default config's)")
    ap.add_argument("--horizon-s", type=float, default=None,
                    help="faults spread over (10 s, horizon); default 85%% of the failure-free run's wall time")
    ap.add_argument("--seed", type=int, default=0, help="tape seed")
    ap.add_argument("--warm-spares", type=int, default=1, help="warm spares per pool (default 1)")
    ap.add_argument("--salvage-every", type=int, default=None,
                    help="health.salvage_every_steps for every run (default: the config's; 0 = off)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="run the three side by side this many times and add a table of medians (default 3; 1 with --quick)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both decoupled runs (repeatable), e.g. outer.adoption=overwrite; "
                         "the sync-diloco run keeps its preset")
    ap.add_argument("--skip-sync", action="store_true",
                    help="leave out the sync-diloco run (for A/Bs of a decoupled setting)")
    ap.add_argument("--quick", action="store_true", help="smaller budget, 1 failure per island")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    try:  # a bad --set fails here, in one line, before any run
        load_config(overrides=args.overrides)
    except ConfigError as err:
        ap.error(str(err))
    return args


def plan(args: argparse.Namespace) -> ChaosPlan:
    """The budget, kills and salvage period the options pick (--quick: a smaller budget, 1 kill per island)."""
    budget = args.budget or (1_200_000 if args.quick else RunConfig().run.token_budget)
    salvage = RunConfig().health.salvage_every_steps if args.salvage_every is None else args.salvage_every
    return ChaosPlan(
        budget=budget, failures=1 if args.quick else args.failures, salvage=salvage,
        methods=tuple(m for m in METHODS if not (args.skip_sync and m.startswith("sync"))),
        common=[f"run.token_budget={budget}", f"health.warm_spares={args.warm_spares}", "eval.interval_s=30",
                f"health.salvage_every_steps={salvage}"])


def run_repeat(args: argparse.Namespace, p: ChaosPlan, where: Path, r: int) -> dict:
    """One side by side in `where`: the failure-free run, then the faulted runs under a tape that follows it."""
    where.mkdir(parents=True, exist_ok=True)
    clean = run_one("decoupled-clean", p.common + args.overrides, where)
    # Each repeat's tape follows its own failure-free run, so the failure rate per run is the same.
    horizon = args.horizon_s or 0.85 * clean["wall_s"]
    tape = fixed_tape(islands=RunConfig().num_islands, failures_per_island=p.failures, horizon_s=horizon,
                      start_s=10.0, seed=args.seed)
    tape.to_yaml(where / "tape.yaml")
    chaos = ["chaos.mode=tape", f"chaos.params={{path: {where / 'tape.yaml'}}}"]
    print(f"repeat {r}: fault tape of {len(tape)} kills ({p.failures} per island) over 10-{horizon:.0f}s",
          file=sys.stderr)
    rep = {"horizon_s": horizon, METHODS[0]: run_one("decoupled-faults", p.common + args.overrides + chaos, where)}
    if not args.skip_sync:
        rep[METHODS[1]] = run_one("sync-faults", p.common + chaos + ["mode=sync-diloco"], where)
    rep[METHODS[2]] = clean
    return rep


def run_all(args: argparse.Namespace, p: ChaosPlan, root: Path) -> list[dict]:
    """Every repeat, in one local Ray session."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV},
             logging_level="ERROR")
    repeats: list[dict] = []
    try:
        print(f"runs in {root}; token budget {p.budget:,} per run; {args.repeats} repeat(s)", file=sys.stderr)
        for r in range(1, args.repeats + 1):
            repeats.append(run_repeat(args, p, root / f"r{r}", r))
    finally:
        ray.shutdown()
    return repeats


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def add_vs_no_faults(repeats: list[dict], methods: tuple[str, ...]) -> None:
    """Each run's final loss relative to its own repeat's failure-free run, as `vs_no_faults`."""
    for rep in repeats:
        ref = rep[METHODS[2]]["eval_loss"]  # each repeat against its own failure-free run
        for name in methods:
            rep[name]["vs_no_faults"] = rep[name]["eval_loss"] / ref - 1


def runs_table(repeats: list[dict], methods: tuple[str, ...]) -> str:
    """Markdown: one row per run of every repeat."""
    rows = ["| run | goodput | uptime | fill s | longest gap s | faults fired | failures | restarts | detect s | rejoin s | held-out loss "
            "| vs no faults | tokens lost | tokens overwritten | tokens salvaged | wall s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r, rep in enumerate(repeats, 1):
        for name in methods:
            s = rep[name]
            label = name if len(repeats) == 1 else f"{name} (r{r})"
            rows.append(f"| {label} | {s['goodput']:.3f} | {s['uptime']:.3f} | {s['fill_s']:.1f} | {_fmt(s['longest_gap_s'], '.1f')} | "
                        f"{s['faults_injected']} | {s['failures']} | {s['restarts']} | "
                        f"{_fmt(s['mean_time_to_detect_s'], '.2f')} | {_fmt(s['mean_time_to_rejoin_s'], '.1f')} | "
                        f"{s['eval_loss']:.4f} | {100 * s['vs_no_faults']:+.1f}% | {s['tokens_lost']:,.0f} | "
                        f"{s['tokens_overwritten']:,.0f} | {s['salvaged_tokens']:,.0f} | {s['wall_s']:.0f} |")
    return "\n".join(rows)


def print_medians(repeats: list[dict], methods: tuple[str, ...]) -> dict:
    """Print the table of medians over the repeats and return them per method ({} for one repeat)."""
    medians: dict = {}
    if len(repeats) <= 1:
        return medians
    def med(name: str, key: str) -> float | None:
        # longest_gap_s is None for a run with fewer than two version advances: the median of the runs that have one.
        values = [rep[name][key] for rep in repeats if rep[name][key] is not None]
        return statistics.median(values) if values else None

    ref = med(METHODS[2], "eval_loss")
    print(f"\nMedians over {len(repeats)} repeats ('vs no faults': the median of each repeat's own ratio, "
          "then the ratio of the medians):\n")
    print("| run | goodput | uptime | longest gap s | held-out loss | vs no faults (median ratio) | vs no faults (ratio of medians) |"
          " tokens lost | tokens salvaged |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in methods:
        medians[name] = {k: med(name, k) for k in ("goodput", "uptime", "longest_gap_s", "eval_loss", "vs_no_faults",
                                                      "tokens_lost", "salvaged_tokens")}
        m = medians[name]
        print(f"| {name} | {m['goodput']:.3f} | {m['uptime']:.3f} | {_fmt(m['longest_gap_s'], '.1f')} | {m['eval_loss']:.4f} | "
              f"{100 * m['vs_no_faults']:+.1f}% | {100 * (m['eval_loss'] / ref - 1):+.1f}% | {m['tokens_lost']:,.0f} | "
              f"{m['salvaged_tokens']:,.0f} |")
    return medians


def write_json(path: Path, args: argparse.Namespace, p: ChaosPlan, medians: dict, repeats: list[dict]) -> None:
    """The plan, the medians and every run's FIELDS, per repeat."""
    path.write_text(json.dumps({
        "budget": p.budget, "failures_per_island": p.failures, "salvage_every_steps": p.salvage, "overrides": args.overrides,
        "medians": medians,
        "repeats": [{"horizon_s": rep["horizon_s"], **{k: {f: rep[k][f] for f in FIELDS + ("vs_no_faults",)} for k in p.methods}}
                    for rep in repeats]}, indent=2))


def main(argv: list[str] | None = None) -> int:
    """Run the repeats, print the tables and the settings, write the JSON."""
    args = parse_args(argv)
    p = plan(args)
    root = Path(tempfile.mkdtemp(prefix="chaos-bench-"))
    repeats = run_all(args, p, root)
    add_vs_no_faults(repeats, p.methods)
    print(runs_table(repeats, p.methods))
    medians = print_medians(repeats, p.methods)
    print(f"\n{emulation_note(RunConfig())}")
    print(f"token budget {p.budget:,} per run; tape: {p.failures} kills per island over 10 s to 85% of each repeat's "
          f"failure-free wall time; warm spares per pool: {args.warm_spares}; salvage every {p.salvage} steps (0 = off); "
          f"decoupled overrides: {' '.join(args.overrides) or 'none'}; "
          "uptime counts from the first version advance after every island was merged or failed (fill s before it)")
    if args.json:
        write_json(args.json, args, p, medians, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
