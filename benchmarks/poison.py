"""One poisoned island of four: the held-out loss with the poison guard, without it, and without the poison.

Runs the default model and data (the default run: four islands, two of them EMULATED slower) in one local
Ray session, the same token budget each:

  clean        no fault, the guard on (outer.poison_guard, opt-in): its refusals are the guard's false refusals;
  clean, off   no fault, the guard off (the default): the guard's cost to a clean run;
  guarded      island --island poisoned from its first submission to the end of its incarnation, the guard on:
               after outer.poison_restart_after refusals in a row (3) the monitor restarts the island, and
               its new incarnation is healthy (a fault of the island's state, not of its hardware);
  unguarded    the same poison, the guard off: nothing refuses it, nothing restarts it;
  dropped      the same island's submissions all lost on the way (drop_submission for the whole run):
               a guard that refuses perfectly and never restarts, since a refused island's tokens still
               count against the budget.

The clean runs repeat --repeats times (default 3; the spread a difference must beat), the poisoned runs
--poisoned-repeats times (default 1) per kind in --kinds (default all four: scaled 100x, sign flipped, from a stale base, noise of the
honest norm). Prints a table of every run and one of medians, and writes JSON:
{"clean": loss, "guarded": loss, "unguarded": loss, "false_refusals_clean": N, ...}, where "guarded" and
"unguarded" are the worst over the kinds (the guard must hold for every one).

  python benchmarks/poison.py --json /tmp/poison.json      # ~50 minutes on 2 cores
  python benchmarks/poison.py --kinds flipped_submission --repeats 1 --quick   # a smoke run (~5 minutes)
  python benchmarks/poison.py --groups clean,guarded       # only those runs (the JSON leaves the others out)
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

# Runnable from a checkout without `pip install -e .` (see benchmarks/chaos.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import orchestrator  # noqa: E402,F401 - before ray: it sets Ray's log filter (orchestrator/__init__.py)
from orchestrator.actors.remote import WORKER_ENV  # noqa: E402
from orchestrator.config import ConfigError, RunConfig, load_config  # noqa: E402
from orchestrator.core.eventlog import read_events  # noqa: E402
from orchestrator.run.driver import train  # noqa: E402
from policies.chaos import Fault, FaultTape  # noqa: E402
from policies.fault_kinds import POISON_KINDS  # noqa: E402

WHOLE_RUN_S = 1e7  # a drop window longer than any run
GROUPS = ("clean", "clean-off", "guarded", "unguarded", "dropped")
GUARD_ON, GUARD_OFF = ["outer.poison_guard=true"], ["outer.poison_guard=false"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(POISON_KINDS),
                    help=f"comma-separated poison kinds (default all: {','.join(POISON_KINDS)})")
    ap.add_argument("--island", type=int, default=0, help="the poisoned island slot (default 0, a fast island: the "
                    "largest share of the tokens)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the clean runs (default 3)")
    ap.add_argument("--poisoned-repeats", type=int, default=1, help="repeats of each poisoned run (default 1)")
    ap.add_argument("--budget", type=int, default=None, help="tokens per run (default: the default config's)")
    ap.add_argument("--quick", action="store_true", help="a 1.2M-token budget")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run (repeatable)")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"which runs (default all: {','.join(GROUPS)})")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if not args.groups or any(g not in GROUPS for g in args.groups) or "clean" not in args.groups:
        ap.error(f"--groups: {args.groups} must be some of {', '.join(GROUPS)}, clean among them (the reference)")
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in POISON_KINDS]
    if bad or not args.kinds:
        ap.error(f"--kinds: unknown poison kind(s) {bad}; use some of {', '.join(POISON_KINDS)}")
    if args.repeats < 1 or args.poisoned_repeats < 1:
        ap.error(f"--repeats and --poisoned-repeats must be >= 1, got {args.repeats} and {args.poisoned_repeats}")
    try:
        cfg = load_config(overrides=args.overrides)
    except ConfigError as err:
        ap.error(str(err))
    if not 0 <= args.island < cfg.num_islands:
        ap.error(f"--island must name one of the run's {cfg.num_islands} island slots (0..{cfg.num_islands - 1}), "
                 f"got {args.island}")
    return args


def run_one(name: str, overrides: list[str], root: Path, tape: FaultTape | None = None) -> dict:
    """Train one run in `root / name` (under `tape`, if given); its summary with the refusals by cause added."""
    where = root / name
    where.mkdir(parents=True, exist_ok=True)
    if tape is not None:
        tape.to_yaml(where / "tape.yaml")
        overrides = overrides + ["chaos.mode=tape", f"chaos.params={{path: {where / 'tape.yaml'}}}"]
    t0 = time.monotonic()
    summary = train(load_config(overrides=overrides), where)
    refusals = read_events(where, "refusals").to_pylist()
    poisoned = [r["island"] for r in refusals if r["reason"].startswith("poisoned")]
    summary["poisoned_refusals"] = len(poisoned)
    summary["poisoned_refusals_by_island"] = {i: poisoned.count(i) for i in sorted(set(poisoned))}
    summary["other_refusals"] = len(refusals) - len(poisoned)
    print(f"  {name}: {time.monotonic() - t0:.0f} s, loss {summary['eval_loss']:.4f}, refused "
          f"{summary['poisoned_refusals']} as poisoned, {summary['other_refusals']} otherwise", file=sys.stderr)
    return summary


def run_all(args: argparse.Namespace, root: Path) -> dict[str, list[dict]]:
    """Every run, in one local Ray session: name -> its summaries."""
    budget = args.budget or (1_200_000 if args.quick else RunConfig().run.token_budget)
    common = [f"run.token_budget={budget}", "eval.interval_s=30"] + args.overrides
    whole = lambda kind, d=0.0: FaultTape([Fault(args.island, kind, at_s=0.0, duration_s=d)])  # noqa: E731
    runs: dict[str, list[dict]] = {}
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV},
             logging_level="ERROR")
    try:
        print(f"runs in {root}; token budget {budget:,}; island {args.island} poisoned", file=sys.stderr)
        for r in range(1, args.repeats + 1):
            runs.setdefault("clean", []).append(run_one(f"clean-r{r}", common + GUARD_ON, root))
            if "clean-off" in args.groups:
                runs.setdefault("clean, guard off", []).append(run_one(f"clean-off-r{r}", common + GUARD_OFF, root))
        for r in range(1, args.poisoned_repeats + 1):
            for kind in args.kinds:
                if "guarded" in args.groups:
                    runs.setdefault(f"guarded {kind}", []).append(
                        run_one(f"guarded-{kind}-r{r}", common + GUARD_ON, root, whole(kind)))
                if "unguarded" in args.groups:
                    runs.setdefault(f"unguarded {kind}", []).append(
                        run_one(f"unguarded-{kind}-r{r}", common + GUARD_OFF, root, whole(kind)))
        if "dropped" in args.groups:
            runs["dropped"] = [run_one("dropped", common + GUARD_ON, root, whole("drop_submission", WHOLE_RUN_S))]
    finally:
        ray.shutdown()
    return runs


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: one row per run."""
    rows = ["| run | held-out loss (nats/byte) | bits/byte | tokens merged | tokens refused | refused as poisoned "
            "| refused otherwise | restarts | wall s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, summaries in runs.items():
        for i, s in enumerate(summaries, 1):
            label = name if len(summaries) == 1 else f"{name} (r{i})"
            rows.append(f"| {label} | {s['eval_loss']:.4f} | {s['eval_bits_per_byte']:.3f} | {s['tokens_merged']:,.0f} "
                        f"| {s['tokens_refused']:,.0f} | {s['poisoned_refusals']} | {s['other_refusals']} "
                        f"| {s['restarts']} | {s['wall_s']:.0f} |")
    return "\n".join(rows)


def results(runs: dict[str, list[dict]], kinds: list[str], island: int) -> dict:
    """The JSON: medians of the clean runs, the worst kind guarded and unguarded, false refusals, per kind."""
    med = {name: statistics.median(s["eval_loss"] for s in summaries) for name, summaries in runs.items()}
    clean = med["clean"]
    out: dict = {"clean": clean, "clean_guard_off": med.get("clean, guard off")}
    for group in ("guarded", "unguarded"):
        if f"{group} {kinds[0]}" in med:
            worst = max(kinds, key=lambda k: med[f"{group} {k}"])
            out[group], out[f"{group}_worst_kind"] = med[f"{group} {worst}"], worst
    by_kind: dict = {}
    for k in kinds:
        row = by_kind[k] = {"unguarded": med.get(f"unguarded {k}")}
        if f"guarded {k}" in runs:  # counts summed over the repeats
            ss = runs[f"guarded {k}"]
            row.update(guarded=med[f"guarded {k}"], runs=len(ss),
                       spread=[min(s["eval_loss"] for s in ss), max(s["eval_loss"] for s in ss)],
                       restarts=sum(s["restarts"] for s in ss),
                       poisoned_refused=sum(s["poisoned_refusals_by_island"].get(island, 0) for s in ss),
                       honest_refused_as_poisoned=sum(n for s in ss for i, n in s["poisoned_refusals_by_island"].items()
                                                      if i != island))
    return {
        **out, "dropped": med.get("dropped"),
        "false_refusals_clean": sum(s["poisoned_refusals"] for s in runs["clean"]),
        "clean_runs": len(runs["clean"]),
        "clean_spread": [min(s["eval_loss"] for s in runs["clean"]), max(s["eval_loss"] for s in runs["clean"])],
        "by_kind": by_kind, "units": "held-out loss, nats per byte",
    }


def _pct(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{100 * (a / b - 1):+.1f}%"


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write --json."""
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="diloco-poison-"))
    runs = run_all(args, root)
    out = results(runs, args.kinds, args.island)
    print("\n" + table(runs))
    off = out["clean_guard_off"]
    print(f"\nclean (median of {out['clean_runs']}): {out['clean']:.4f} (spread {out['clean_spread'][0]:.4f}-"
          f"{out['clean_spread'][1]:.4f}); guard off: {'not run' if off is None else f'{off:.4f}'}; false refusals "
          f"in clean runs: {out['false_refusals_clean']}")
    for k, v in out["by_kind"].items():
        guarded = (f"{v['poisoned_refused']} refused ({v['honest_refused_as_poisoned']} honest), {v['restarts']} "
                   f"restarts in {v['runs']} runs, guarded {v['guarded']:.4f} (median; {v['spread'][0]:.4f}-"
                   f"{v['spread'][1]:.4f}; {_pct(v['guarded'], out['clean'])} vs clean, "
                   f"{_pct(v['guarded'], out['dropped'])} vs dropped)") if "guarded" in v else "guarded not run"
        unguarded = "not run" if v["unguarded"] is None else f"{v['unguarded']:.4f} ({_pct(v['unguarded'], out['clean'])})"
        print(f"{k}: {guarded}, unguarded {unguarded}")
    print("EMULATION: pool speeds emulated by throttling on one machine")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
