"""Failure and recovery schedules for slices of chips: pure, vectorized, deterministic by seed.

A *slice* is the failure domain: it is interrupted when any of its chips fails. With chips that fail
independently as Poisson processes of mean time between interruptions ``mtbi_chip_s``, a slice of
``c`` chips fails at rate ``c / mtbi_chip_s`` and a set of slices at the summed rate
``Lambda = sum(c_i) / mtbi_chip_s``. The superposition of independent Poisson processes is a Poisson
process, so one horizon's failures are drawn exactly as::

    n ~ Poisson(Lambda * horizon_s)
    t_1..t_n ~ Uniform[0, horizon_s)                (sorted)
    slice of each event ~ Categorical(c_i / sum(c))

No Python object per chip or per slice: one array per quantity. A failure that lands while its
slice is still down interrupts nothing (the slice is already out) and is dropped by
:func:`absorb_while_down`.

A *group* of slices that steps synchronously turns such a schedule into a :class:`Timeline` (one
sort and one cumulative sum over its events): :func:`stall_timeline` for a job that stops on any
failure, :func:`elastic_timeline` for one that drops and re-adds slices. In both, a stall or a
pause runs for its own fixed length and an event that lands while one runs is handled by it
without extending it (:func:`pause_starts`, a type-I counter): the recovery already under way
replaces every slice that failed meanwhile, and one reconfiguration drops or re-adds every slice
whose state changed meanwhile. :func:`durable_points` and :func:`kept_stepping_s` then say what
survives rollbacks. No Ray, no clock: time and the generator are arguments.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SECONDS_PER_YEAR = 365.0 * 24 * 3600


def slice_sizes(*, chips: int, slice_chips: int) -> np.ndarray:
    """Chips per slice: ``ceil(chips / slice_chips)`` slices, the last one holding the remainder."""
    if chips < 1:
        raise ValueError(f"chips={chips}: need at least 1 chip")
    if slice_chips < 1:
        raise ValueError(f"slice_chips={slice_chips}: need at least 1 chip per slice")
    n_full, rest = divmod(chips, slice_chips)
    sizes = np.full(n_full + (1 if rest else 0), slice_chips, dtype=np.int64)
    if rest:
        sizes[-1] = rest
    return sizes


def draw_interruptions(
    *, sizes: np.ndarray, mtbi_chip_s: float, horizon_s: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Slice interruptions over ``[0, horizon_s)``: ``(times_s, slice_index)``, sorted by time.

    Exact for independent per-chip Poisson failures (module docstring). ``mtbi_chip_s = inf`` gives
    no failures.
    """
    if not mtbi_chip_s > 0:
        raise ValueError(f"mtbi_chip_s={mtbi_chip_s}: must be > 0 (use inf for no failures)")
    if math.isinf(mtbi_chip_s):
        return np.empty(0), np.empty(0, dtype=np.int64)
    total_rate = float(sizes.sum()) / mtbi_chip_s  # failures per second over all slices
    n = int(rng.poisson(total_rate * horizon_s))
    times = np.sort(rng.uniform(0.0, horizon_s, size=n))
    # Inverse-CDF pick of the slice, weighted by its chips (a partial last slice fails less often).
    cum = np.cumsum(sizes, dtype=np.float64)
    slices = np.searchsorted(cum, rng.uniform(0.0, cum[-1], size=n), side="right")
    return times, np.minimum(slices, len(sizes) - 1).astype(np.int64)


def draw_recoveries(
    n: int, *, mean_s: float, sigma: float, rng: np.random.Generator
) -> np.ndarray:
    """Recovery times, lognormal with mean ``mean_s`` and log-space spread ``sigma``.

    ``mu = ln(mean_s) - sigma**2 / 2`` so that ``E[R] = exp(mu + sigma**2 / 2) = mean_s``;
    ``sigma = 0`` gives the constant ``mean_s``. The long right tail models the occasional slice
    that needs a slow repair while most come back from a hot spare.
    """
    if mean_s < 0 or sigma < 0:
        raise ValueError(f"mean_s={mean_s}, sigma={sigma}: both must be >= 0")
    if sigma == 0 or mean_s == 0:
        return np.full(n, float(mean_s))
    return rng.lognormal(math.log(mean_s) - sigma**2 / 2, sigma, size=n)


