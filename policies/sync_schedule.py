"""H over the run: an optional schedule of inner steps between syncs, keyed on the run's progress.

``outer.sync_every_schedule`` is a list of ``(until, H)`` pairs: islands sync every ``H`` inner steps
until the run has processed the fraction ``until`` of its token budget, then move to the next pair,
and after the last pair to ``outer.sync_every_steps``. Syncing often early and rarely later is the
shape of post-local SGD (Lin et al., 2020: synchronous first, local steps after): early training
moves the parameters fastest, so that is where long stretches between syncs let the islands drift
furthest apart, while most of the bytes of a long run are spent later. The bytes per token of a run
are the token-weighted mean of ``1 / H`` over its phases (docs/network.md).

Pure functions: the config and each island validate H and the schedule with :func:`check_sync_every`
(P | H is checked in :func:`check_fragments_divide_h`, and only there), islands pick their cut
interval and the outer optimizer its grace tau with :func:`sync_every_at`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "check_fragments_divide_h",
    "check_schedule_pairs",
    "check_sync_every",
    "check_sync_schedule",
    "mean_inverse_h",
    "sync_every_at",
]


def check_fragments_divide_h(h: int, num_fragments: int, *, where: str | None = None) -> None:
    """Raise ValueError, in one line, unless P = `num_fragments` divides H = `h`.

    Fragments are cut round-robin every H/P steps, so P must divide H (as torchft checks). `where` names
    a schedule entry (e.g. ``sync_every_schedule[0]``); None means ``sync_every_steps``. The message
    suggests the nearest H below that P divides (P itself when H < P)."""
    if not h % num_fragments:
        return
    pick = num_fragments * max(1, h // num_fragments)
    if where is None:
        raise ValueError(f"sync_every_steps (H={h}) must be a multiple of num_fragments (P={num_fragments}); "
                         f"pick H = {pick}")
    raise ValueError(f"{where} has H = {h}, not a multiple of num_fragments (P={num_fragments}); pick H = {pick}")


def check_sync_every(sync_every_steps: int, schedule: Sequence[tuple[float, int]], num_fragments: int) -> None:
    """Raise ValueError, in one line, unless H = `sync_every_steps` and `schedule` suit P = `num_fragments`.

    The one check of H and P that the config and every island run."""
    check_fragments_divide_h(sync_every_steps, num_fragments)
    check_sync_schedule(schedule, num_fragments)


def check_schedule_pairs(schedule: object) -> None:
    """Raise ValueError, in one line, unless `schedule` is a list of two-element ``[until, H]`` entries.

    The shape alone: the config runs it before pydantic's own tuple check, whose "Field required" would
    not say what a pair is."""
    for i, entry in enumerate(schedule if isinstance(schedule, (list, tuple)) else [schedule]):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise ValueError(f"sync_every_schedule[{i}] is {entry!r}; give [until_fraction, H] pairs, "
                             "e.g. [[0.1, 40]] for H = 40 over the first 10% of the token budget")


def check_sync_schedule(schedule: Sequence[tuple[float, int]], num_fragments: int) -> None:
    """Raise ValueError, in one line, if `schedule` is not a valid ``(until, H)`` list for P = `num_fragments`.

    Valid: each ``until`` in (0, 1], strictly increasing; each ``H`` an integer >= 1 that P divides
    (fragments are cut round-robin every H/P steps)."""
    check_schedule_pairs(schedule)
    prev = 0.0
    for i, (until, h) in enumerate(schedule):
        if not isinstance(until, (int, float)) or math.isnan(until) or not prev < until <= 1.0:
            raise ValueError(f"sync_every_schedule[{i}] ends at {until!r}; each until_fraction must be in (0, 1] "
                             f"and above the one before ({prev:g})")
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"sync_every_schedule[{i}] has H = {h!r}; H must be an integer >= 1")
        check_fragments_divide_h(h, num_fragments, where=f"sync_every_schedule[{i}]")
        prev = float(until)


def sync_every_at(progress: float | None, schedule: Sequence[tuple[float, float]], sync_every_steps: float) -> float:
    """H at run progress `progress` (tokens processed / token budget).

    The H of the first pair whose ``until`` the run has not reached; `sync_every_steps` once it has
    passed them all (or with no schedule). Before any progress is known (None) the run is at its start.
    The outer optimizer reads its grace tau (H/P per phase) from a schedule of the same shape."""
    p = 0.0 if progress is None else progress
    for until, h in schedule:
        if p < until:
            return h
    return sync_every_steps


def mean_inverse_h(schedule: Sequence[tuple[float, int]], sync_every_steps: int) -> float:
    """The token-weighted mean of 1/H over a whole run: bytes per token scale with it (docs/network.md).

    A run with a constant H has 1/H; the formula's ratio 3H / (u + M d) takes ``1 / mean_inverse_h``
    as its H."""
    total, prev = 0.0, 0.0
    for until, h in schedule:
        total += (until - prev) / h
        prev = until
    return total + (1.0 - prev) / sync_every_steps
