"""`diloco`: the command line. Environment variables are read here and nowhere else.

Examples:
  diloco train                                   # the default: 4 islands, 2 pools, ~3 minutes on 2 cores
  diloco train --run-dir runs/sync --set mode=sync-diloco
  diloco train --config configs/default.yaml --set run.token_budget=2000000 --set outer.min_quorum=2
  diloco simulate --method decoupled --chips 1200000 --learners 8 --mtbi-chip-years 1
  diloco submit --address http://127.0.0.1:8265 --config configs/default.yaml   # as a Ray job
  diloco status                                  # a live run's versions, islands, goodput
  diloco baseline-dp --set run.token_budget=1000000   # synchronous data parallel on Ray Train
  diloco sample runs/demo --prompt "def "        # continue a prompt with a run's trained model
  diloco evaluate runs/demo                      # its held-out loss, or on another corpus with --set data.*
  diloco export runs/demo --out demo.pt          # the trained model as a PyTorch file
  diloco check-cluster --cluster cluster.yaml --config configs/multi-region.yaml   # before `ray up`
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    """The `diloco` argument parser with every subcommand."""
    # Each command group's module is imported here, not at the top: importing `orchestrator.cli` (for
    # `orchestrator.cli.simulate`, say) then stays light, and `python -m orchestrator.cli.simulate` runs cleanly.
    from orchestrator.cli import baseline, cluster, jobs, model, report, simulate, train

    parser = argparse.ArgumentParser(prog="diloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train.register(sub)  # `diloco train`
    report.register(sub)  # `diloco report`
    simulate.register(sub)  # `diloco simulate`, `simulate-sweep` (the goodput simulator, no Ray)
    jobs.register(sub)  # `diloco submit` and `diloco status` (Ray Jobs API, live runs)
    baseline.register(sub)  # `diloco baseline-dp` (Ray Train TorchTrainer baseline; Ray imported lazily)
    model.register(sub)  # `diloco sample`, `evaluate`, `export` (a run's trained model)
    cluster.register(sub)  # `diloco check-cluster` (a cluster.yaml against a config)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `diloco` console script."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[_stderr_handler()])
    args = build_parser().parse_args(argv)
    return args.func(args)


def _stderr_handler() -> logging.Handler:
    # The console shows warnings only (the progress bar owns the line); driver.log gets everything.
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.WARNING)
    return h


if __name__ == "__main__":
    sys.exit(main())
