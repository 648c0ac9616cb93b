"""Goodput accounting, exactly as docs/architecture.md section 6 defines it.

- Allocated time: every island slot, wall time from run start to run end, less the time a slot of an
  elastic pool was ``vacant`` (its pool had no machine for it: capacity the run never had):
  ``allocated_s = islands * (run_end - run_start) - vacant_s``.
- Useful time: inner-step compute time whose effect reached the global parameters through a merged
  submission (the caller measures it and passes ``useful_s``).
- Lost time: ``lost_s = allocated_s - useful_s``; :attr:`GoodputReport.by_state_s` breaks the
  island timeline down by state (downtime is ``starting + dead + restarting + reintegrating``).
  ``starting`` is a slot's first start (placing its process, building the model, first fetch) and
  ``restarting`` then ``reintegrating`` a start after a failure; a first start is downtime like a
  reintegration: the slot is allocated but not yet useful, with or without failures.
- ``goodput = useful_s / allocated_s``.
- Uptime: fraction of wall time in which the global version advanced "recently" (within
  ``uptime_window_s`` after some advance), on a clock that starts at the run's first advance once
  the pipeline is full (``fill_until``: every island of the first placement has had a submission
  merged or has failed; :func:`pipeline_full_at`). Before it the islands are taking their first inner
  steps and versions advance rarely or not at all, with or without failures; counting that pipeline
  fill as down gave a failure-free run an uptime of 0.88-0.94, so uptime could not tell a stall from a
  start. Islands that start at different times (some in prestarted workers) make the fill longer
  than the first advance: one early island alone advances versions seconds apart. The fill is
  reported apart (``fill_s``).
  The clock stops when the run begins stopping (``uptime_until``): versions are then held on purpose.
- Tokens: every token has a fate (merged, lost with a failure, refused, overwritten by an ``overwrite``
  adoption before it was cut, or still in flight at the
  end); ``processed`` is their sum.

Pure functions over numbers: the health monitor records the timeline, the driver calls
:func:`goodput_report` at the end, and the simulator reuses the same code.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from policies.island_states import IslandState

__all__ = [
    "TIMELINE_STATES",
    "Interval",
    "merge_timeline",
    "GoodputReport",
    "goodput_report",
    "pipeline_full_at",
    "uptime_fraction",
    "uptime_window_from_rounds",
]

# "starting": a slot's first start; "restarting" then "reintegrating": a start after a failure (or, in an elastic
# pool, after a vacancy). "leaving": an island on a drained node flushing its progress before it goes; "vacant": an
# elastic slot with no machine in its pool (not allocated: goodput is over the capacity the run had).
TIMELINE_STATES = (IslandState.STARTING, IslandState.TRAINING, IslandState.BLOCKED, IslandState.DEAD, IslandState.RESTARTING,
                   IslandState.REINTEGRATING, IslandState.LEAVING, IslandState.VACANT)

_TOL = 1e-9


def _check_state(state: str, where: str) -> None:
    if state not in TIMELINE_STATES:
        raise ValueError(f"{where}: state must be one of {tuple(map(str, TIMELINE_STATES))}, got {state!r}")


@dataclass(frozen=True)
class Interval:
    """Island slot ``island`` spent ``[start, end)`` in ``state`` during incarnation ``incarnation``."""

    island: int
    incarnation: int
    state: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


def merge_timeline(events: Sequence[tuple[float, int, int, str]], *, end: float) -> list[Interval]:
    """Turn state transitions into closed intervals per island slot.

    Each event ``(time, island, incarnation, new_state)`` says that island slot ``island`` entered
    ``new_state`` (during ``incarnation``) at ``time``. Events are sorted by time (stable, so events
    at equal times keep their given order) and each state runs until the island's next event, the
    last one until ``end``. An event that repeats the current ``(incarnation, state)`` extends the
    interval instead of splitting it; zero-length intervals are dropped (and the intervals on either
    side joined when they agree); events after ``end`` are ignored (so ``end`` may cut a live
    timeline). Time before an island's first event is not covered.

    Returns:
        Intervals sorted by ``(island, start)``.
    """
    if math.isnan(end):
        raise ValueError("end must be a number, got nan; pass the time the timeline is closed at")
    for i, ev in enumerate(events):
        if len(ev) != 4:
            raise ValueError(f"events[{i}] must be (time, island, incarnation, new_state), got {ev!r}")
        _check_state(ev[3], f"events[{i}]")
        if math.isnan(ev[0]):
            raise ValueError(f"events[{i}] has time nan; every transition needs a time")
    ordered = sorted(events, key=lambda ev: ev[0])
    current: dict[int, tuple[int, str, float]] = {}  # island -> (incarnation, state, since)
    out: list[Interval] = []

    last: dict[int, int] = {}  # island -> index in out of its latest interval

    def close(island: int, until: float) -> None:
        inc, state, since = current[island]
        if until <= since:
            return
        prev = out[last[island]] if island in last else None
        if prev is not None and (prev.incarnation, prev.state, prev.end) == (inc, state, since):
            out[last[island]] = Interval(island, inc, state, prev.start, until)  # a 0 s state came between
        else:
            last[island] = len(out)
            out.append(Interval(island, inc, state, since, until))

    for time, island, incarnation, state in ordered:
        if time > end:
            break
        if island in current:
            inc, cur, _ = current[island]
            if (inc, cur) == (incarnation, state):
                continue
            close(island, time)
        current[island] = (incarnation, state, time)
    for island in current:
        close(island, end)
    out.sort(key=lambda iv: (iv.island, iv.start))
    return out


@dataclass(frozen=True)
class GoodputReport:
    """What a run's island time and tokens turned into.

    Attributes:
        goodput: ``useful_s / allocated_s``.
        uptime: fraction of ``[first advance, uptime_until]`` within ``uptime_window_s`` after a
            global version advance; 0.0 when no version advanced before ``uptime_until``.
        fill_s: ``run_start`` to the first advance at or after ``fill_until`` (the pipeline fill); to
            ``uptime_until`` if none.
        allocated_s: ``islands * (run_end - run_start)`` less the slots' ``vacant`` time: the capacity the run had.
        useful_s: island compute time that reached the global parameters.
        lost_s: ``allocated_s - useful_s``.
        by_state_s: seconds per timeline state (every state present), intervals clipped to the run.
        tokens: ``merged``, ``lost``, ``refused``, ``in_flight``, ``overwritten`` and their sum ``processed``.
    """

    goodput: float
    uptime: float
    fill_s: float
    allocated_s: float
    useful_s: float
    lost_s: float
    by_state_s: dict[str, float]
    tokens: dict[str, int]


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the union of [lo, hi] spans."""
    if not spans:
        return 0.0
    ordered = sorted(spans)
    total = 0.0
    cur_lo, cur_hi = ordered[0]
    for lo, hi in ordered[1:]:
        if lo > cur_hi:
            total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    return total + (cur_hi - cur_lo)


