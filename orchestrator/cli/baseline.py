"""`diloco baseline-dp`: the synchronous data-parallel baseline on Ray Train (orchestrator.baselines.data_parallel)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from orchestrator.config import DATA_PARALLEL_MODE, ConfigError, load_config
from orchestrator.run.summary import held_out_loss_cell

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  diloco baseline-dp --run-dir runs/dp --set run.token_budget=1000000
  diloco baseline-dp --config configs/default.yaml --set network.scenario=wan-4-regions --set run.max_wall_s=120
  python -m orchestrator.cli baseline-dp --set run.token_budget=200000 --wire fp32
"""


def format_dp_summary(summary: dict) -> str:
    """The short final table printed after `diloco baseline-dp` (without the emulation and run-directory lines)."""
    rows = [("mode", f"{summary['mode']} ({summary['trainer']}, {summary['world_size']} workers, {summary['backend']})"),
            ("held-out loss (nats/byte)", held_out_loss_cell(summary)),
            ("held-out bits/byte", f"{summary['eval_bits_per_byte']:.3f}"),
            ("unigram bits/byte (baseline)", f"{summary['unigram_bits_per_byte']:.3f}"),
            ("tokens processed", f"{summary['tokens_processed']:,} ({summary['steps']} steps)"),
            ("bytes sent (all workers)", f"{summary['bytes_sent'] / 1e6:,.1f} MB"),
            ("wall time", f"{summary['wall_s']:.0f} s (+{summary['startup_s']:.0f} s Ray Train start-up)"),
            ("network", summary["network"])]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _show(p: dict) -> None:
    print(f"{p['wall_s']:6.0f}s  {p['tokens_processed'] / 1e6:6.2f}M tokens  held-out {p['eval_bits_per_byte']:.3f} bits/byte",
          file=sys.stderr)


# data_parallel.WIRE_BYTES's keys (tests/engine/test_preflight.py): that module imports torch, which
# building the `diloco` parser, for `diloco train` too, must not pay for.
WIRES = ("bf16", "fp32")


def _cmd_baseline_dp(args: argparse.Namespace) -> int:
    from orchestrator.baselines.data_parallel import train_data_parallel

    try:
        cfg = load_config(args.config, args.set, also_mode=DATA_PARALLEL_MODE)  # a DP run dir's own config.yaml too
    except ConfigError as err:
        print(f"diloco baseline-dp: {err}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/dp-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        summary = train_data_parallel(cfg, run_dir, address=args.address or os.environ.get("RAY_ADDRESS"),
                                      progress=None if args.quiet else _show, wire=args.wire, in_memory=args.in_memory)
    except ConfigError as err:
        print(f"diloco baseline-dp: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line for the user; the traceback is in driver.log
        log.debug("baseline-dp failed", exc_info=True)
        print(f"diloco baseline-dp: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(format_dp_summary(summary))
    if summary["emulation"]:
        print(summary["emulation"])
    print(f"run directory: {run_dir}")
    return 0


def register(subparsers) -> None:
    """Add `baseline-dp` to the `diloco` parser's subparsers."""
    p = subparsers.add_parser("baseline-dp", help="synchronous data-parallel baseline on Ray Train (TorchTrainer)",
                              description="Train the config's model with synchronous data parallelism on Ray Train's "
                                          "TorchTrainer: one worker per island slot, the same model, data, inner AdamW, "
                                          "token budget and EMULATED network as `diloco train`.",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML run config (default: built-in defaults); pools, model, data, inner, eval, run and network apply")
    p.add_argument("--run-dir", help="where to write summary.json and the event log (default: runs/dp-<timestamp>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--wire", choices=WIRES, default="bf16", help="gradient format on the EMULATED wire (default bf16)")
    p.add_argument("--in-memory", action="store_true",
                   help="read the whole corpus into every worker and sample random windows of its shard, instead of "
                        "streaming each island slot's units as `diloco train` does (the baseline before 2026-12-03)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd_baseline_dp)
