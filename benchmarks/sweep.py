"""Hyperparameter sweep: final held-out loss of each method over a grid of config overrides, side by side.

Every grid point runs every method (`--methods`) on the same model, data and token budget, in one
local Ray session, `--repeats` times; the table shows the median final held-out loss per cell and,
per method, its best grid point and that point's gap to data parallel's best. The runs' base is the
built-in default config with its pools replaced by `--islands` islands in one pool, no EMULATED
slowdown and no network, so the sweep measures the training algorithm, not emulated speed or links.
`--set` adds overrides to every run.

Data parallel (`dp`: Ray Train TorchTrainer, orchestrator/baselines/data_parallel.py) reads only the run,
model, data, inner, eval, network and pool sections, so grid points that differ only in other keys
(outer.*, health.*) share one DP run per repeat instead of repeating it.

  python benchmarks/sweep.py --grid inner.lr=0.001,0.003,0.006 --repeats 1        # decoupled vs dp, 3M tokens, ~7 min
  python benchmarks/sweep.py --grid outer.lr=0.35,0.7 --grid outer.momentum=0.5,0.9 --methods decoupled,sync-diloco
  python benchmarks/sweep.py --grid inner.lr=0.002,0.004 --json /tmp/sweep.json   # 3 repeats: ~20 min
"""

from __future__ import annotations

import argparse
import itertools
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
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")  # a loaded 2-core box starts workers slowly

from orchestrator.config import MODES as ENGINE_MODES  # noqa: E402
from orchestrator.config import ConfigError, load_config  # noqa: E402

# The config sections train_data_parallel reads (network through build_run_network).
DP_SECTIONS = ("run", "model", "data", "inner", "eval", "network", "pools")


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`KEY=V1,V2,...` specs as (key, values); a one-line ValueError names a malformed one."""
    out = []
    for spec in specs:
        key, sep, vals = spec.partition("=")
        values = [v.strip() for v in vals.split(",")] if sep else []
        if not key.strip() or not values or any(not v for v in values):
            raise ValueError(f"--grid {spec!r}: write KEY=V1,V2,... with at least one value, e.g. inner.lr=0.001,0.003")
        if key.strip() in {k for k, _ in out}:
            raise ValueError(f"--grid {key.strip()!r} given twice: list all its values in one --grid")
        out.append((key.strip(), values))
    return out


def grid_points(grid: list[tuple[str, list[str]]]) -> list[tuple[str, ...]]:
    """The cartesian product of the grid as tuples of `KEY=VALUE` overrides, in the order given."""
    if not grid:
        return [()]
    return [tuple(f"{k}={v}" for (k, _), v in zip(grid, combo)) for combo in itertools.product(*(vs for _, vs in grid))]


def dp_view(point: tuple[str, ...]) -> tuple[str, ...]:
    """The overrides of a grid point that data parallel reads; points with the same view share a DP run."""
    return tuple(o for o in point if o.split("=", 1)[0].split(".", 1)[0] in DP_SECTIONS)


def base_overrides(islands: int) -> list[str]:
    """Every run's base: `islands` islands in one pool, no emulated slowdown, no network, no warm spares."""
    pool = f"{{name: islands, islands: {islands}, cpus_per_island: 0.5, region: local}}"
    return [f"pools=[{pool}]", "network.scenario=none", "health.warm_spares=0", "run.call_timeout_s=180"]


def summarise(cells: dict[tuple[str, tuple[str, ...]], list[float]], methods: list[str],
              points: list[tuple[str, ...]]) -> dict:
    """Medians per cell, the best point per method and each best's gap to data parallel's best."""
    med = {(m, p): statistics.median(v) for (m, p), v in cells.items() if v}
    best = {}
    for m in methods:
        scored = [(med[(m, p)], p) for p in points if (m, p) in med]
        if scored:
            loss, p = min(scored)
            best[m] = {"loss": loss, "point": list(p)}
    ref = best.get("dp", {}).get("loss")
    for b in best.values():
        b["gap_to_dp_best"] = None if ref is None else b["loss"] / ref - 1
    return {"median": med, "best": best}


def table(summary: dict, cells: dict, methods: list[str], points: list[tuple[str, ...]]) -> str:
    """Markdown: one row per grid point, one column per method (median loss, repeats in brackets)."""
    med = summary["median"]
    lines = ["| grid point | " + " | ".join(methods) + " |", "| --- |" + " ---: |" * len(methods)]
    for p in points:
        row = []
        for m in methods:
            v = cells.get((m, p), [])
            row.append("n/a" if not v else f"{med[(m, p)]:.4f}" + (f" ({', '.join(f'{x:.4f}' for x in v)})" if len(v) > 1 else ""))
        lines.append(f"| {' '.join(p) or '(defaults)'} | " + " | ".join(row) + " |")
    lines.append("")
    for m, b in summary["best"].items():
        gap = "" if b["gap_to_dp_best"] is None or m == "dp" else f"; {100 * b['gap_to_dp_best']:+.1f}% vs dp's best"
        lines.append(f"- best {m}: {b['loss']:.4f} at {' '.join(b['point']) or '(defaults)'}{gap}")
    return "\n".join(lines)