def uptime_fraction(
    version_advances: Sequence[float], *, run_start: float, run_end: float, uptime_window_s: float
) -> float:
    """``|union over t of [t, t + uptime_window_s] ∩ [run_start, run_end]| / (run_end - run_start)``.

    Each global version advance at time ``t`` makes the run "up" for the next ``uptime_window_s``
    seconds: the global model advanced within the last window. Computed exactly by interval union.
    """
    if not run_end > run_start:
        raise ValueError(f"run_end must be > run_start, got run_start={run_start}, run_end={run_end}")
    if math.isnan(uptime_window_s) or uptime_window_s <= 0:
        raise ValueError(f"uptime_window_s must be > 0, got {uptime_window_s}; use uptime_window_from_rounds()")
    spans = []
    for t in version_advances:
        lo, hi = max(t, run_start), min(t + uptime_window_s, run_end)
        if hi > lo:
            spans.append((lo, hi))
    return _union_length(spans) / (run_end - run_start)


def pipeline_full_at(islands: Iterable[int], first_merged: Mapping[int, float],
                     first_failed: Mapping[int, float]) -> float | None:
    """When every island in `islands` (the first placement) had a submission merged or failed, whichever came
    first for it: the end of the pipeline fill, the moment from which a stall is downtime. None while some
    island has done neither (uptime's clock then starts at the first advance).

    ``first_merged``: island -> wall time of the first merged round it took part in; ``first_failed``: island ->
    wall time its first failure was noted. A failure ends an island's fill: from then its absence is downtime,
    not a start."""
    ends = []
    for island in islands:
        seen = [t for t in (first_merged.get(island), first_failed.get(island)) if t is not None]
        if not seen:
            return None
        ends.append(min(seen))
    return max(ends, default=None)


