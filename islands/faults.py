"""Faults injected into one island (chaos engineering): the island's fault state and the hooks that read it.

The chaos injector (orchestrator/actors/chaos_injector.py) calls `LearnerIsland.inject`, which hands the fault to
its kind (policies/fault_kinds.py, where every kind is declared): an island kind sets this state through the hooks
of `policies.fault_kinds.IslandHooks` (hang, slow down, drop, corrupt or poison submissions, kill the node). The
inner loop asks `hung`/`slowdown` at each step and the outbox asks `take_drop`/`take_corrupt`/`poison` at each cut.
Killing the island's actor is done from outside (ray.kill).

A poisoned island (POISON_KINDS) sends outer gradients that are finite and well shaped but wrong, for a while
or for the rest of its incarnation, as its poison kind makes them (`poisoned`). The outer optimizer's poison guard
(policies/poison_guard.py) is what must refuse them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time

import torch

from policies.fault_kinds import POISON_KINDS, POISON_SCALE, island_kind, poison_kind

log = logging.getLogger(__name__)

__all__ = ["POISON_KINDS", "POISON_SCALE", "InjectedFaults", "corrupt", "poisoned"]  # the kinds' views, re-exported


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
        self._drop_until = self._corrupt_until = 0.0  # windows of drop/corrupt faults with a duration
        self._poison_kind: str | None = None
        self._poison_until = 0.0

    def inject(self, kind: str, *, now: float, duration_s: float = 0.0, factor: float = 1.0) -> None:
        """Record fault `kind` at monotonic time `now` (duration 0: until the incarnation ends): its kind sets the
        hooks below (policies/fault_kinds.py)."""
        self.count += 1
        island_kind(kind).inject_island(self, now=now, duration_s=duration_s, factor=factor)

    # ------------------------------------------------------------ hooks the kinds set (policies.fault_kinds.IslandHooks)

    def hang_until(self, until: float) -> None:
        """Hold the inner loop until `until`."""
        self._hang_until = until

    def slow_until(self, factor: float, until: float) -> None:
        """Stretch each step by `factor` until `until`."""
        self._slow_factor, self._slow_until = factor, until

    def drop_next(self) -> None:
        """Lose the next cut on the way."""
        self._drop_next += 1

    def drop_until(self, until: float) -> None:
        """Lose every cut until `until` (an earlier window's later end stands)."""
        self._drop_until = max(self._drop_until, until)

    def corrupt_next(self) -> None:
        """Send the next cut as NaN."""
        self._corrupt_next += 1

    def corrupt_until(self, until: float) -> None:
        """Send every cut until `until` as NaN."""
        self._corrupt_until = max(self._corrupt_until, until)

    def poison_until(self, kind: str, until: float) -> None:
        """Poison every cut until `until` as `kind`."""
        self._poison_kind, self._poison_until = kind, until

    def kill_node(self) -> None:
        """Kill this island's node."""
        log.warning("island %d: killing its node's raylet (injected fault)", self.island)
        os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent process is its node's raylet

    # ------------------------------------------------------------ hooks the inner loop and the outbox read

    def hung(self, now: float) -> bool:
        """An injected hang holds the inner loop at `now`."""
        return now < self._hang_until

    def slowdown(self, now: float) -> float:
        """The factor an injected straggler stretches a step that ends at `now` by (1.0: none)."""
        return self._slow_factor if self._slow_factor > 1.0 and now < self._slow_until else 1.0

    def take_drop(self, now: float | None = None) -> bool:
        """Whether the next cut (at monotonic time `now`, default: the clock) is lost on the way: inside a drop
        window, or by one pending drop (used up)."""
        if (time.monotonic() if now is None else now) < self._drop_until:
            return True
        if not self._drop_next:
            return False
        self._drop_next -= 1
        return True

    def take_corrupt(self, now: float | None = None) -> bool:
        """Whether the next cut goes out as NaN: inside a corruption window, or by one pending corruption (used up)."""
        if (time.monotonic() if now is None else now) < self._corrupt_until:
            return True
        if not self._corrupt_next:
            return False
        self._corrupt_next -= 1
        return True


    def poison(self, now: float) -> str | None:
        """The poison kind a cut at `now` goes out with (None: an honest cut)."""
        return self._poison_kind if now < self._poison_until else None


def poisoned(kind: str, owed: list[torch.Tensor], *, stale_base: list[torch.Tensor] | None,
             anchor: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A fragment's honest outer gradient `owed` (measured from `anchor`) as an island poisoned as `kind` sends it
    (`PoisonKind.poisoned`, policies/fault_kinds.py).

    `stale_base`: the fragment's base when the fault began (stale_submission measures from it instead of
    `anchor`); `seed`: noise_submission's generator seed (the cut's island and seq), so a run is reproducible."""
    return poison_kind(kind).poisoned(owed, stale_base=stale_base, anchor=anchor, seed=seed)


def corrupt(c):
    """A copy of a compressed tensor whose decoded values are all NaN (injected corruption)."""
    if c.scales is not None:
        return dataclasses.replace(c, scales=torch.full_like(c.scales, math.nan))
    return dataclasses.replace(c, payload=torch.full_like(c.payload, math.nan))
