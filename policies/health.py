"""Is an island healthy? The health monitor's verdict on one island at one moment.

The health monitor (docs/architecture.md section 4) polls each island's status and calls
:func:`assess_island` with what it measured; the answer is a :class:`HealthVerdict` it acts on
(kill and restart when not healthy) and logs once. The hang timeout scales with the island's *own*
measured inner step time, so a slow pool is never mistaken for a hung one. Time is an argument;
nothing here reads the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.island_states import REPORTED, IslandState

__all__ = ["ISLAND_STATES", "VERDICT_KINDS", "HealthVerdict", "hang_timeout_s", "assess_island"]

ISLAND_STATES = REPORTED  # the states an island reports (policies/island_states.py), by their old name here
VERDICT_KINDS = ("ok", "starting", "dead", "hung", "diverged", "unreachable")


@dataclass(frozen=True)
class HealthVerdict:
    """The health monitor's verdict on one island.

    Attributes:
        healthy: leave the island alone; ``False`` means kill (if needed) and restart it.
        kind: one of :data:`VERDICT_KINDS`.
        reason: one line for the log.
    """

    healthy: bool
    kind: str
    reason: str

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(f"HealthVerdict.kind must be one of {VERDICT_KINDS}, got {self.kind!r}")
        if self.healthy != (self.kind in ("ok", "starting")):
            raise ValueError(f"HealthVerdict(healthy={self.healthy}, kind={self.kind!r}) is inconsistent; "
                             "only 'ok' and 'starting' are healthy")


def _check_positive(name: str, value: float, *, allow_zero: bool = False, hint: str = "") -> None:
    bad = math.isnan(value) or (value < 0 if allow_zero else value <= 0)
    if bad:
        rule = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {rule}, got {value}{'; ' + hint if hint else ''}")


def hang_timeout_s(
    *, step_time_s: float | None, factor: float = 20.0, floor_s: float = 5.0, startup_s: float = 60.0
) -> float:
    """Seconds without progress after which an island counts as hung.

    ``timeout = max(floor_s, factor * step_time_s)``, or ``startup_s`` while no step has been
    measured (``step_time_s is None``: model build, first compile, data loading).

    The timeout follows the island's own measured step time, so a pool whose steps take 10x longer
    gets a 10x longer timeout: a slow pool is not a dead pool.

    Args:
        step_time_s: the island's average inner step time, ``> 0``, or ``None``.
        factor: timeout in step times, ``> 0``.
        floor_s: lower bound, ``>= 0``, so fast islands are not killed for scheduler noise.
        startup_s: timeout before the first measured step, ``> 0``.
    """
    _check_positive("factor", factor, hint="use e.g. 20 (step times without progress)")
    _check_positive("floor_s", floor_s, allow_zero=True, hint="use e.g. 5.0")
    _check_positive("startup_s", startup_s, hint="allow the model build and first step, e.g. 60.0")
    if step_time_s is None:
        return float(startup_s)
    _check_positive("step_time_s", step_time_s, hint="pass the measured average inner step time or None")
    return float(max(floor_s, factor * step_time_s))


def assess_island(
    *,
    now: float,
    state: str,
    steps: int,
    last_progress_at: float,
    step_time_s: float | None,
    status_ok: bool,
    last_status_at: float,
    factor: float = 20.0,
    floor_s: float = 5.0,
    startup_s: float = 60.0,
    unreachable_s: float = 10.0,
) -> HealthVerdict:
    """Judge one island at time ``now``; rules in order, first match wins.

    1. ``state == "diverged"`` (the island saw a non-finite loss or parameters): ``diverged``.
    2. ``state == "failed"`` (its inner loop raised): ``dead``.
    3. ``not status_ok and now - last_status_at > unreachable_s``: ``unreachable`` (status calls
       have failed for longer than ``unreachable_s``; a shorter outage is judged on the last known
       ``state`` and ``steps`` by the rules below).
    4. ``state == "stopped"``: ``ok``; the island stopped on request, which is not a failure (the
       caller knows whether it asked).
    5. ``state == "blocked"``: ``ok``; waiting for a round to be adopted is not a hang.
    6. ``now - last_progress_at > hang_timeout_s(step_time_s, ...)``: ``hung``; the reason names
       the seconds without progress and the timeout.
    7. ``steps == 0``: ``starting`` (healthy; the first step is within the startup timeout).
    8. Otherwise ``ok``.

    Args:
        now: current time (any monotonic origin shared by the time arguments).
        state: the island's self-reported state, one of :data:`ISLAND_STATES` (last known).
        steps: inner steps of the current incarnation, ``>= 0`` (last known).
        last_progress_at: when ``steps`` last changed, or when the incarnation started if ``steps == 0``.
        step_time_s: the island's average inner step time, or ``None`` before the first step.
        status_ok: whether the latest status call succeeded.
        last_status_at: when a status call last succeeded (incarnation start if none yet).
        factor, floor_s, startup_s: see :func:`hang_timeout_s`.
        unreachable_s: tolerated status outage in seconds, ``>= 0``.
    """
    if state not in ISLAND_STATES:
        raise ValueError(f"state must be one of {tuple(map(str, ISLAND_STATES))}, got {state!r}; pass the island's reported state")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}; pass the incarnation's inner step count")
    _check_positive("unreachable_s", unreachable_s, allow_zero=True, hint="use e.g. 10.0")
    timeout = hang_timeout_s(step_time_s=step_time_s, factor=factor, floor_s=floor_s, startup_s=startup_s)

    if state == IslandState.DIVERGED:
        return HealthVerdict(False, "diverged", f"island reported divergence after {steps} steps")
    if state == IslandState.FAILED:
        return HealthVerdict(False, "dead", f"island reported its inner loop failed after {steps} steps")
    silent = now - last_status_at
    if not status_ok and silent > unreachable_s:
        return HealthVerdict(
            False, "unreachable", f"status calls failing for {silent:.1f}s > unreachable_s {unreachable_s:.1f}s"
        )
    if state == IslandState.STOPPED:
        return HealthVerdict(True, "ok", "stopped on request")
    if state == IslandState.BLOCKED:
        return HealthVerdict(True, "ok", "blocked waiting for a round (not a hang)")
    idle = now - last_progress_at
    if idle > timeout:
        basis = (
            "startup timeout" if step_time_s is None
            else f"max({floor_s:g}s, {factor:g} x step time {step_time_s:.3g}s)"
        )
        return HealthVerdict(
            False, "hung", f"no progress for {idle:.1f}s > timeout {timeout:.1f}s ({basis}) at step {steps}"
            f" (reported state {str(state)!r}, last status {silent:.1f}s ago)"
        )
    if steps == 0:
        return HealthVerdict(True, "starting", f"no step yet, {idle:.1f}s of {timeout:.1f}s allowed")
    return HealthVerdict(True, "ok", f"training, step {steps}, last progress {idle:.1f}s ago")