def goodput_report(
    *,
    intervals: Sequence[Interval],
    useful_s: float,
    run_start: float,
    run_end: float,
    islands: int,
    version_advances: Sequence[float],
    uptime_window_s: float,
    tokens_merged: int,
    tokens_lost: int,
    tokens_refused: int,
    tokens_in_flight: int,
    tokens_overwritten: int = 0,
    uptime_until: float | None = None,
    fill_until: float | None = None,
) -> GoodputReport:
    """The run's goodput, uptime, time by state and token fates (module docstring for formulas).

    ``uptime_until`` (default ``run_end``) ends uptime's clock: the moment the run began stopping, after
    which versions are held on purpose (the final flush merges once the islands are stopped).

    ``fill_until`` (default ``run_start``): the uptime clock starts at the first advance at or after it, the
    moment the pipeline is full (:func:`pipeline_full_at`).

    ``uptime_window_s`` is the caller's choice of how long after a version advance the run still
    counts as advancing: the expected gap between rounds, e.g. 3x the median inter-round gap
    (:func:`uptime_window_from_rounds`). Dense advances give uptime 1.0; a stall longer than the
    window lowers it by exactly the uncovered time.

    Raises:
        ValueError: ``run_end <= run_start``, ``islands < 1``, negative times or tokens, an
            unknown state, an island whose intervals overlap, or ``useful_s > allocated_s``.
    """
    tokens = _token_fates(merged=tokens_merged, lost=tokens_lost, refused=tokens_refused, in_flight=tokens_in_flight,
                          overwritten=tokens_overwritten)
    by_state = _time_by_state(intervals, run_start=run_start, run_end=run_end)
    allocated = _check_allocation(run_start=run_start, run_end=run_end, islands=islands, useful_s=useful_s,
                                  vacant_s=by_state[IslandState.VACANT])

    # The uptime clock starts at the first advance (module docstring: the fill is not a stall).
    until = run_end if uptime_until is None else uptime_until
    if not run_start <= until <= run_end:
        raise ValueError(f"uptime_until must lie in [run_start, run_end] = [{run_start}, {run_end}], got {until}; "
                         "pass the moment the run began stopping, or None for run_end")
    full = run_start if fill_until is None else max(run_start, fill_until)
    first = min((t for t in version_advances if full <= t < until), default=until)
    uptime = (uptime_fraction(version_advances, run_start=first, run_end=until, uptime_window_s=uptime_window_s)
              if first < until else 0.0)
    useful = min(float(useful_s), allocated)
    return GoodputReport(
        goodput=useful / allocated,
        uptime=uptime,
        fill_s=first - run_start,
        allocated_s=allocated,
        useful_s=useful,
        lost_s=allocated - useful,
        by_state_s=by_state,
        tokens=tokens,
    )


def _check_allocation(*, run_start: float, run_end: float, islands: int, useful_s: float, vacant_s: float = 0.0) -> float:
    """The allocated island time (islands x wall time, less vacant slot time), after checking its arguments."""
    if not run_end > run_start:
        raise ValueError(f"run_end must be > run_start, got run_start={run_start}, run_end={run_end}")
    if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
        raise ValueError(f"islands must be an int >= 1, got {islands!r}; count every island slot of the run")
    # A run always had some capacity (its minimum); the floor keeps the ratio defined if a timeline says otherwise.
    allocated = max(islands * (run_end - run_start) - vacant_s, _TOL)
    if math.isnan(useful_s) or useful_s < 0:
        raise ValueError(f"useful_s must be >= 0, got {useful_s}")
    if useful_s > allocated + _TOL:
        raise ValueError(
            f"useful_s {useful_s} exceeds allocated_s {allocated} ({islands} islands x {run_end - run_start}s); "
            "useful time counts island compute that reached the global parameters, at most the allocated time"
        )
    return allocated


def _token_fates(*, merged: int, lost: int, refused: int, in_flight: int, overwritten: int) -> dict[str, int]:
    """Every token's fate, checked, plus their sum as ``processed``."""
    tokens = {"merged": merged, "lost": lost, "refused": refused, "in_flight": in_flight, "overwritten": overwritten}
    for fate, n in tokens.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"tokens_{fate} must be an int >= 0, got {n!r}")
    tokens["processed"] = sum(tokens.values())
    return tokens


def _time_by_state(intervals: Sequence[Interval], *, run_start: float, run_end: float) -> dict[str, float]:
    """Island seconds in each timeline state inside the run, after checking that no island's intervals overlap."""
    by_state: dict[str, float] = {s: 0.0 for s in TIMELINE_STATES}
    per_island: dict[int, list[Interval]] = defaultdict(list)
    for i, iv in enumerate(intervals):
        _check_state(iv.state, f"intervals[{i}]")
        if not iv.end >= iv.start:
            raise ValueError(f"intervals[{i}] ends before it starts: start={iv.start}, end={iv.end}")
        per_island[iv.island].append(iv)
        by_state[iv.state] += max(0.0, min(iv.end, run_end) - max(iv.start, run_start))
    for island, ivs in per_island.items():
        ivs.sort(key=lambda iv: iv.start)
        for a, b in zip(ivs, ivs[1:]):
            if b.start < a.end - _TOL:
                raise ValueError(
                    f"island {island}: intervals overlap ({a.state} until {a.end}, {b.state} from {b.start}); "
                    "one island slot is in one state at a time, build intervals with merge_timeline()"
                )
    return by_state


def uptime_window_from_rounds(
    version_advances: Sequence[float], *, factor: float = 3.0, floor_s: float = 1.0
) -> float:
    """``max(floor_s, factor * median gap between successive distinct advance times)``.

    Advance times are sorted and equal times count once (fragments advancing at the same instant
    are one advance of global state). Fewer than two distinct times give ``floor_s``.
    """
    if math.isnan(factor) or factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}; use e.g. 3.0")
    if math.isnan(floor_s) or floor_s <= 0:
        raise ValueError(f"floor_s must be > 0, got {floor_s}; use e.g. 1.0")
    times = sorted(set(float(t) for t in version_advances))
    if len(times) < 2:
        return float(floor_s)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return float(max(floor_s, factor * statistics.median(gaps)))
