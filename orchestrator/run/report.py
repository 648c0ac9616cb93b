"""`diloco report RUN_DIR`: plots and a markdown summary of a finished run, from its files alone.

Reads `summary.json` and the Parquet event log (:mod:`orchestrator.core.eventlog`) and writes, into
`RUN_DIR/report/` by default:

- `loss.png`: held-out loss (nats/byte) and bits/byte over wall time and over tokens processed,
  the unigram baseline and the injected faults marked;
- `timeline.png`: a Gantt chart of every island slot's states (:func:`policies.goodput.merge_timeline`),
  failures, rejoins and the injected faults marked;

all on one clock, seconds since the run started (summary.json's `run_start`: goodput's and the chaos
tape's clock, set when every island of the first placement trains; start-up shows before 0);
- `report.md`: the numbers of summary.json in prose and tables, linking the two plots.

No Ray here: a copied run directory reports anywhere. A run that predates an event kind gets its
report without that plot, and report.md says why. matplotlib (the `plots` extra) is imported lazily;
without it (the basic install) the report is report.md alone, which says how to get the plots.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pyarrow as pa

from orchestrator.core.accounting import shown_fates
from orchestrator.core.eventlog import read_events
from orchestrator.run.baseline_compare import ReportError, compare_to_baseline
from orchestrator.run.summary import faults_cell
from policies.goodput import TIMELINE_STATES, Interval, merge_timeline
from policies.island_states import IslandState

__all__ = ["PLOTS_HINT", "ReportError", "baseline_line", "have_matplotlib", "write_report", "timeline_intervals"]

log = logging.getLogger(__name__)

# "starting" (a first start) in a light shade of "reintegrating" (a start after a failure): both are start-up.
# "vacant" (an elastic slot without a machine) near white: capacity the run did not have.
STATE_COLORS = {IslandState.STARTING: "#aec7e8", IslandState.TRAINING: "#2ca02c", IslandState.BLOCKED: "#bcbd22",
                IslandState.DEAD: "#d62728", IslandState.RESTARTING: "#ff7f0e", IslandState.REINTEGRATING: "#1f77b4",
                IslandState.LEAVING: "#9467bd", IslandState.VACANT: "#f0f0f0"}
assert tuple(STATE_COLORS) == TIMELINE_STATES


# The README installs this checkout editable, so the extra is named the way that install spells it.
PLOTS_HINT = 'matplotlib is not installed; pip install -e ".[plots]" for loss.png and timeline.png'


def have_matplotlib() -> bool:
    """Whether matplotlib imports: the plots need it, report.md does not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError(PLOTS_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]] | None:
    """Rows of one event kind; None when the run predates the kind (its folder is absent)."""
    if not (run_dir / "events" / kind).is_dir():
        return None
    try:
        return read_events(run_dir, kind).to_pylist()
    except (OSError, pa.ArrowException) as err:
        raise ReportError(f"{run_dir / 'events' / kind} is unreadable ({err}); move the damaged part file aside") from None


