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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from orchestrator.config import ConfigError, apply_overrides, build_config, load_config, resume_conflict


class ProgressBar:
    """One status line on a terminal (redrawn in place), or a line every 10 s when not a terminal."""

    def __init__(self, stream: TextIO, *, emulation: str | None) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._last = 0.0
        if emulation:
            stream.write(f"{emulation}\n")

    def __call__(self, p) -> None:  # p: orchestrator.run.driver.Progress
        now = time.monotonic()
        if not self.tty and now - self._last < 10.0 and p.tokens < p.budget:
            return
        self._last = now
        frac = min(1.0, p.tokens / p.budget)
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        states = {}
        for s in p.islands.values():
            states[s] = states.get(s, 0) + 1
        line = (f"[{bar}] {frac:4.0%} {p.tokens / 1e6:6.2f}M/{p.budget / 1e6:.2f}M tokens | versions {p.versions}"
                f" | rounds {p.rounds} | train loss {p.train_loss or float('nan'):.3f}"
                f" | eval {p.eval_bpb or float('nan'):.3f} bits/byte | {p.elapsed_s:5.0f}s"
                f" | islands {', '.join(f'{n} {k}' for k, n in sorted(states.items()))}")
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line."""
        if self.tty:
            self.stream.write("\n")


def held_out_loss_cell(summary: dict) -> str:
    """The final held-out loss as the summary tables print it: under run.average_window it is the served
    moving average's, and the raw global model's follows it."""
    raw = summary.get("eval_loss_raw")
    return f"{summary['eval_loss']:.4f}" + ("" if raw is None else f" (moving average; raw global model {raw:.4f})")


def format_summary(summary: dict) -> str:
    """The short final table printed after `diloco train`."""
    rows = [
        ("mode", summary["mode"]),
        ("held-out loss (nats/byte)", held_out_loss_cell(summary)),
        ("held-out bits/byte", f"{summary['eval_bits_per_byte']:.3f}"),
        ("unigram bits/byte (baseline)", f"{summary['unigram_bits_per_byte']:.3f}"),
        ("tokens processed", f"{summary['tokens_processed']:,}"),
        ("tokens merged / refused / in flight", f"{summary['tokens_merged']:,.0f} / {summary['tokens_refused']:,.0f} / {summary['tokens_in_flight']:,.0f}"),
        ("rounds (refusals)", f"{summary['rounds']} ({summary['refusals']})"),
        ("bytes sent (up + down)", f"{summary['bytes_sent'] / 1e6:,.1f} MB"),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for isl in summary["islands"]:
        # Where and in what arithmetic, when not the plain CPU fp32 of most runs (GPU pools, per-pool precision).
        device, precision = isl.get("device"), isl.get("precision")
        where = f", {device or 'cpu'} {precision or 'fp32'}" if device not in (None, "cpu") or precision not in (None, "fp32") else ""
        lines.append(f"{'  island ' + str(isl['island']) + ' (' + isl['pool'] + ')':<{width}}  "
                     f"{isl['steps']} steps, {isl['tokens']:,} tokens, {isl['state']}{where}")
    if summary.get("emulation"):
        lines.append(summary["emulation"])
    if summary.get("network_emulated"):
        lines.append(summary["network"])  # starts with "EMULATED network"
    return "\n".join(lines)


def _cmd_train(args: argparse.Namespace) -> int:
    from orchestrator.run.driver import emulation_note, resume_config, train  # imports Ray: keep `--help` fast
    from policies.chaos import parse_chaos_spec

    try:
        if args.resume:
            if args.config:
                raise ConfigError("--resume takes the run directory's own config.yaml; drop --config")
            saved = resume_config(args.resume)
            cfg = build_config(apply_overrides(saved.model_dump(mode="json"), args.set))
            conflict = resume_conflict(saved, cfg)
            if conflict:
                raise ConfigError(conflict)
        else:
            cfg = load_config(args.config, args.set)
        if args.chaos:
            spec = parse_chaos_spec(args.chaos)
            cfg = cfg.model_copy(update={"chaos": type(cfg.chaos)(mode=spec.pop("mode"), horizon_s=cfg.chaos.horizon_s, params=spec)})
    except (ConfigError, ValueError) as err:
        print(f"diloco train: {err}", file=sys.stderr)
        return 2
    run_dir = Path(args.resume or args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    bar = ProgressBar(sys.stderr, emulation=emulation_note(cfg)) if not args.quiet else None
    address = args.address or os.environ.get("RAY_ADDRESS")
    try:
        summary = train(cfg, run_dir, address=address, progress=bar, resume=bool(args.resume))
    except Exception as err:  # noqa: BLE001 - one line for the user; the traceback is in driver.log
        if bar:
            bar.close()
        logging.getLogger(__name__).debug("train failed", exc_info=True)
        print(f"diloco train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    if bar:
        bar.close()
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from orchestrator.run.report import ReportError, write_report  # matplotlib is imported only when plotting

    try:
        paths = write_report(args.run_dir, args.out)
    except ReportError as err:
        print(f"diloco report: {err}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `diloco` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="diloco", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model with Decoupled DiLoCo on Ray",
                       description="Train on the embedded default (stdlib source) or your config.\n\nExample:\n"
                                   "  diloco train --run-dir runs/demo --set run.token_budget=3000000",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", help="YAML run config (default: built-in defaults, same as configs/default.yaml)")
    t.add_argument("--run-dir", help="where to write the event log and summary (default: runs/<timestamp>)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set outer.min_quorum=2 or one pool's: --set pools.slow.islands=3 (repeatable)")
    t.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run whose driver died, from its checkpoints")
    t.add_argument("--chaos", metavar="SPEC",
                   help="inject faults: none | tape:FILE.yaml | poisson:mtbf_s=60,seed=3 | fixed:failures=3")
    t.set_defaults(func=_cmd_train)
    r = sub.add_parser("report", help="plots and a markdown summary of a finished run",
                       description="Write loss.png, timeline.png and report.md for a run directory.\n\nExample:\n"
                                   "  diloco report runs/demo --out /tmp/demo-report",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by `diloco train`")
    r.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/report)")
    r.set_defaults(func=_cmd_report)
    try:
        from orchestrator.cli import simulate as simulate_cli
    except ImportError:  # the simulator is optional at import time only while it is being built
        simulate_cli = None
    if simulate_cli is not None:
        simulate_cli.register(sub)
    from orchestrator.deploy import jobs  # `diloco submit` and `diloco status` (Ray Jobs API, live runs)

    jobs.register(sub)
    from orchestrator.baselines import data_parallel as baseline_dp  # `diloco baseline-dp` (Ray Train TorchTrainer baseline; Ray imported lazily)

    baseline_dp.register(sub)
    from orchestrator.run import trained  # `diloco sample`, `evaluate`, `export` (a run's trained model)

    trained.register(sub)
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
