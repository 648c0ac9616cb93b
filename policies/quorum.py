"""When a round closes: minimum quorum plus an adaptive grace window.

The outer optimizer waits, per fragment, for at least ``min_quorum`` pending submissions and then
up to ``grace_s`` seconds more for stragglers (docs/architecture.md section 3, outer steps 1-2). These
functions never read the clock: ``now`` and the measured times are arguments, and the answer is a
:class:`RoundDecision` the caller acts on and logs once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MovingAverage", "RoundDecision", "grace_window_s", "decide_round", "membership_quorum"]


class MovingAverage:
    """Exponential moving average of a measured time.

    The first update sets ``value = x``; each later one sets
    ``value = (1 - alpha) * value + alpha * x``.

    Args:
        alpha: weight of the newest sample, ``0 < alpha <= 1`` (1 keeps only the last sample).
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}; use e.g. 0.2")
        self._alpha = float(alpha)
        self._value: float | None = None

    @property
    def alpha(self) -> float:
        """Weight of the newest sample."""
        return self._alpha

    @property
    def value(self) -> float | None:
        """The current average, or ``None`` before the first update."""
        return self._value

    def update(self, x: float) -> float:
        """Fold sample ``x`` into the average and return the new value."""
        x = float(x)
        if self._value is None:
            self._value = x
        else:
            self._value = (1.0 - self._alpha) * self._value + self._alpha * x
        return self._value

    def __repr__(self) -> str:
        return f"MovingAverage(alpha={self._alpha}, value={self._value})"


def grace_window_s(
    *,
    gamma: float,
    tau_steps: float,
    step_time_s: float | None,
    quorum_time_s: float | None,
    sync_time_s: float | None,
    cap_s: float,
) -> float:
    """Seconds a round may wait for more submissions once quorum is reached.

    ``grace = clamp(gamma * (tau_steps * step_time_s - quorum_time_s - sync_time_s), 0, cap_s)``

    A submission may be in flight for ``tau_steps`` inner steps before the island needs the merged
    fragment, so that time minus what reaching quorum and merging already cost is slack the
    round can spend without stalling anyone.

    Args:
        gamma: fraction of the slack to spend, ``>= 0``; ``math.inf`` means unbounded grace and
            returns ``cap_s``.
        tau_steps: inner steps a submission may be in flight, ``>= 0``.
        step_time_s: average inner step time; ``None`` (not measured yet) returns 0.0 so no
            slack is spent on a guess.
        quorum_time_s: average time to reach quorum; ``None`` counts as 0.
        sync_time_s: average time to merge and publish; ``None`` counts as 0.
        cap_s: upper bound, ``>= 0``, may be ``math.inf``.
    """
    if math.isnan(gamma) or gamma < 0:
        raise ValueError(f"gamma must be >= 0 (math.inf for unbounded grace), got {gamma}; use e.g. 0.5")
    if math.isnan(tau_steps) or tau_steps < 0:
        raise ValueError(f"tau_steps must be >= 0, got {tau_steps}; pass the inner steps a submission may be in flight")
    if math.isnan(cap_s) or cap_s < 0:
        raise ValueError(f"cap_s must be >= 0 (math.inf for no cap), got {cap_s}")
    if math.isinf(gamma):
        return float(cap_s)
    if step_time_s is None:
        return 0.0
    slack = tau_steps * step_time_s - (quorum_time_s or 0.0) - (sync_time_s or 0.0)
    return float(min(max(gamma * slack, 0.0), cap_s))


@dataclass(frozen=True)
class RoundDecision:
    """Whether to close a round now.

    Attributes:
        close: close the round and merge what is pending.
        wait_s: seconds until the decision should be re-evaluated absent new arrivals;
            ``math.inf`` when only an arrival can change it, ``0.0`` when ``close``.
        reason: one line for the log.
    """

    close: bool
    wait_s: float
    reason: str


def decide_round(
    *,
    now: float,
    pending: int,
    min_quorum: int,
    live_islands: int,
    quorum_reached_at: float | None,
    grace_s: float,
) -> RoundDecision:
    """Decide whether a fragment's round closes, given what is pending at time ``now``.

    Rules, first match wins:

    1. ``pending < min_quorum``: wait (``wait_s = inf``) for more submissions.
    2. ``pending >= live_islands``: close, every live island is in.
    3. ``now >= quorum_reached_at + grace_s``: close, the grace window expired
       (``quorum_reached_at=None`` is treated as ``now``).
    4. Otherwise wait ``quorum_reached_at + grace_s - now`` seconds.

    With ``min_quorum > live_islands`` rule 1 holds until an island comes back, so the round
    never closes: this is intended, it is how the synchronous baseline (``K = M``) stalls while an
    island is dead.

    Args:
        now: current time in seconds (any monotonic origin, the same as ``quorum_reached_at``).
        pending: submissions pending for this fragment, ``>= 0``.
        min_quorum: minimum quorum ``K``, ``>= 1``.
        live_islands: islands currently alive.
        quorum_reached_at: when ``pending`` first reached ``min_quorum``.
        grace_s: grace window from :func:`grace_window_s`, ``>= 0`` (may be ``math.inf``).
    """
    if min_quorum < 1:
        raise ValueError(f"min_quorum must be >= 1, got {min_quorum}; set min_quorum to at least 1")
    if pending < 0:
        raise ValueError(f"pending must be >= 0, got {pending}; count the pending submissions")
    if math.isnan(grace_s) or grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}; use grace_window_s() or 0.0")

    if pending < min_quorum:
        return RoundDecision(False, math.inf, f"waiting for quorum {pending}/{min_quorum}")
    if pending >= live_islands:
        return RoundDecision(True, 0.0, f"all live islands submitted ({pending}/{live_islands})")
    reached = now if quorum_reached_at is None else quorum_reached_at
    deadline = reached + grace_s
    if now >= deadline:
        return RoundDecision(True, 0.0, f"grace window expired ({pending}/{live_islands} submitted)")
    return RoundDecision(
        False, deadline - now, f"in grace window ({pending}/{live_islands} submitted, {deadline - now:.3g}s left)"
    )


def membership_quorum(min_quorum: int, *, fixed_slots: int, elastic_members: int) -> int:
    """K as a round applies it when some island slots are elastic (pools with islands: {min, max}).

    ``min(min_quorum, fixed_slots + elastic_members)``, at least 1. A fixed pool's slot always counts: a dead
    island there is restarted, and a synchronous round (K = all) waits for it, as :func:`decide_round` says.
    An elastic slot counts only while it holds an island (``elastic_members``): a slot whose pool has no
    machine for it, or whose island left with its node, may stay empty for the rest of the run, and a
    round waiting for it would never close. So K = all means every island the run has now.

    Args:
        min_quorum: the configured K (``'all'`` resolved to the number of slots), ``>= 1``.
        fixed_slots: island slots of fixed pools, ``>= 0``.
        elastic_members: elastic slots holding an island now (registered with the outer optimizer), ``>= 0``.
    """
    if min_quorum < 1 or fixed_slots < 0 or elastic_members < 0:
        raise ValueError(f"min_quorum={min_quorum} must be >= 1 and fixed_slots={fixed_slots}, "
                         f"elastic_members={elastic_members} >= 0")
    return max(1, min(min_quorum, fixed_slots + elastic_members))
