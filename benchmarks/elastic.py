"""Scavenged capacity: a run whose pool follows a capacity tape (2 -> 6 -> 3 islands) against fixed 2- and 6-island
runs of the same wall time.

Each variant runs on its own local Ray cluster (`ray.cluster_utils.Cluster`: a head with no CPU and one 1-CPU node
labelled pool=spot per island at the start), with the same model, data, seed and `run.max_wall_s`:

  elastic    pool spot `islands: {min: 2, max: 6}` on 2 nodes; its chaos tape adds 4 nodes at --join-at-s (fault
             node_joins: EMULATION, `ray start` of a labelled node on this machine) and drains 3 of the 4 islands
             they took at --drain-at-s with a --deadline-s deadline (fault drain_node: the GCS drain the cloud's
             preemption handler uses; each node is ended at its deadline): 2 -> 6 -> 3 islands.
  fixed-2    `islands: 2` on 2 nodes the whole time.
  fixed-6    `islands: 6` on 6 nodes the whole time.

Prints per repeat and the medians: tokens merged, held-out loss, goodput (over the capacity each run had), the
capacity itself (island-seconds), joins, leaves and the tokens the drained islands lost, and whether every token's
fate adds up. Inner steps are EMULATED slower (`emulated_slowdown`) so six islands fit two cores; all six
"machines" are processes on this one machine (EMULATION).

  python benchmarks/elastic.py --quick --json /tmp/elastic.json     # one repeat, 60 s runs (~5 minutes)
  python benchmarks/elastic.py                                      # 3 repeats, 90 s runs, medians (~18 minutes)
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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import orchestrator  # noqa: E402,F401 - before ray's first use: it sets Ray's log filter
from orchestrator.actors.remote import WORKER_ENV  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.run.driver import train  # noqa: E402
from policies.chaos import Fault, FaultTape  # noqa: E402

SPOT = {"pool": "spot"}
VARIANTS = ("elastic", "fixed-2", "fixed-6")
FATES = ("merged", "lost", "refused", "in_flight", "overwritten")


def config(islands, tape: Path | None, wall_s: float, seed: int) -> dict:
    """The run every variant trains: the small preset, EMULATED slow steps, a hard wall-clock stop."""
    return {
        "run": {"token_budget": 10**9, "max_wall_s": wall_s, "seed": seed, "call_timeout_s": 30},
        "model": {"preset": "tiny"},
        "data": {"max_bytes": 4_000_000},
        "eval": {"interval_s": 10.0, "batches": 4},
        "health": {"warm_spares": 0, "salvage_every_steps": 0},
        "chaos": {"mode": "tape", "params": {"path": str(tape)}} if tape else {"mode": "none"},
        "pools": [{"name": "spot", "islands": islands, "labels": SPOT, "cpus_per_island": 1.0, "region": "local",
                   "emulated_slowdown": 8.0}],
    }


def capacity_tape(join_at_s: float, drain_at_s: float, deadline_s: float) -> FaultTape:
    """2 -> 6 -> 3: four nodes join (slots 2-5 fill), then the nodes of islands 3, 4 and 5 are drained."""
    joins = [Fault(island=i, kind="node_joins", at_s=join_at_s + 0.5 * k) for k, i in enumerate(range(2, 6))]
    drains = [Fault(island=i, kind="drain_node", at_s=drain_at_s, duration_s=deadline_s) for i in (3, 4, 5)]
    return FaultTape(tuple(joins + drains))


def fates_exact(summary: dict) -> bool:
    """Every token has exactly one fate: per fragment, the fates add up to what the islands processed."""
    ledger = summary["token_ledger"]
    return all(sum(ledger[f][p] for f in FATES) == ledger["processed"][p] for p in range(len(ledger["processed"])))


def run_variant(name: str, root: Path, args) -> dict:
    """One variant on a fresh local cluster; its summary with the columns this benchmark prints."""
    start_nodes = {"elastic": 2, "fixed-2": 2, "fixed-6": 6}[name]
    islands = {"elastic": {"min": 2, "max": 6}, "fixed-2": 2, "fixed-6": 6}[name]
    tape = None
    if name == "elastic":
        root.mkdir(parents=True, exist_ok=True)
        tape = root / f"{name}-tape.yaml"
        capacity_tape(args.join_at_s, args.drain_at_s, args.deadline_s).to_yaml(tape)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                             "object_store_memory": 200 << 20})
    try:
        for _ in range(start_nodes):
            cluster.add_node(num_cpus=1, object_store_memory=100 << 20, labels=SPOT)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {**WORKER_ENV, "RAY_ADDRESS": cluster.address}},
                 logging_level="WARNING")
        t0 = time.monotonic()
        summary = train(build_config(config(islands, tape, args.wall_s, args.seed)), root / name)
        print(f"  {name}: {time.monotonic() - t0:.0f} s, merged {summary['tokens_merged']:,}, loss "
              f"{summary['eval_loss']:.4f}", file=sys.stderr)
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary["fates_exact"] = fates_exact(summary)
    summary["capacity_island_s"] = summary["allocated_s"]
    return summary


COLUMNS = ("tokens_merged", "eval_loss", "goodput", "capacity_island_s", "joins", "leaves", "drained_tokens_lost",
           "tokens_lost", "fates_exact")


def table(rows: dict[str, list[dict]]) -> str:
    """Markdown: one row per variant, medians over repeats (fates_exact: all repeats)."""
    head = "| variant | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (len(COLUMNS) + 1)]
    for name, runs in rows.items():
        cells = []
        for c in COLUMNS:
            values = [r.get(c, 0) for r in runs]
            if c == "fates_exact":
                cells.append(str(all(values)).lower())
            elif c in ("eval_loss", "goodput"):
                cells.append(f"{statistics.median(values):.4f}" if c == "eval_loss" else f"{statistics.median(values):.3f}")
            else:
                cells.append(f"{statistics.median(values):,.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat of 60 s runs")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every variant (default 3, quick 1)")
    ap.add_argument("--wall-s", type=float, default=None, help="each run's run.max_wall_s (default 90, quick 60)")
    ap.add_argument("--join-at-s", type=float, default=None, help="when four nodes join (default wall/6)")
    ap.add_argument("--drain-at-s", type=float, default=None, help="when three are drained (default 0.55 x wall)")
    ap.add_argument("--deadline-s", type=float, default=20.0, help="the drained nodes' deadline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the medians and every run here")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.wall_s = args.wall_s or (60.0 if args.quick else 90.0)
    args.join_at_s = args.join_at_s if args.join_at_s is not None else args.wall_s / 6
    args.drain_at_s = args.drain_at_s if args.drain_at_s is not None else 0.55 * args.wall_s
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        for k in range(args.repeats):
            for name in VARIANTS:
                print(f"repeat {k + 1}/{args.repeats}, {name}", file=sys.stderr)
                rows[name].append(run_variant(name, Path(tmp) / f"r{k}", args))
    print(f"EMULATION: 2-6 'machines' are Ray nodes on this one machine; inner steps throttled 8x. "
          f"Runs of {args.wall_s:.0f} s, tape 2 -> 6 islands at {args.join_at_s:.0f} s, -> 3 at {args.drain_at_s:.0f} s "
          f"(deadline {args.deadline_s:.0f} s); medians of {args.repeats}.")
    print(table(rows))
    elastic = rows["elastic"]
    out = {
        "joins": int(statistics.median(r["joins"] for r in elastic)),
        "leaves": int(statistics.median(r["leaves"] for r in elastic)),
        "drained_tokens_lost": int(max(r["drained_tokens_lost"] for r in elastic)),
        "fates_exact": all(r["fates_exact"] for runs in rows.values() for r in runs),
        "tokens_merged": {v: statistics.median(r["tokens_merged"] for r in runs) for v, runs in rows.items()},
        "eval_loss": {v: statistics.median(r["eval_loss"] for r in runs) for v, runs in rows.items()},
        "goodput": {v: statistics.median(r["goodput"] for r in runs) for v, runs in rows.items()},
        "capacity_island_s": {v: statistics.median(r["capacity_island_s"] for r in runs) for v, runs in rows.items()},
        "runs": {v: [{c: r.get(c) for c in COLUMNS} for r in runs] for v, runs in rows.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
