"""``diloco simulate`` and ``diloco simulate-sweep``: the goodput simulator from the command line.

``register(subparsers)`` adds the two subcommands to the project's ``diloco`` parser; ``main()``
runs them standalone (``python -m orchestrator.cli.simulate simulate ...``). The model lives in
:mod:`orchestrator.simulator.goodput`; this module parses, validates with one-line errors and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from orchestrator.simulator.goodput import METHODS, ConfigError, SimConfig, simulate

SWEEP_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
SWEEP_LEARNERS = (2, 4, 8, 16)

SIMULATE_EXAMPLES = """examples:
  diloco simulate --method dp --chips 1200000 --learners 8 --mtbi-chip-years 1
  diloco simulate --method decoupled --chips 1200000 --learners 8 --mtbi-chip-years 1 --json
  diloco simulate --method decoupled --chips 600000 --learners 4 --min-quorum 2 --seed 3
  diloco simulate --method dp --chips 1200000 --step-jitter-sigma 0.05   # stragglers too
"""
SWEEP_EXAMPLES = """examples:
  diloco simulate-sweep                                  # the README grid, PNG to goodput_vs_chips.png
  diloco simulate-sweep --chips 150000,1200000 --learners 8 --png /tmp/sweep.png
  diloco simulate-sweep --mtbi-chip-years 2 --json
"""


def _typed(kind, rule: str, ok):
    """argparse type: parse with ``kind``, then check ``ok``; errors say the rule and an example."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; {rule}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; {rule}")
        return value

    return parse


POS_INT = _typed(int, "pass an integer >= 1, e.g. 8", lambda v: v >= 1)
POS_FLOAT = _typed(float, "pass a number > 0, e.g. 1 (inf means no failures)", lambda v: v > 0)
NONNEG_FLOAT = _typed(float, "pass a finite number >= 0, e.g. 15", lambda v: 0 <= v < math.inf)


