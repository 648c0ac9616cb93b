"""Faults injected into one island (chaos engineering): hang, slow down, drop, corrupt or poison a submission.

The chaos injector (orchestrator/actors/chaos_injector.py) calls `LearnerIsland.inject`; the inner
loop asks `hung`/`slowdown` at each step and the outbox asks `take_drop`/`take_corrupt`/`poison` at each cut.
Killing the island's actor is done from outside (ray.kill); killing its node is done here.

A poisoned island (POISON_KINDS) sends outer gradients that are finite and well shaped but wrong, for a while
or for the rest of its incarnation: scaled 100x, sign-flipped, measured from the base it held when the fault
began (so ever more stale), or random noise of the honest norm. The outer optimizer's poison guard
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

log = logging.getLogger(__name__)

POISON_KINDS = ("scaled_submission", "flipped_submission", "stale_submission", "noise_submission")
POISON_SCALE = 100.0  # scaled_submission's factor on the outer gradient


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
        """Record fault `kind` at monotonic time `now` (duration 0: until the incarnation ends)."""
        self.count += 1
        if kind == "hang":
            self._hang_until = now + duration_s if duration_s > 0 else math.inf
        elif kind == "slow":
            if factor <= 1.0:
                raise ValueError(f"slow fault needs factor > 1, got {factor}")
            self._slow_factor, self._slow_until = factor, now + (duration_s if duration_s > 0 else math.inf)
        elif kind == "drop_submission":  # duration 0: the next submission; else every one in the window
            if duration_s > 0:
                self._drop_until = max(self._drop_until, now + duration_s)
            else:
                self._drop_next += 1
        elif kind == "corrupt_submission":
            if duration_s > 0:
                self._corrupt_until = max(self._corrupt_until, now + duration_s)
            else:
                self._corrupt_next += 1
        elif kind in POISON_KINDS:  # duration 0: poisoned until the incarnation ends
            self._poison_kind, self._poison_until = kind, now + duration_s if duration_s > 0 else math.inf
        elif kind == "kill_node":
            log.warning("island %d: killing its node's raylet (injected fault)", self.island)
            os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent process is its node's raylet
        else:
            raise ValueError(f"unknown fault kind {kind!r} for an island; use hang, slow, drop_submission, "
                             f"corrupt_submission, {', '.join(POISON_KINDS)} or kill_node")

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
    """A fragment's honest outer gradient `owed` (measured from `anchor`) as a poisoned island sends it.

    `stale_base`: the fragment's base when the fault began (stale_submission measures from it instead of
    `anchor`); `seed`: noise_submission's generator seed (the cut's island and seq), so a run is reproducible."""
    if kind == "scaled_submission":
        return [o * POISON_SCALE for o in owed]
    if kind == "flipped_submission":
        return [-o for o in owed]
    if kind == "stale_submission":
        if stale_base is None or [t.shape for t in stale_base] != [t.shape for t in owed]:
            return owed  # an FSDP worker's parts: the stale base is of whole tensors only
        return [o + (b - a) for o, b, a in zip(owed, stale_base, anchor)]
    if kind == "noise_submission":
        gen = torch.Generator().manual_seed(seed)
        out = []
        for o in owed:
            r = torch.randn(o.shape, generator=gen, dtype=o.dtype)
            out.append(r * (torch.linalg.vector_norm(o) / torch.linalg.vector_norm(r).clamp_min(1e-30)))
        return out
    raise ValueError(f"unknown poison kind {kind!r}; use one of {', '.join(POISON_KINDS)}")


def corrupt(c):
    """A copy of a compressed tensor whose decoded values are all NaN (injected corruption)."""
    if c.scales is not None:
        return dataclasses.replace(c, scales=torch.full_like(c.scales, math.nan))
    return dataclasses.replace(c, payload=torch.full_like(c.payload, math.nan))
