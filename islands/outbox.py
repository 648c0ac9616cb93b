"""An island's outbox: cutting outer gradients into submissions and tracking them until they resolve.

Every H/P inner steps the island cuts the next fragment in the fixed order p = k mod P as the outer
gradient `base[p] - theta[p]` (encoded with the run's compression, error feedback keeping what the
encoding left out) and leaves it here; the outer optimizer *calls* `LearnerIsland.next_submission`
to take it, so the outer owns the result. A cut stays in flight until an update merges or refuses it;
while it does, the fragment's later progress is measured from the parameters just after it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch

from islands.cursor import DataCursor
from islands.faults import InjectedFaults, corrupt, poisoned
from islands.fragment_state import FragmentState
from islands.messages import Submission, SubmissionKey
from islands.plugins import load_compressor
from islands.spec import IslandSpec
from policies.base_check import fragment_digest
from policies.compression import Compressed, compress
from policies.downlink import decode_fragment
from policies.error_feedback import ErrorFeedback
from policies.fault_kinds import poison_kind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboxSettings:
    """Who cuts (island, incarnation) and how a cut is encoded (the run's outer-gradient compression)."""

    island: int
    incarnation: int
    compression: str
    compression_block_size: int
    topk_density: float
    feedback_decay: float

    @classmethod
    def from_spec(cls, spec: IslandSpec) -> OutboxSettings:
        """The outbox's part of an island's spec."""
        return cls(island=spec.island, incarnation=spec.incarnation, compression=spec.compression,
                   compression_block_size=spec.compression_block_size, topk_density=spec.topk_density,
                   feedback_decay=spec.feedback_decay)


@dataclass(frozen=True)
class LoopReadings:
    """What a submission reports of the inner loop at its cut: its pace, its loss and its data cursor."""

    step_time_s: float
    train_loss: float
    cursor: DataCursor


@dataclass
class InFlight:
    """A cut not yet merged or refused.

    `snapshot` is theta[p] just after the cut: while the cut is in flight the fragment's later progress is
    measured from it, since the cut already carries everything before it. A rebase adoption shifts it with
    theta; an overwrite or mix adoption replaces the parameters it was taken of, so it is dropped (None) and
    the new base is the reference again.
    """

    fragment: int
    snapshot: list[torch.Tensor] | None


class Outbox:
    """Cuts of one island waiting to be taken, and the cuts taken but not yet resolved (in flight).

    Every method but `encode` (which touches no shared state) runs with the island's condition `cv`
    held by the caller; a cut notifies `cv`.
    """

    def __init__(self, settings: OutboxSettings, fragments: FragmentState, *, cv: threading.Condition,
                 faults: InjectedFaults, readings: Callable[[], LoopReadings],
                 assemble: Callable[[int, list[torch.Tensor]], list[torch.Tensor] | None] | None = None) -> None:
        """`assemble(p, parts)`: in an FSDP island (islands/fsdp.py), where the fragments hold this worker's
        parts, puts a cut's parts together: the whole differences on the leader, None on the other workers,
        which keep the bookkeeping only."""
        self.settings = settings
        self._fragments = fragments
        self._cv = cv
        self._faults = faults
        self._readings = readings
        self._assemble = assemble
        # Top-k, int2 and sign (any compressor that needs_feedback) drop much of each outer gradient: what a cut
        # does not carry is owed to the next. Loading it here also registers a user's in this process.
        P = fragments.num_fragments
        self.feedback = (ErrorFeedback(P, settings.feedback_decay)
                         if load_compressor(settings.compression).needs_feedback else None)
        self.next_seq = 0  # submissions cut so far: the next cut's seq
        self.inflight: dict[SubmissionKey, InFlight] = {}
        self._ready: collections.deque[Submission] = collections.deque()
        self._stale_bases: dict[int, list[torch.Tensor]] = {}  # stale_submission: each fragment's base when it began
        self._poison_logged: str | None = None
        self.started_at_version = 0  # the highest version the island started from (Submission.started_at_version)

    # ------------------------------------------------------------ cutting

    def next_fragment(self) -> int:
        """The fragment the next round-robin cut takes (seq mod P)."""
        return self.next_seq % self._fragments.num_fragments

    def cut(self, fragment: int | None = None, *, drop: bool | None = None) -> None:
        """Cut the next fragment (round-robin, fragment = seq mod P) or `fragment` (the final flush) into a submission.

        `drop`: whether an injected fault loses it on the way; None asks the island's faults (an FSDP
        island's leader asks them and tells its workers, whose bookkeeping must agree)."""
        s, state = self.settings, self._fragments
        p = self.next_fragment() if fragment is None else fragment
        seq = self.next_seq
        self.next_seq += 1
        sub = self.progress(p, seq)
        owed = cast("list[torch.Tensor]", sub.payload)  # progress' raw differences, encoded below if this one sends
        sends = True
        if self._assemble is not None:
            whole = self._assemble(p, owed)
            sends = whole is not None  # only the leader hands out the cut; the other workers keep the bookkeeping
            owed = whole if whole is not None else []
        poison = self._faults.poison(time.monotonic()) if sends else None
        if poison is not None:  # injected fault: finite, well shaped and wrong (the poison guard must refuse it)
            owed = self._poisoned(poison, p, seq, owed)
            if poison_kind(poison).needs_stale_base and sub.base_digest is not None:  # as an island whose copy is stale
                sub.base_digest = fragment_digest(self._stale_bases[p])  # would tell it: the base it measured from
        if sends:
            sub.payload = self.encode(owed)
            if self.feedback is not None:  # what this cut does not carry is owed to the next one
                self.feedback.settle(p, owed, decode_fragment(sub.payload))
        state.submitted[p] += sub.tokens
        state.reset_progress(p)
        if self._faults.take_drop() if drop is None else drop:  # injected fault: lost on the way (its tokens are lost)
            log.warning("island %d: dropping submission %d (injected fault)", s.island, seq)
            return
        if not sends:  # its part of theta at the cut: what its later progress is measured from
            self.inflight[sub.key] = InFlight(p, [t.detach().clone() for t in state.theta[p]])
            return
        if self._faults.take_corrupt():  # injected fault: NaN on the wire; the outer optimizer must refuse it
            sub.payload = [corrupt(c) for c in sub.payload]
            log.warning("island %d: corrupting submission %d (injected fault)", s.island, seq)
        self.inflight[sub.key] = InFlight(p, [t.detach().clone() for t in state.theta[p]])
        self._ready.append(sub)
        self._cv.notify_all()

    def _poisoned(self, kind: str, p: int, seq: int, owed: list[torch.Tensor]) -> list[torch.Tensor]:
        if poison_kind(kind).needs_stale_base and p not in self._stale_bases:  # stale_submission measures from it
            self._stale_bases[p] = [t.detach().clone() for t in self._fragments.base[p]]
        if kind != self._poison_logged:  # once per kind: a poisoned island may send hundreds
            self._poison_logged = kind
            log.warning("island %d: poisoning its submissions from %d on as %s (injected fault)",
                        self.settings.island, seq, kind)
        return poisoned(kind, owed, stale_base=self._stale_bases.get(p), anchor=self.anchor(p),
                        seed=self.settings.island * 1_000_003 + seq)

    def cut_remaining(self) -> None:
        """The final flush: cut every fragment with progress since its last cut, in fragment order."""
        for p in range(self._fragments.num_fragments):
            if self._fragments.has_progress(p):
                self.cut(p)

    def progress(self, p: int, seq: int) -> Submission:
        """Fragment p's progress since its last cut as a submission numbered `seq` (no counter changes).

        The payload is raw float32 differences (plus what error feedback still owes, under top-k) for the
        caller to encode (`encode`); a progress snapshot encodes on its sender thread, off the inner loop:
        it covers every fragment, and quantizing it on the loop thread took about 1% of a run's step time at
        the default salvage interval."""
        state, s, now = self._fragments, self.settings, self._readings()
        with torch.no_grad():
            deltas = [(a - t.detach()).cpu() for a, t in zip(self.anchor(p), state.theta[p])]  # .cpu(): no-op on CPU
            payload = deltas if self.feedback is None else self.feedback.owed(p, deltas)
        return Submission(
            island=s.island, incarnation=s.incarnation, seq=seq, fragment=p,
            base_version=state.version[p], tokens=state.tokens[p], inner_steps=state.steps[p],
            step_time_s=now.step_time_s, train_loss=now.train_loss,
            # Raw until `encode` replaces it (in `cut`, or on the salvage shelf's sender thread).
            payload=cast("list[Compressed]", payload), created_at=time.time(), compute_s=state.compute[p], cursor=now.cursor,
            base_epoch=state.epoch[p], base_digest=None if self._assemble is not None else fragment_digest(state.base[p]),
            started_at_version=self.started_at_version,
        )

    def encode(self, deltas: list[torch.Tensor]) -> list[Compressed]:
        """The wire form of a fragment's differences (the run's outer-gradient compression)."""
        s = self.settings
        return [compress(d, s.compression, block_size=s.compression_block_size, density=s.topk_density)
                for d in deltas]

    def anchor(self, p: int) -> list[torch.Tensor]:
        """What fragment p's unsubmitted progress is measured from.

        The parameters at its newest cut still in flight, if they are still the reference (see `InFlight`),
        else the base it last adopted. Measured from the base, a cut, snapshot or final flush made while an
        earlier cut is in flight would carry that cut's progress a second time.
        """
        flights = [(k.seq, f.snapshot) for k, f in self.inflight.items() if f.fragment == p and f.snapshot is not None]
        return max(flights, key=lambda sf: sf[0])[1] if flights else self._fragments.base[p]

    # ------------------------------------------------------------ handing out

    def busy(self) -> bool:
        """A cut is waiting to be taken or in flight (synchronous DiLoCo waits for neither)."""
        return bool(self.inflight) or bool(self._ready)

    def has_ready(self) -> bool:
        """A cut is waiting to be taken."""
        return bool(self._ready)

    def take(self) -> Submission:
        """The oldest cut waiting to be taken (it stays in flight)."""
        return self._ready.popleft()

    def waiting_tokens(self) -> list[int]:
        """Per fragment: tokens cut, not yet taken by the outer optimizer."""
        tokens = [0] * self._fragments.num_fragments
        for sub in self._ready:
            tokens[sub.fragment] += sub.tokens
        return tokens

    def taken_inflight(self) -> int:
        """Cuts taken by the outer optimizer, not yet merged or refused."""
        return sum(1 for k in self.inflight if all(s.key != k for s in self._ready))

    # ------------------------------------------------------------ resolving

    def mine(self, merged: Iterable[SubmissionKey]) -> list[SubmissionKey]:
        """The keys among `merged` that are this island's cuts still in flight."""
        return [k for k in merged if k in self.inflight]

    def resolve(self, keys: Iterable[SubmissionKey]) -> None:
        """Stop tracking these cuts (merged or refused); unknown keys are ignored."""
        for key in keys:
            self.inflight.pop(key, None)

    def newest_snapshot(self, keys: list[SubmissionKey]) -> list[torch.Tensor] | None:
        """The snapshot of the newest of these in-flight cuts."""
        return self.inflight[max(keys, key=lambda k: k.seq)].snapshot

    def follow_adoption(self, p: int, shift: list[torch.Tensor] | None) -> None:
        """Fragment p adopted a new version: shift its cuts' snapshots with theta (rebase, `shift`) or drop them (None)."""
        for flight in self.inflight.values():
            if flight.fragment != p or flight.snapshot is None:
                continue
            if shift is not None:  # rebase: keep the "theta - snapshot" invariant for later rounds
                for s, d in zip(flight.snapshot, shift):
                    s.add_(d)
            else:  # the progress it was the reference for was replaced: measure from the new base
                flight.snapshot = None

    def clear(self) -> None:
        """Forget every cut, waiting or in flight (a resync: the outer optimizer went back to a checkpoint)."""
        self._ready.clear()
        self.inflight.clear()

