"""`diloco`: the command line. Environment variables are read here and nowhere else.

Examples:
  diloco train                                   # the default: 4 islands, 2 pools, 3M tokens, 109 s of training on 2 cores
  diloco train --run-dir runs/sync --set mode=sync-diloco
  diloco train --config configs/default.yaml --set run.token_budget=2000000 --set outer.min_quorum=2
  diloco train --model mypkg.models:build --loss mypkg.models:loss   # your own torch.nn.Module (docs/models.md)
  diloco simulate --method decoupled --chips 1200000 --learners 8 --mtbi-chip-years 1
  diloco submit --address http://127.0.0.1:8265 --config configs/default.yaml   # as a Ray job
  diloco status                                  # a live run's versions, islands, goodput
  diloco baseline-dp --set run.token_budget=1000000   # synchronous data parallel on Ray Train
  diloco sample runs/demo --prompt "def "        # continue a prompt with a run's trained model
  diloco evaluate runs/demo                      # its held-out loss, or on another corpus with --set data.*
  diloco export runs/demo --out demo.pt          # the trained model as a PyTorch file
  diloco check-cluster --cluster cluster.yaml --config configs/multi-region.yaml   # before `ray up`
  diloco dashboard install                       # the run-metrics Grafana dashboard, into this node's Ray session
"""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.run.notices import quiet_ray_notices

# Command -> the module of orchestrator.cli that registers it, in `diloco --help` order.
COMMANDS = {
    "train": "train",
    "report": "report",
    "simulate": "simulate", "simulate-sweep": "simulate",  # the goodput simulator, no Ray
    "submit": "jobs", "status": "jobs",  # Ray Jobs API, live runs
    "baseline-dp": "baseline",  # Ray Train TorchTrainer baseline
    "sample": "model", "evaluate": "model", "export": "model",  # a run's trained model
    "check-cluster": "cluster",  # a cluster.yaml against a config
    "dashboard": "dashboard",  # the Grafana dashboard of the run's metrics
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `diloco` argument parser: with every subcommand, or only with `command`'s module when it names one."""
    # Each command group's module is imported here, not at the top: importing `orchestrator.cli` (for
    # `orchestrator.cli.simulate`, say) then stays light, and `python -m orchestrator.cli.simulate` runs cleanly.
    # Only the named command's module: others import torch or Ray (seconds on a small machine), and
    # `diloco train` prints its first lines before it loads either.
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules:
        _module(name).register(sub)
    return parser


def _module(name: str):
    """The command module `orchestrator.cli.<name>`, imported by name here so that import walks see every edge."""
    if name == "train":
        from orchestrator.cli import train as module
    elif name == "report":
        from orchestrator.cli import report as module
    elif name == "simulate":
        from orchestrator.cli import simulate as module
    elif name == "jobs":
        from orchestrator.cli import jobs as module
    elif name == "baseline":
        from orchestrator.cli import baseline as module
    elif name == "model":
        from orchestrator.cli import model as module
    elif name == "cluster":
        from orchestrator.cli import cluster as module
    elif name == "dashboard":
        from orchestrator.cli import dashboard as module
    else:
        raise ValueError(f"no command module {name!r}; add it to COMMANDS and here")
    return module


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `diloco` console script."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[_stderr_handler()])
    quiet_ray_notices()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return args.func(args)


class _Console(logging.Formatter):
    """The console's warning lines: `diloco: <message>` (`diloco: error: ...`), no time or module name."""

    def format(self, record: logging.LogRecord) -> str:
        return f"diloco: {'error: ' if record.levelno >= logging.ERROR else ''}{super().format(record)}"


def _stderr_handler() -> logging.Handler:
    # The console shows warnings only (the progress bar owns the line); driver.log gets everything.
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.WARNING)
    h.setFormatter(_Console("%(message)s"))
    return h


if __name__ == "__main__":
    sys.exit(main())