def _int_list(text: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``150000,300000``."""
    values = [POS_INT(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} has no values; pass e.g. 150000,300000")
    return values


class _Removed(argparse.Action):
    """``--checkpoint-interval-s`` (before issue 46 was closed): a one-line error naming what replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was removed: dp and elastic-dp recover from an intact replica and lose "
                     f"only the step in flight, so the lost work follows --step-time-s (default "
                     f"{SimConfig().step_time_s:g}; docs/simulator.md, Calibration)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared by both subcommands; each ``--x-y`` is the ``x_y`` field of SimConfig."""
    d = SimConfig()
    p.add_argument("--mtbi-chip-years", type=POS_FLOAT, default=d.mtbi_chip_years,
                   help="mean time between interruptions of one chip, in years (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g = p.add_argument_group("model (defaults are the calibrated ones, docs/simulator.md)")
    g.add_argument("--horizon-days", type=POS_FLOAT, default=d.horizon_days, help="simulated wall time (default %(default)s)")
    g.add_argument("--slice-chips", type=POS_INT, default=d.slice_chips, help="chips per slice, the failure domain (default %(default)s)")
    for flag, help_text in [
        ("recovery-mean-s", "mean time until a failed slice's capacity is back"),
        ("recovery-sigma", "lognormal log-space spread of recovery times (0 = constant)"),
        ("restart-s", "dp: job restart time after the failed slice is back"),
        ("reconfig-s", "elastic-dp / decoupled learner: pause to drop or re-add a slice"),
        ("step-time-s", "one inner step; dp / elastic-dp recover from an intact replica and lose the step in "
                        "flight on each failure, and decoupled's grace window counts in steps"),
        ("sync-period-s", "decoupled: stepping seconds between a learner's submissions"),
        ("salvage-period-s", "decoupled: stepping seconds between a learner's progress snapshots held outside it; "
                             "a learner that loses every slice keeps the work up to its last one (0 = off)"),
        ("grace-gamma", "decoupled: fraction of slack a round's grace window may spend"),
        ("grace-cap-s", "decoupled: upper bound of the grace window"),
        ("step-jitter-sigma", "stragglers: lognormal sigma of per-step, per-slice time (0 = off)"),
    ]:
        field = flag.replace("-", "_")
        g.add_argument(f"--{flag}", type=NONNEG_FLOAT, default=getattr(d, field),
                       help=f"{help_text} (default %(default)s)")
    g.add_argument("--min-quorum", type=POS_INT, default=d.min_quorum,
                   help="decoupled: minimum quorum K of learners per round (default %(default)s)")
    g.add_argument("--checkpoint-interval-s", action=_Removed, help=argparse.SUPPRESS)
    c = p.add_argument_group("capacity that comes and goes (elastic pools; docs/simulator.md)")
    c.add_argument("--capacity-mean-up-s", type=POS_FLOAT, default=d.capacity_mean_up_s,
                   help="mean seconds a learner slot's machines stay (default %(default)s: a fixed pool)")
    c.add_argument("--capacity-mean-down-s", type=NONNEG_FLOAT, default=d.capacity_mean_down_s,
                   help="mean seconds a slot is reclaimed before it comes back (default %(default)s)")
    c.add_argument("--capacity-without-notice", dest="capacity_notice", action="store_false",
                   help="reclaims come without notice: a learner loses its work since its last submission "
                        "(default: drained with notice, nothing lost)")



def _config(args: argparse.Namespace, parser: argparse.ArgumentParser, **overrides) -> SimConfig:
    """SimConfig from parsed flags; a bad combination exits 2 with one line naming the flag."""
    names = {f.name for f in dataclasses.fields(SimConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    try:
        return SimConfig(**values)
    except ConfigError as e:
        parser.error(f"--{e.field.replace('_', '-')} {e.value}: {e.rule}; {e.fix}")
        raise  # unreachable: parser.error exits


def run_simulate(args: argparse.Namespace) -> int:
    """``diloco simulate``: one run, goodput and uptime printed."""
    result = simulate(_config(args, args.sim_parser))
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    print(f"method {result.method}: {result.chips} chips in {result.slices} slices of {result.slice_chips}, "
          f"{result.learners} learner(s), {result.failures} slice failures over {result.horizon_s / 86400:g} days")
    print(f"goodput {result.goodput:.4f}  uptime {result.uptime:.4f}  "
          f"(closed form {result.details['closed_form_goodput']:.4f}, docs/simulator.md)")
    if result.available_fraction < 1.0:  # elastic capacity: goodput is over the chip-seconds present
        print(f"capacity present {result.available_fraction:.3f} of the time (goodput is over that capacity)")
    d = result.details
    if result.method == "decoupled" and d.get("wipes"):
        salvage = (f"; {d['salvages']} salvaged ({d['salvaged_chip_s'] / result.allocated_chip_s:.2%} of the chip-time)"
                   if args.salvage_period_s > 0 else "; salvage off (--salvage-period-s)")
        print(f"learners lost their state {d['wipes']} times{salvage}")
    return 0


def run_grid(base: SimConfig, chips=SWEEP_CHIPS, learners=SWEEP_LEARNERS) -> list[dict]:
    """Every (chips, method) cell, decoupled once per learner count; each row has its wall time."""
    rows = []
    for n in chips:
        for method, m in [("dp", 1), ("elastic-dp", 1)] + [("decoupled", k) for k in learners]:
            start = time.perf_counter()
            r = simulate(dataclasses.replace(base, method=method, chips=n, learners=m))
            rows.append({"chips": n, "method": method, "learners": r.learners, "goodput": r.goodput,
                         "uptime": r.uptime, "closed_form": r.details["closed_form_goodput"],
                         "failures": r.failures, "wall_s": time.perf_counter() - start})
    return rows


def _column(row: dict) -> str:
    return row["method"] if row["method"] != "decoupled" else f"decoupled M={row['learners']}"


def markdown_table(rows: list[dict], key: str = "goodput") -> str:
    """Chips down, methods across, ``key`` in the cells."""
    columns = list(dict.fromkeys(_column(r) for r in rows))
    cells = {(r["chips"], _column(r)): r[key] for r in rows}
    lines = ["| chips | " + " | ".join(columns) + " |", "| ---: |" + " ---: |" * len(columns)]
    for n in dict.fromkeys(r["chips"] for r in rows):
        lines.append(f"| {n:,} | " + " | ".join(f"{cells[n, c]:.3f}" for c in columns) + " |")
    return "\n".join(lines)


def plot_grid(rows: list[dict], path: str, title: str) -> None:
    """Goodput vs chips, one line per method, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for column in dict.fromkeys(_column(r) for r in rows):
        pts = [(r["chips"], r["goodput"]) for r in rows if _column(r) == column]
        ax.plot(*zip(*pts), marker="o", label=column)
    ax.set(xscale="log", xlabel="chips", ylabel="goodput", ylim=(0, 1.02), title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sweep(args: argparse.Namespace) -> int:
    """``diloco simulate-sweep``: the grid as a markdown table (or JSON rows) and a PNG."""
    base = _config(args, args.sim_parser, method="decoupled", chips=max(args.chips),
                   learners=min(args.learners))
    too_many = [m for m in args.learners if m > math.ceil(min(args.chips) / base.slice_chips)]
    if too_many:
        args.sim_parser.error(f"--learners {too_many[0]}: more learners than slices at {min(args.chips)} chips; "
                              f"use fewer learners or a smaller --slice-chips")
    rows = run_grid(base, args.chips, args.learners)
    if args.png:
        plot_grid(rows, args.png, f"goodput vs chips, MTBI {base.mtbi_chip_years:g} chip-years, "
                                  f"{base.horizon_days:g} days")
    if args.json:
        print(json.dumps({"rows": rows, "png": args.png}))
    else:
        print(markdown_table(rows, "goodput"))
        print()
        print(markdown_table(rows, "uptime"))
        if args.png:
            print(f"\nwrote {args.png}")
    return 0


def register(subparsers) -> None:
    """Add ``simulate`` and ``simulate-sweep`` to the ``diloco`` parser's subparsers."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("simulate", help="goodput of one method under chip failures",
                              description="Simulate one training job's goodput and uptime under per-chip failures.",
                              epilog=SIMULATE_EXAMPLES, formatter_class=fmt)
    p.add_argument("--method", choices=METHODS, required=True, help="training method to simulate")
    p.add_argument("--chips", type=POS_INT, required=True, help="total chips, e.g. 1200000")
    p.add_argument("--learners", type=POS_INT, default=SimConfig().learners,
                   help="decoupled: number of learners M (ignored by dp, elastic-dp; default %(default)s)")
    _add_model_flags(p)
    p.set_defaults(func=run_simulate, sim_parser=p)

    s = subparsers.add_parser("simulate-sweep", help="goodput vs chips for every method (table + PNG)",
                              description="Run the chips x methods grid and plot goodput vs chips.",
                              epilog=SWEEP_EXAMPLES, formatter_class=fmt)
    s.add_argument("--chips", type=_int_list, default=list(SWEEP_CHIPS), help="comma-separated chip counts")
    s.add_argument("--learners", type=_int_list, default=list(SWEEP_LEARNERS),
                   help="comma-separated learner counts for decoupled")
    s.add_argument("--png", default="goodput_vs_chips.png", help="PNG path ('' for none; default %(default)s)")
    _add_model_flags(s)
    s.set_defaults(func=run_sweep, sim_parser=s)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point with just the two simulator subcommands."""
    parser = argparse.ArgumentParser(prog="diloco", description="Decoupled DiLoCo goodput simulator.")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
