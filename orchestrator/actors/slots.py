"""One island slot as the health monitor sees it, and the names of its incarnations.

A slot is a place for one island in its pool; an incarnation is one process (or worker group) filling
it. The monitor keeps one `SlotState` per slot for the run's whole life, across incarnations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from policies.island_states import IslandState

__all__ = ["DOWN", "SlotState", "has_submitted", "island_name", "islands_stepped"]

DOWN = (IslandState.DEAD, IslandState.RESTARTING, IslandState.VACANT)  # a slot with no live incarnation to fail


@dataclass
class SlotState:
    """What the monitor knows about one island slot."""

    island: int
    pool: str
    incarnation: int = 0
    # starting (first start) | training | blocked | dead | restarting, reintegrating (after a failure or a vacancy)
    # | leaving (its node is drained: flushing its progress) | vacant (an elastic slot with no room in its pool) | stopped
    state: IslandState = IslandState.STARTING
    name: str | None = None
    node: str | None = None
    steps: int = 0
    last_progress_at: float = 0.0
    last_status_at: float = 0.0
    status: Any = None
    failures: int = 0
    restarts: int = 0
    joins: int = 0  # islands placed in this (elastic) slot after it had been vacant
    leaves: int = 0  # islands that left this slot with their drained node
    joined_vacant: bool = False  # the current incarnation waited for room (it joins when placed)
    finals: list = field(default_factory=list)  # last statuses of dead incarnations (token accounting)

    @property
    def fetcher(self) -> int | None:
        """Whose fetch of the global model the outer optimizer counts on the downlink: a restarted incarnation's
        (it crosses the WAN), not a first start's (islands could build the initial model from the seed)."""
        return self.island if self.incarnation > 1 else None

    def adopt(self, incarnation: int, name: str, now: float) -> None:
        """Take over a live incarnation a previous monitor started (found by name at `now`, monotonic)."""
        self.incarnation, self.name = incarnation, name
        if self.state in (IslandState.RESTARTING, IslandState.REINTEGRATING) and self.failures > self.restarts:
            # The previous monitor died after placing this incarnation but before it parked the count.
            self.restarts += 1
        self.last_progress_at = self.last_status_at = now

    def observe(self, status: Any, now: float) -> bool:
        """Take the current incarnation's `status` answer at `now` (monotonic); returns whether it made progress."""
        self.status, self.last_status_at = status, now
        if status.steps != self.steps:
            self.steps, self.last_progress_at = status.steps, now
            return True
        if status.state == IslandState.BLOCKED:
            # Waiting for a round is not a hang, so the hang clock restarts when the island unblocks.
            # Counted from its last step instead, a sync island whose round took 30 s was judged hung
            # by the first check that caught it computing the step after (66 false failures in a run).
            self.last_progress_at = now
        return False


def has_submitted(status: Any) -> bool:
    """Whether an island incarnation's status shows a submission cut (what earns its backoff back)."""
    return status is not None and sum(status.submitted_tokens or ()) > 0


def island_name(run_id: str, island: int, incarnation: int) -> str:
    """The detached actor (and placement group) name of one island incarnation."""
    return f"{run_id}-island{island}-inc{incarnation}"


async def islands_stepped(slots: Iterable[Any], *, wait_s: float, tick_s: float, stopping: Callable[[], bool]) -> None:
    """Return once every island slot (a live view of the monitor's `SlotState`s) that is not dead, stopped or vacant
    has stepped, or `wait_s` later, or when the run stops.

    What the islands need only once they train (warm spares, progress keepers) starts after this: each is
    a process to start (a spare also imports torch), and started beside the islands they took CPU from
    their first steps on a small machine (benchmarks/startup.py)."""
    deadline = time.monotonic() + wait_s
    while not stopping() and time.monotonic() < deadline and any(
            slot.steps == 0 and slot.state not in (IslandState.DEAD, IslandState.STOPPED, IslandState.VACANT) for slot in slots):
        await asyncio.sleep(tick_s)
