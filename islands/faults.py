"""Faults injected into one island (chaos engineering): hang, slow down, drop or corrupt a submission.

The chaos injector (orchestrator/actors/chaos_injector.py) calls `LearnerIsland.inject`; the inner
loop asks `hung`/`slowdown` at each step and the outbox asks `take_drop`/`take_corrupt` at each cut.
Killing the island's actor is done from outside (ray.kill); killing its node is done here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal

import torch

log = logging.getLogger(__name__)

class InjectedFaults:
    """The faults pending on one island incarnation. The island's lock guards it; time is an argument."""

    def __init__(self, island: int) -> None:
        self.island = island
        self.count = 0  # faults injected into this incarnation (IslandStatus.faults)
        self._hang_until = 0.0
        self._slow_until = 0.0
        self._slow_factor = 1.0
        self._drop_next = 0
        self._corrupt_next = 0

    def inject(self, kind: str, *, now: float, duration_s: float = 0.0, factor: float = 1.0) -> None:
        """Record fault `kind` at monotonic time `now` (duration 0: until the incarnation ends)."""
        self.count += 1
        if kind == "hang":
            self._hang_until = now + duration_s if duration_s > 0 else math.inf
        elif kind == "slow":
            if factor <= 1.0:
                raise ValueError(f"slow fault needs factor > 1, got {factor}")
            self._slow_factor, self._slow_until = factor, now + (duration_s if duration_s > 0 else math.inf)
        elif kind == "drop_submission":
            self._drop_next += 1
        elif kind == "corrupt_submission":
            self._corrupt_next += 1
        elif kind == "kill_node":
            log.warning("island %d: killing its node's raylet (injected fault)", self.island)
            os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent process is its node's raylet
        else:
            raise ValueError(f"unknown fault kind {kind!r} for an island; use hang, slow, drop_submission, "
                             "corrupt_submission or kill_node")

    def hung(self, now: float) -> bool:
        """An injected hang holds the inner loop at `now`."""
        return now < self._hang_until

    def slowdown(self, now: float) -> float:
        """The factor an injected straggler stretches a step that ends at `now` by (1.0: none)."""
        return self._slow_factor if self._slow_factor > 1.0 and now < self._slow_until else 1.0

    def take_drop(self) -> bool:
        """Whether the next cut is lost on the way (uses up one pending drop)."""
        if not self._drop_next:
            return False
        self._drop_next -= 1
        return True

    def take_corrupt(self) -> bool:
        """Whether the next cut goes out as NaN (uses up one pending corruption)."""
        if not self._corrupt_next:
            return False
        self._corrupt_next -= 1
        return True


def corrupt(c):
    """A copy of a compressed tensor whose decoded values are all NaN (injected corruption)."""
    if c.scales is not None:
        return dataclasses.replace(c, scales=torch.full_like(c.scales, math.nan))
    return dataclasses.replace(c, payload=torch.full_like(c.payload, math.nan))