class SweepPlan(NamedTuple):
    """The checked command line: the methods, the grid points and every run's config, built before any run."""

    # A NamedTuple, not a dataclass: tests load benchmarks by file path, without the sys.modules entry a dataclass needs.
    methods: list[str]
    points: list[tuple[str, ...]]
    configs: dict  # (method, point) -> RunConfig


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, SweepPlan]:
    """The options and the plan; a bad option, grid or override fails here, in one line, before Ray starts."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="a config key and its values (repeatable: the grid is their cartesian product)")
    ap.add_argument("--methods", default="decoupled,dp",
                    help=f"comma-separated, from {', '.join(ENGINE_MODES)}, dp (default decoupled,dp)")
    ap.add_argument("--budget", type=int, default=3_000_000, help="tokens per run (default 3,000,000)")
    ap.add_argument("--islands", type=int, default=4, help="islands (and DP workers) per run (default 4)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, interleaved; medians reported (default 3)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="run directories here, a new or empty directory (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write every run's loss and the summary here")
    args = ap.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ENGINE_MODES + ("dp",)]
    if bad or not methods:
        ap.error(f"--methods {args.methods!r}: choose from {', '.join(ENGINE_MODES)}, dp")
    if args.repeats < 1 or args.islands < 1 or args.budget < 1:
        ap.error("--repeats, --islands and --budget must be >= 1")
    if args.out is not None and args.out.is_dir() and any(args.out.iterdir()):
        ap.error(f"--out {args.out}: the directory holds earlier runs; pass an empty or new one")
    try:
        points = grid_points(parse_grid(args.grid))
        common = base_overrides(args.islands) + [f"run.token_budget={args.budget}"] + args.overrides
        # Every run's config is built before the first run starts, so a bad value fails in one line.
        configs = {(m, p): load_config(overrides=common + list(p) + ([f"mode={m}"] if m != "dp" else []))
                   for p in points for m in methods}
    except (ValueError, ConfigError) as err:
        ap.error(str(err))
    return args, SweepPlan(methods=methods, points=points, configs=configs)


def run_sweep(args: argparse.Namespace, plan: SweepPlan, root: Path) -> tuple[dict, list[dict]]:
    """Every run, repeats interleaved, in one local Ray session; returns the losses per cell and a record per run."""
    # Ray and the trainers are imported here, not at the top, so option errors come back at once.
    import ray

    from orchestrator.actors.remote import WORKER_ENV
    from orchestrator.baselines.data_parallel import train_data_parallel
    from orchestrator.run.driver import train

    methods, points = plan.methods, plan.points
    cells: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    runs = []
    n_runs = args.repeats * (sum(m != "dp" for m in methods) * len(points)
                             + ("dp" in methods) * len({dp_view(p) for p in points}))
    print(f"runs in {root}: {n_runs} of {args.budget:,} tokens each; methods {', '.join(methods)}; "
          f"{len(points)} grid point(s); {args.repeats} repeat(s)", file=sys.stderr, flush=True)
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV},
             logging_level="ERROR")
    done = 0
    try:
        for r in range(1, args.repeats + 1):
            dp_done: dict[tuple[str, ...], float] = {}
            for i, p in enumerate(points):
                for m in methods:
                    if m == "dp" and dp_view(p) in dp_done:
                        cells.setdefault((m, p), []).append(dp_done[dp_view(p)])
                        continue
                    run_dir = root / f"r{r}" / f"p{i}-{m}"
                    t0 = time.monotonic()
                    cfg = plan.configs[(m, p)]
                    s = train_data_parallel(cfg, run_dir) if m == "dp" else train(cfg, run_dir)
                    done += 1
                    loss = s["eval_loss"]
                    if m == "dp":
                        dp_done[dp_view(p)] = loss
                    cells.setdefault((m, p), []).append(loss)
                    runs.append({"repeat": r, "method": m, "point": list(p), "eval_loss": loss,
                                 "tokens": s["tokens_processed"], "wall_s": s["wall_s"], "run_dir": str(run_dir)})
                    print(f"  [{done}/{n_runs}] r{r} {m} {' '.join(p) or '(defaults)'}: loss {loss:.4f} after "
                          f"{s['tokens_processed']:,} tokens ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    return cells, runs


def main(argv: list[str] | None = None) -> int:
    """Run the grid, print the table and the settings, write the JSON."""
    args, plan = parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="sweep-"))
    cells, runs = run_sweep(args, plan, root)
    summary = summarise(cells, plan.methods, plan.points)
    print(table(summary, cells, plan.methods, plan.points))
    print(f"\n{args.islands} islands (DP: workers) in one pool, no EMULATED slowdown, no network; "
          f"{args.budget:,} tokens per run; overrides for every run: {' '.join(args.overrides) or 'none'}; "
          f"median of {args.repeats} repeat(s) per cell")
    if args.json:
        args.json.write_text(json.dumps({"budget": args.budget, "islands": args.islands, "overrides": args.overrides,
                                         "runs": runs, "best": summary["best"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