def absorb_while_down(
    times: np.ndarray, slices: np.ndarray, recoveries: np.ndarray
) -> np.ndarray:
    """Mask of failures that interrupt an *up* slice; those landing in a down period are dropped.

    Slice ``i`` down on ``[t, t + R)``: a later failure of ``i`` before ``t + R`` is absorbed and
    does not extend the down period (the slice is already being replaced). Conflicts are rare
    (probability ~ slice rate x R), so they are found vectorized and resolved in a loop over the
    few conflicting events only.
    """
    order = np.lexsort((times, slices))  # by slice, then time
    t, s, end = times[order], slices[order], times[order] + recoveries[order]
    keep = np.ones(len(t), dtype=bool)
    if len(t) < 2:
        return keep
    # Running max of earlier down-period ends within each slice (offset makes the max segmented).
    offset = s * (float(end.max()) + 1.0)
    prior_end = np.maximum.accumulate(end + offset)[:-1] - offset[1:]
    candidate = np.r_[False, (s[1:] == s[:-1]) & (t[1:] < prior_end)]
    for i in np.flatnonzero(candidate):  # only candidates can be absorbed; check the last kept one
        j = i - 1
        while not keep[j]:
            j -= 1
        keep[i] = t[i] >= end[j]
    mask = np.empty(len(t), dtype=bool)
    mask[order] = keep
    return mask


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A group's state on segments ``[edges[k], edges[k+1])`` and its cumulative progress.

    ``S[k]``: stepping seconds before ``edges[k]``; ``Q[k]``: stepping chip-seconds before it.
    ``wipes``: edge indices where the group loses its state (dp: every stall; elastic: the last
    live slice failing). ``S`` and ``Q`` grow only on stepping segments, so Q is a function of S.
    """

    edges: np.ndarray  # (n+1,)
    stepping: np.ndarray  # (n,) bool
    live: np.ndarray  # (n,) chips up
    S: np.ndarray  # (n+1,)
    Q: np.ndarray  # (n+1,)
    wipes: np.ndarray  # indices into edges


def _timeline(points, d_live, d_block, chips, horizon_s, stall) -> Timeline:
    """Sweep state changes (time, change in live chips, change in blocking intervals) into segments."""
    order = np.argsort(points, kind="stable")
    edges = np.r_[0.0, np.minimum(points[order], horizon_s), horizon_s]
    live = chips + np.r_[0, np.cumsum(d_live[order])]
    blocked = np.r_[0, np.cumsum(d_block[order])] > 0
    stepping = ~blocked & (live > 0)
    seg = np.diff(edges) * stepping
    S = np.r_[0.0, np.cumsum(seg)]
    Q = np.r_[0.0, np.cumsum(seg * live)]
    lost = blocked if stall else live <= 0  # what wipes the state: any block (dp), no live chip (elastic)
    wipes = np.flatnonzero(lost[1:] & ~lost[:-1]) + 1
    return Timeline(edges, stepping, live, S, Q, wipes)


def pause_starts(times: np.ndarray, durations: np.ndarray) -> np.ndarray:
    """Indices of the events that start a pause; an event inside a running pause is absorbed by it.

    ``times`` sorted; event i, if it starts a pause, blocks ``[times[i], times[i] + durations[i])``,
    and the next pause starts at the first event at or after that end (a type-I counter). For
    Poisson events of rate ``mu`` and mean duration ``d`` the blocked fraction is exactly
    ``mu d / (1 + mu d)``. One vectorized search finds each event's successor; the loop walks only
    the chain of starts (a few thousand per simulated week and group).
    """
    n = len(times)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # max with i + 1: a zero-length pause must not find its own event again.
    successor = np.maximum(np.searchsorted(times, times + durations, side="left"), np.arange(1, n + 1)).tolist()
    out, i = [], 0
    while i < n:
        out.append(i)
        i = successor[i]
    return np.asarray(out, dtype=np.int64)


def stall_timeline(t, r, *, chips, restart_s, horizon_s) -> Timeline:
    """dp group: failure i, unless absorbed by a running stall, blocks ``[t_i, t_i + R_i + restart_s)``.

    A failure during a stall does not extend it (its slice is replaced by the same recovery); every
    stall rolls back (a wipe). All chips step between stalls (spares take the failed slices' places).
    """
    order = np.argsort(t, kind="stable")
    t, d = t[order], r[order] + restart_s
    k = pause_starts(t, d)
    ones = np.ones(len(k))
    points = np.r_[t[k], t[k] + d[k]]
    return _timeline(points, np.zeros(2 * len(k)), np.r_[ones, -ones], chips, horizon_s, stall=True)


def elastic_timeline(t, r, c, *, chips, reconfig_s, horizon_s) -> Timeline:
    """Elastic group: slice i (``c_i`` chips) is out on ``[t_i, t_i + R_i)``; each drop and re-add is a
    reconfiguration that pauses the group for ``reconfig_s``, unless a running one absorbs it."""
    changes = np.sort(np.r_[t, t + r])
    k = pause_starts(changes, np.full(len(changes), float(reconfig_s)))
    ones = np.ones(len(k))
    points = np.r_[t, t + r, changes[k], changes[k] + reconfig_s]
    d_live = np.r_[-c, c, 0 * ones, 0 * ones].astype(np.float64)
    d_block = np.r_[0 * c, 0 * c, ones, -ones].astype(np.float64)
    return _timeline(points, d_live, d_block, chips, horizon_s, stall=False)


def _at_progress(S, values, x):
    """``values`` (linear on stepping segments) where cumulative stepping time first reaches ``x``."""
    j = np.clip(np.searchsorted(S, x, side="left"), 1, len(S) - 1)
    width = S[j] - S[j - 1]
    frac = np.divide(x - S[j - 1], width, out=np.ones_like(x, dtype=np.float64), where=width > 0)
    return values[j - 1] + np.clip(frac, 0.0, 1.0) * (values[j] - values[j - 1])


def durable_points(tl: Timeline, period_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Durable points every ``period_s`` of stepping, restarting at each wipe: ``(times, chip_s)``.

    ``chip_s[k]`` is the chip-time made durable by point k. Work after an epoch's last durable
    point is lost at the wipe that ends it; the last epoch ends at the horizon with a final point
    that keeps everything (final checkpoint / final submission).
    """
    bounds = np.r_[0, tl.wipes, len(tl.edges) - 1]
    s0, s1 = tl.S[bounds[:-1]], tl.S[bounds[1:]]
    n = np.floor((s1 - s0) / period_s).astype(np.int64)
    n[-1] = max(int(np.ceil((s1[-1] - s0[-1]) / period_s)), 1)  # the final point at the horizon
    starts = np.repeat(np.cumsum(n) - n, n)
    k = np.arange(n.sum()) - starts + 1
    epoch = np.repeat(np.arange(len(n)), n)
    x = np.minimum(s0[epoch] + k * period_s, s1[epoch])
    q, t = _at_progress(tl.S, tl.Q, x), _at_progress(tl.S, tl.edges, x)
    t[-1] = tl.edges[-1]
    prev = np.r_[0.0, q[:-1]]
    first = k == 1
    prev[first] = tl.Q[bounds[:-1]][epoch[first]]
    return t, q - prev


def salvage_points(tl: Timeline, period_s: float, snapshot_s: float) -> tuple[np.ndarray, np.ndarray]:
    """What salvage saves at each wipe: ``(times, chip_s)``, one entry per wipe that has something to save.

    A group with durable points every ``period_s`` of stepping (as in :func:`durable_points`) also leaves
    a snapshot of its progress every ``snapshot_s`` of stepping, counted from the same epoch start, with
    a holder outside its failure domain (policies/salvage.py). At a wipe, the work between the epoch's
    last durable point and its last snapshot is merged at the wipe's time instead of lost; only the work
    after the last snapshot is lost. A wipe saves nothing when no snapshot fell after its epoch's last
    durable point (always so for ``snapshot_s == period_s``).
    """
    if len(tl.wipes) == 0:
        return np.zeros(0), np.zeros(0)
    s0, s1 = tl.S[np.r_[0, tl.wipes[:-1]]], tl.S[tl.wipes]
    u = s1 - s0
    durable = s0 + np.floor(u / period_s) * period_s
    snap = s0 + np.floor(u / snapshot_s) * snapshot_s
    saved = _at_progress(tl.S, tl.Q, snap) - _at_progress(tl.S, tl.Q, durable)
    keep = (snap > durable) & (saved > 0)
    return tl.edges[tl.wipes][keep], saved[keep]


def kept_stepping_s(tl: Timeline, period_s: float) -> float:
    """Stepping seconds that survive rollbacks: ``floor(U / period) * period`` per wiped epoch."""
    bounds = np.r_[0, tl.wipes, len(tl.edges) - 1]
    u = np.diff(tl.S[bounds])
    u[:-1] = np.floor(u[:-1] / period_s) * period_s
    return float(u.sum())