def _fmt(value: Any, spec: str = "") -> str:
    """``format(value, spec)``, or "n/a" for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def timeline_intervals(rows: list[dict[str, Any]], origin: float | None = None) -> tuple[list[Interval], float]:
    """Intervals (seconds since `origin`, default the first event) and the origin, from `timeline` rows.

    "stopped" (and any non-timeline state) adds no bar; every event, "stopped" included, can be the
    last one, which closes the timeline. Start-up before `origin` (the run's start) has negative times.
    """
    if not rows:
        return [], 0.0 if origin is None else origin
    end = max(r["at"] for r in rows)
    t0 = min(r["at"] for r in rows) if origin is None else origin
    events = [(r["at"] - t0, int(r["island"]), int(r["incarnation"]), r["state"]) for r in rows
              if r["state"] in TIMELINE_STATES]
    return merge_timeline(events, end=end - t0), t0


def _marks(intervals: list[Interval]) -> tuple[list[Interval], list[Interval]]:
    """Failures (each "dead" interval) and rejoins (first "training" of an incarnation > 1 that was not a
    first start: a resumed run's new session starts its slots above incarnation 1, "starting")."""
    first: dict[tuple[int, int], Interval] = {}
    started = {(iv.island, iv.incarnation) for iv in intervals if iv.state == IslandState.STARTING}
    for iv in sorted(intervals, key=lambda iv: iv.start):
        if iv.state == IslandState.TRAINING and iv.incarnation > 1 and (iv.island, iv.incarnation) not in started:
            first.setdefault((iv.island, iv.incarnation), iv)
    return [iv for iv in intervals if iv.state == IslandState.DEAD], list(first.values())


def run_clock(summary: dict, faults: list[dict[str, Any]] | None) -> float | None:
    """The wall time (time.time) the run's clock starts at: summary.json's `run_start`, else what a fired fault's
    `at` minus its `run_s` gives (older runs); None when neither says. report.md's fault times, loss.png's wall
    time and timeline.png all count from it."""
    if summary.get("run_start") is not None:
        return float(summary["run_start"])
    for f in faults or []:
        if f.get("at") is not None and f.get("run_s") is not None:
            return float(f["at"]) - float(f["run_s"])
    return None


def _fault_times(faults: list[dict[str, Any]], t0: float | None) -> list[float]:
    """Fired faults in seconds since the run started: `run_s`, else (approximately) `at` minus the
    first timeline event's time `t0`; faults with neither are left out."""
    out = []
    for f in (f for f in faults if f.get("outcome", "fired") == "fired"):
        if f.get("run_s") is not None:
            out.append(float(f["run_s"]))
        elif f.get("at") is not None and t0 is not None:
            out.append(float(f["at"]) - t0)
    return sorted(out)


def _save(plt, fig, summary: dict, path: Path) -> None:
    """Lay out, add the EMULATION line under the figure when pool speeds were emulated, write the PNG."""
    fig.tight_layout()
    if summary.get("emulation"):
        fig.text(0.5, -0.01, summary["emulation"], ha="center", va="top", fontsize=8, style="italic")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_loss(evals: list[dict[str, Any]], summary: dict, fault_s: list[float], path: Path, title: str) -> None:
    """Held-out loss (top) and bits/byte (bottom) over wall time (left) and tokens processed (right)."""
    import numpy as np

    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    pts = sorted(evals, key=lambda e: e["wall_s"])
    wall = np.array([e["wall_s"] for e in pts], dtype=float)
    toks = np.array([e["tokens_processed"] for e in pts], dtype=float)
    series = [("eval_loss", "held-out loss (nats/byte)", "tab:blue"),
              ("eval_bits_per_byte", "held-out bits/byte", "tab:purple")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex="col", sharey="row")
    unigram = summary.get("unigram_bits_per_byte")
    for col, (xs, fx) in enumerate([(wall, fault_s), (toks, list(np.interp(fault_s, wall, toks)))]):
        for row, (key, label, color) in enumerate(series):
            ax = axes[row][col]
            ax.plot(xs, [e[key] for e in pts], "o-", ms=3, color=color, label=label)
            if row == 1 and unigram is not None:
                ax.axhline(unigram, color="gray", ls="--", lw=1, label=f"unigram baseline ({unigram:.3f} bits/byte)")
            for i, x in enumerate(fx):
                ax.axvline(x, color="tab:red", ls=":", lw=1, alpha=0.8, label="injected fault" if i == 0 else None)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel(label)
            else:
                ax.legend(loc="best", fontsize=8)
    axes[0][0].set_title("over wall time")
    axes[0][1].set_title("over tokens processed")
    axes[1][0].set_xlabel("wall time (s since training started)")
    axes[1][1].set_xlabel("tokens processed (millions)")
    axes[1][1].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:g}"))
    fig.suptitle(title)
    _save(plt, fig, summary, path)


def plot_timeline(intervals: list[Interval], labels: dict[int, str], summary: dict, path: Path, title: str,
                  fault_s: list[float] | None = None, *, run_clock: bool = True) -> None:
    """Gantt chart: one row per island slot, a bar per state interval, failures x, rejoins triangles, injected
    faults (`fault_s`, the run's clock) dotted. `run_clock`: times count from the run's start (start-up is
    negative), as report.md's and loss.png's do; else from the first timeline event (a run that recorded no start)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    islands = sorted({iv.island for iv in intervals} | set(labels))
    row = {island: k for k, island in enumerate(islands)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(islands)))
    for iv in intervals:
        ax.broken_barh([(iv.start, iv.duration)], (row[iv.island] - 0.35, 0.7), facecolors=STATE_COLORS[iv.state])
    fails, rejoins = _marks(intervals)
    ax.scatter([iv.start for iv in fails], [row[iv.island] for iv in fails], marker="x", s=70, color="black", zorder=3)
    ax.scatter([iv.start for iv in rejoins], [row[iv.island] for iv in rejoins], marker="^", s=60,
               facecolor="white", edgecolor="black", zorder=3)
    ax.set_yticks(range(len(islands)), [labels.get(i, f"island {i}") for i in islands])
    ax.invert_yaxis()
    for i, x in enumerate(fault_s or []):
        ax.axvline(x, color="tab:red", ls=":", lw=1, alpha=0.8, label="injected fault" if i == 0 else None)
    ax.set_xlim(min(0.0, min((iv.start for iv in intervals), default=0.0)), max((iv.end for iv in intervals), default=1.0))
    ax.set_xlabel("seconds since the run started (start-up before 0; report.md's clock)" if run_clock
                  else "seconds since the first timeline event")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    handles += [Line2D([], [], color="tab:red", ls=":", label="injected fault")] if fault_s else []
    handles += [Line2D([], [], ls="", marker="x", color="black", label="failure (island dead)"),
                Line2D([], [], ls="", marker="^", markerfacecolor="white", markeredgecolor="black",
                       label="rejoin (new incarnation trains)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    ax.set_title(title)
    _save(plt, fig, summary, path)


def _island_rows(summary: dict, island_events: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per island slot: summary.json's islands, else the newest incarnation in the `islands` events."""
    if summary.get("islands"):
        return sorted(summary["islands"], key=lambda s: s["island"])
    newest: dict[int, dict[str, Any]] = {}
    for r in island_events or []:
        if r["island"] not in newest or r["incarnation"] > newest[r["island"]]["incarnation"]:
            newest[r["island"]] = r
    return [{k: r.get(k) for k in ("island", "pool", "incarnation", "steps", "tokens")} for _, r in sorted(newest.items())]


def _summary_rows(summary: dict) -> tuple[list[tuple[str, str]], set[str]]:
    """report.md's summary table as (field, value) rows, and the keys it read that summary.json lacks."""
    absent: set[str] = set()  # keys this run's summary.json lacks (written by an older version)

    def s(key: str) -> Any:
        if key not in summary:
            absent.add(key)
        return summary.get(key)

    unigram, bpb = s("unigram_bits_per_byte"), s("eval_bits_per_byte")
    below = f", {unigram - bpb:.3f} below" if None not in (unigram, bpb) else ""
    pct = lambda v: f" ({v:.1%})" if isinstance(v, (int, float)) else ""  # noqa: E731
    mb = lambda v: f"{v / 1e6:,.1f} MB" if isinstance(v, (int, float)) else "n/a"  # noqa: E731
    states, fired = s("time_by_state_s"), faults_cell(summary)
    shown = shown_fates(summary["token_ledger"]) if summary.get("token_ledger") else None  # rows that add up
    rows = [
        ("mode", _fmt(s("mode"))),
        ("held-out loss (nats/byte)", _fmt(s("eval_loss"), ".4f")),
        ("held-out bits/byte", f"{_fmt(bpb, '.3f')} (unigram baseline {_fmt(unigram, '.3f')}{below})"),
        ("tokens processed", _fmt(s("tokens_processed"), ",")),
        ("tokens merged / refused / lost / in flight / overwritten (they add up to processed)",
         " / ".join(_fmt(shown[k], ",") for k in ("merged", "refused", "lost", "in_flight", "overwritten")) if shown else
         " / ".join(_fmt(s(k), ",.0f") for k in ("tokens_merged", "tokens_refused", "tokens_lost", "tokens_in_flight",
                                                  "tokens_overwritten"))),
        *([("of them, in earlier driver sessions (to the checkpoint the last one resumed from)",
            _fmt(summary["token_ledger_before"]["processed"][0], ","))] if summary.get("token_ledger_before") else []),
        ("goodput", _fmt(s("goodput"), ".3f") + pct(s("goodput"))),
        ("uptime (from the first version advance after every island was merged)", _fmt(s("uptime"), ".3f") + pct(s("uptime"))
         + (f"; pipeline fill {s('fill_s'):.1f} s before it" if s("fill_s") is not None else "")),
        ("island time by state (s)", ", ".join(f"{k} {v:.1f}" for k, v in states.items()) if states else "n/a"),
        ("failures / restarts", f"{_fmt(s('failures'))} / {_fmt(s('restarts'))}"),
        ("mean time to detect / to rejoin (s)", "none (no failures)" if s("failures") == 0 else
         f"{_fmt(s('mean_time_to_detect_s'), '.2f')} / {_fmt(s('mean_time_to_rejoin_s'), '.2f')}"),
        *([("faults fired", fired)] if fired else []),
        ("tokens salvaged from dead islands (salvages; progress keepers replaced)",
         f"{_fmt(s('salvaged_tokens'), ',.0f')} ({_fmt(s('salvages'))}; {_fmt(s('keeper_restarts'))})"),
        ("rounds (refusals)", f"{_fmt(s('rounds'))} ({_fmt(s('refusals'))})"),
        ("bytes sent (up + down)", f"{mb(s('bytes_sent'))} ({mb(s('bytes_up'))} up, {mb(s('bytes_down'))} down)"),
        ("wall time (s)", _fmt(s("wall_s"), ".0f")),
    ]
    return rows, absent


def render_markdown(run_dir: Path, summary: dict, islands: list[dict], faults: list[dict] | None,
                    written: dict[str, Path], missing: dict[str, str]) -> str:
    """report.md's text: summary table, per-island table, injected faults, plot links (or why not)."""
    rows, absent = _summary_rows(summary)
    s = summary.get
    # The resolved name: `diloco report runs/latest` names the run, not the link.
    out = [f"# Run report: {run_dir.resolve().name}", "", f"Run directory: `{run_dir}`", ""]
    if s("emulation"):
        out += [s("emulation"), ""]
    if s("resumed"):
        out += ["This run was resumed: wall times restart at each driver session.", ""]
    out += ["## Summary", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    out += ["## Islands", "", "| island | pool | incarnation | failures | restarts | steps | tokens |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {_fmt(i.get('island'))} | {_fmt(i.get('pool'))} | {_fmt(i.get('incarnation'))} | {_fmt(i.get('failures'))} "
            f"| {_fmt(i.get('restarts'))} | {_fmt(i.get('steps'), ',')} | {_fmt(i.get('tokens'), ',')} |" for i in islands]
    if islands and all("incarnations" in i for i in islands):  # older runs counted steps of the last incarnation
        out += ["", "Steps and tokens count every incarnation of a slot; incarnation is the last one's number."]
    out += ["", "## Injected faults", ""]
    if faults is None:
        out.append("n/a: this run directory has no `faults` events (it predates them).")
    else:
        out += ["Seconds since the run started (the chaos injector's clock):" if faults else "None."]
    for f in faults or []:
        out.append(f"- {_fmt(f.get('run_s'), '.1f')} s: {_fmt(f.get('kind'))} on island {_fmt(f.get('island'))} "
                   f"(incarnation {_fmt(f.get('incarnation'))}): {_fmt(f.get('outcome'))}")
    out += ["", "## Plots", ""]
    for key, caption in (("loss", "held-out loss"), ("timeline", "island timeline")):
        if key in written:
            out += [f"![{caption}]({written[key].name})", ""]
        else:
            out += [f"No {key}.png: {missing[key]}", ""]
    if any("n/a" in v for _, v in rows):
        # Only a summary.json that lacks keys is an older run's; a present None had nothing to measure.
        out.append(f"Fields shown as n/a are absent from this run's summary.json (an older run: no {', '.join(sorted(absent))})."
                   if absent else "Fields shown as n/a had nothing to measure in this run.")
    return "\n".join(out).rstrip() + "\n"


def baseline_line(run_dir: str | Path, baseline: str | Path) -> str:
    """The console's line for `diloco report RUN_DIR --baseline OTHER`: the loss gap at equal tokens and bytes."""
    return compare_to_baseline(run_dir, baseline).line()


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, baseline: str | Path | None = None) -> dict[str, Path]:
    """Write loss.png, timeline.png and report.md for a finished run; returns the paths written by name.

    Without matplotlib only report.md is written (its Plots section says how to get the plots); a
    caller tells the user with :data:`PLOTS_HINT` when "report" is the only name returned.

    Args:
        run_dir: a run directory written by `diloco train` (summary.json plus events/).
        out_dir: where to write; default `RUN_DIR/report`.
        baseline: another finished run's directory (e.g. `diloco baseline-dp`'s); report.md then says how far this
            run is from it (orchestrator.run.baseline_compare), and the return value holds no more paths.

    Raises:
        ReportError: no such directory, no or unreadable summary.json or events.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory; pass the --run-dir of a `diloco train` run")
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ReportError(f"{run_dir} has no summary.json; is it a finished run directory?")
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"{path} is not valid JSON ({err}); the run may have died while writing it") from None
    # Before anything is written: a baseline that cannot be read leaves no half report behind.
    comparison = compare_to_baseline(run_dir, baseline) if baseline is not None else None
    plots = have_matplotlib()
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    evals = _events(run_dir, "evals") or summary.get("evals") or []
    timeline, faults, island_events = (_events(run_dir, k) for k in ("timeline", "faults", "islands"))
    # One clock for report.md's faults, loss.png and timeline.png: the run's start (summary.json's run_start).
    origin = run_clock(summary, faults)
    intervals, t0 = timeline_intervals(timeline or [], origin)
    pools = {r["island"]: r.get("pool") for r in (island_events or [])}
    pools.update({r["island"]: r.get("pool") for r in summary.get("islands", [])})
    labels = {i: f"island {i} ({p})" if p else f"island {i}" for i, p in pools.items()}
    name = f"{summary.get('mode', 'run')} run {run_dir.resolve().name}"
    written: dict[str, Path] = {}
    missing: dict[str, str] = {}
    if not plots:
        missing["loss"] = missing["timeline"] = PLOTS_HINT + "."
    elif evals:
        written["loss"] = out / "loss.png"
        plot_loss(evals, summary, _fault_times(faults or [], t0 if timeline else None), written["loss"],
                  f"Held-out loss, {name}")
    else:
        missing["loss"] = "no `evals` events and no evals in summary.json."
    if plots and intervals:
        written["timeline"] = out / "timeline.png"
        fails, rejoins = _marks(intervals)
        plot_timeline(intervals, labels, summary, written["timeline"],
                      f"Island timeline, {name}: {len(fails)} failures, {len(rejoins)} rejoins",
                      _fault_times(faults or [], t0), run_clock=origin is not None)
    elif plots:
        missing["timeline"] = "no `timeline` events, so the timeline is missing (older runs predate them)."
    for key, why in missing.items():
        if plots:  # without matplotlib the caller says so, once
            log.warning("%s: skipping %s.png, %s", run_dir, key, why)
    written["report"] = out / "report.md"
    islands = _island_rows(summary, island_events)
    text = render_markdown(run_dir, summary, islands, faults, written, missing)
    if comparison is not None:
        text += "\n" + comparison.markdown()
    written["report"].write_text(text)
    return written
