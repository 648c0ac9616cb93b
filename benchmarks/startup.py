"""Start-up cost of a run: how long a small ``train()`` takes end to end against its training time.

Every run starts an outer-optimizer process, a health-monitor process and one process per island
(each a Ray worker that imports torch); on a 2-core machine that dominates the short runs of the
test suite and the notebooks. This script starts one local Ray (as a notebook does), then runs
``--repeats`` identical small runs one after another and prints, per run and as medians: the wall
time of ``train()``, the training time the summary reports (``wall_s``, from the moment every island
trains to the stop), and their difference (start-up plus the final flush and teardown). The first
run also pays for cold file caches; the medians are over all runs.

Pool speeds are EMULATED (the slow pool is throttled), as in the notebooks' small settings.

Run from the repository root::

    python benchmarks/startup.py                 # 4 runs of 2 islands, nano model, 200k tokens
    python benchmarks/startup.py --islands-per-pool 2 --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=4, help="runs, one after another (default 4)")
    ap.add_argument("--islands-per-pool", type=int, default=1, help="islands in each of the 2 pools (default 1)")
    ap.add_argument("--budget", type=int, default=200_000, help="tokens per run (default 200,000)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.islands_per_pool < 1:
        ap.error("--repeats and --islands-per-pool must be >= 1")

    import ray

    from orchestrator.actors.remote import WORKER_ENV
    from orchestrator.config import load_config
    from orchestrator.run.driver import emulation_note, train

    n = args.islands_per_pool
    cfg = load_config(None, [
        "model.preset=nano", f"run.token_budget={args.budget}", "eval.interval_s=1.0", "eval.batches=16",
        "outer.sync_every_steps=20", "health.warm_spares=0", "data.max_bytes=2000000",
        f"pools=[{{name: fast, islands: {n}, cpus_per_island: 0.5}},"
        f" {{name: slow, islands: {n}, cpus_per_island: 0.5, emulated_slowdown: 3.0, emulated_jitter: 0.1}}]",
    ])
    t = time.monotonic()
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
    print(f"ray.init: {time.monotonic() - t:.1f} s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as tmp:
        for r in range(args.repeats):
            t = time.monotonic()
            summary = train(cfg, os.path.join(tmp, f"run{r}"))
            total = time.monotonic() - t
            rows.append((total, summary["wall_s"], total - summary["wall_s"]))
            print(f"run {r + 1}: train() {total:.1f} s, training {summary['wall_s']:.1f} s, "
                  f"start-up + stop {total - summary['wall_s']:.1f} s", flush=True)
    ray.shutdown()
    print()
    print(f"| {2 * n} islands, nano, {args.budget:,} tokens | train() s | training s | start-up + stop s |")
    print("| --- | ---: | ---: | ---: |")
    for r, (total, wall, rest) in enumerate(rows, 1):
        print(f"| run {r} | {total:.1f} | {wall:.1f} | {rest:.1f} |")
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"| median | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} |")
    print()
    print(emulation_note(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
