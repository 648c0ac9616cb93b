"""When to restart a failed island: exponential backoff over consecutive failures.

The health monitor (docs/architecture.md section 4) calls :meth:`RestartBudget.on_failure` when an island
dies, hangs or diverges and restarts it at the returned time; it calls
:meth:`RestartBudget.on_healthy` on every healthy check, so an island that stays healthy long
enough earns its backoff back, and so does one that has cut a submission since its restart (work
the outer optimizer can merge is the health a crash loop never shows). Time is an argument; nothing
here reads the clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["backoff_s", "RestartDecision", "RestartBudget"]


def _check_backoff(*, base_s: float, factor: float, cap_s: float) -> None:
    if math.isnan(base_s) or not base_s > 0 or math.isinf(base_s):
        raise ValueError(f"base_s must be finite and > 0, got {base_s}; use e.g. 0.5")
    if math.isnan(factor) or factor < 1 or math.isinf(factor):
        raise ValueError(f"factor must be finite and >= 1, got {factor}; use e.g. 2.0 (1.0 = constant delay)")
    if math.isnan(cap_s) or cap_s < base_s:
        raise ValueError(f"cap_s must be >= base_s={base_s}, got {cap_s}; use e.g. 30.0 (math.inf for no cap)")


def backoff_s(attempt: int, *, base_s: float = 0.5, factor: float = 2.0, cap_s: float = 30.0) -> float:
    """Delay before restart number ``attempt`` of a run of consecutive failures.

    ``backoff = min(cap_s, base_s * factor ** (attempt - 1))`` for ``attempt >= 1``, so the
    defaults give 0.5, 1, 2, 4, 8, 16, 30, 30, ... seconds.

    Args:
        attempt: consecutive failure count, ``>= 1`` (1 is the first failure).
        base_s: delay of the first attempt, ``> 0``.
        factor: growth per attempt, ``>= 1``.
        cap_s: largest delay, ``>= base_s`` (``math.inf`` allowed).
    """
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an int >= 1, got {attempt!r}; the first failure is attempt 1")
    _check_backoff(base_s=base_s, factor=factor, cap_s=cap_s)
    try:
        delay = base_s * factor ** (attempt - 1)
    except OverflowError:
        delay = math.inf
    return float(min(cap_s, delay))


@dataclass(frozen=True)
class RestartDecision:
    """What to do about a failed island.

    Attributes:
        restart: restart it (``False``: give up, the island slot stays dead).
        at: when to restart, ``now + backoff``; ``math.inf`` when ``restart`` is ``False``.
        attempt: consecutive failures of this island, this one included.
        reason: one line for the log.
    """

    restart: bool
    at: float
    attempt: int
    reason: str


class RestartBudget:
    """Per-island consecutive failure counts, backoff and an optional limit.

    On each failure of island ``m`` at ``now``: ``attempt[m] += 1``; if ``max_restarts`` is set
    and ``attempt[m] > max_restarts`` the decision is to give up, otherwise to restart at
    ``now + backoff_s(attempt[m])``. ``max_restarts`` limits *consecutive* failures (a crash loop),
    not the total over the run: once the island has stayed healthy for ``reset_after_s`` seconds
    after its last restart (``now >= restart_at + reset_after_s`` in :meth:`on_healthy`), or, with
    ``reset_on_submission``, has cut a submission since it (``submitted=True``), ``attempt[m]``
    returns to 0. Without the second rule, independent failures of a slot that trains and submits
    between them (one every 30 s in the chaos benchmark) doubled its backoff as if it were crash-looping.

    Args:
        base_s, factor, cap_s: see :func:`backoff_s`.
        reset_after_s: healthy seconds after a restart that clear the count, ``>= 0``.
        max_restarts: most consecutive restarts per island, ``>= 0``; ``None`` = unlimited.
        reset_on_submission: a submission cut since the last restart also clears the count.
    """

    def __init__(
        self,
        *,
        base_s: float = 0.5,
        factor: float = 2.0,
        cap_s: float = 30.0,
        reset_after_s: float = 60.0,
        max_restarts: int | None = None,
        reset_on_submission: bool = True,
    ) -> None:
        _check_backoff(base_s=base_s, factor=factor, cap_s=cap_s)
        if math.isnan(reset_after_s) or reset_after_s < 0:
            raise ValueError(f"reset_after_s must be >= 0, got {reset_after_s}; use e.g. 60.0")
        if max_restarts is not None and (isinstance(max_restarts, bool) or not isinstance(max_restarts, int)
                                         or max_restarts < 0):
            raise ValueError(f"max_restarts must be None or an int >= 0, got {max_restarts!r}; None = unlimited")
        self.base_s = float(base_s)
        self.factor = float(factor)
        self.cap_s = float(cap_s)
        self.reset_after_s = float(reset_after_s)
        self.max_restarts = max_restarts
        self.reset_on_submission = bool(reset_on_submission)
        self._attempt: dict[int, int] = {}
        self._restart_at: dict[int, float] = {}
        self._restarts: dict[int, int] = {}

    def attempt(self, island: int) -> int:
        """Consecutive failures of ``island`` not yet cleared by :meth:`on_healthy`."""
        return self._attempt.get(island, 0)

    def restarts(self, island: int) -> int:
        """Restarts granted to ``island`` over the whole run."""
        return self._restarts.get(island, 0)

    def on_failure(self, island: int, now: float) -> RestartDecision:
        """Record a failure of ``island`` at ``now`` and decide when to restart it."""
        attempt = self._attempt.get(island, 0) + 1
        self._attempt[island] = attempt
        if self.max_restarts is not None and attempt > self.max_restarts:
            return RestartDecision(
                False, math.inf, attempt,
                f"island {island} failed {attempt} times in a row > max_restarts {self.max_restarts}; giving up",
            )
        delay = backoff_s(attempt, base_s=self.base_s, factor=self.factor, cap_s=self.cap_s)
        at = now + delay
        self._restart_at[island] = at
        self._restarts[island] = self._restarts.get(island, 0) + 1
        return RestartDecision(True, at, attempt, f"island {island} failure {attempt} in a row: restart in {delay:g}s")

    def on_healthy(self, island: int, now: float, *, submitted: bool = False) -> bool:
        """Record a healthy check; clear the count once ``now >= restart_at + reset_after_s``, or at
        once if ``submitted`` (the island's incarnation since its last restart has cut a submission)
        and ``reset_on_submission``.

        Returns whether the count was cleared by this call.
        """
        if self._attempt.get(island, 0) == 0:
            return False
        restart_at = self._restart_at.get(island)
        earned = submitted and self.reset_on_submission and restart_at is not None and now >= restart_at
        if not earned and (restart_at is None or now < restart_at + self.reset_after_s):
            return False
        self._attempt[island] = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        """Counters per island (hyperparameters come from the constructor)."""
        islands = set(self._attempt) | set(self._restart_at) | set(self._restarts)
        return {
            "islands": {
                m: {
                    "attempt": self._attempt.get(m, 0),
                    "restart_at": self._restart_at.get(m),
                    "restarts": self._restarts.get(m, 0),
                }
                for m in sorted(islands)
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (island keys may be strings, as after JSON)."""
        if set(state) != {"islands"}:
            raise ValueError(f"RestartBudget state must have exactly the key 'islands', got {sorted(state)}")
        attempt: dict[int, int] = {}
        restart_at: dict[int, float] = {}
        restarts: dict[int, int] = {}
        for key, entry in state["islands"].items():
            if set(entry) != {"attempt", "restart_at", "restarts"}:
                raise ValueError(
                    f"RestartBudget state for island {key!r} must have keys attempt, restart_at, restarts, "
                    f"got {sorted(entry)}"
                )
            m = int(key)
            attempt[m] = int(entry["attempt"])
            restarts[m] = int(entry["restarts"])
            if entry["restart_at"] is not None:
                restart_at[m] = float(entry["restart_at"])
        self._attempt, self._restart_at, self._restarts = attempt, restart_at, restarts

    def __repr__(self) -> str:
        return (
            f"RestartBudget(base_s={self.base_s}, factor={self.factor}, cap_s={self.cap_s}, "
            f"reset_after_s={self.reset_after_s}, max_restarts={self.max_restarts}, "
            f"reset_on_submission={self.reset_on_submission})"
        )
