"""An island's inbox: published fragments received, fetched at once and adopted at the next step boundary.

`queue` runs on a control thread (the actor's `adopt` call): it resolves the object ref and decodes a
compressed downlink there, off the compute path. `apply_updates` runs on the loop thread between two
inner steps: it undoes downlink differences, applies each update with the island's adoption policy
(overwrite, rebase or mix; policies/adoption.py) and resolves the outbox's cuts the update merged or
refused. `resync` replaces everything with the outer optimizer's state after it went back to a checkpoint.

In an FSDP island (islands/fsdp.py) the fragments hold this worker's parts and every worker keeps an
inbox: the leader's `take`s what arrived and tells the others, and each `apply`s it to its parts. The
leader then fetches an update only when it applies it and hands each worker its part (`split`), so it
holds one whole fragment at a time; a resync clears the cuts at that boundary, on every worker alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from islands.fragment_state import FragmentState
from islands.messages import FragmentUpdate
from islands.outbox import Outbox
from policies.adoption import AdoptionPolicy, adopt_fragment
from policies.downlink import apply_delta, decode_fragment

Fetched = tuple[FragmentUpdate, list[torch.Tensor] | None]
"""An update with its fragment's tensors resolved, decoded and on the island's device (None in an FSDP
island: fetched, or received as this worker's part, when applied)."""

Split = Callable[[int, list[torch.Tensor] | None], list[torch.Tensor]]
"""`split(p, whole)`: this worker's part of fragment p's whole tensors (given on the leader, None elsewhere)."""


class Inbox:
    """Updates received and not yet applied, and the adoption that applies them to the island's fragments."""

    def __init__(self, *, island: int, adoption: AdoptionPolicy, fragments: FragmentState, outbox: Outbox,
                 cv: threading.Condition, device: torch.device, resolve: Callable[[Any], Any],
                 hear_progress: Callable[[float], None], split: Split | None = None) -> None:
        """`resolve` fetches a list-wrapped object ref (ray.get in an actor); `hear_progress` receives the
        run progress every update carries, before it is applied (the inner learning rate follows it);
        `split` makes this the inbox of one worker of an FSDP island (see the module's docstring)."""
        self.island = island
        self.adoption = adoption
        self._fragments = fragments
        self._outbox = outbox
        self._cv = cv
        self._device = device
        self._resolve = resolve
        self._hear_progress = hear_progress
        self._split = split
        self._updates: list[Fetched] = []
        self._resync_pending: list[Fetched] = []

    def has_updates(self) -> bool:
        """An update is waiting for the next step boundary (caller holds `cv`)."""
        return bool(self._updates)

    def _to_device(self, tensors: Any) -> list[torch.Tensor]:
        # A compressed downlink (outer.downlink) is decoded here, off the compute path, to float32.
        tensors = decode_fragment(tensors)
        # On CPU the fetched (read-only, shared) tensors are used as they are; on a GPU, copied over once.
        if self._device.type == "cpu":
            return list(tensors)
        return [t.to(self._device) for t in tensors]

    def queue(self, update: FragmentUpdate) -> None:
        """Fetch a published fragment now (FSDP: when applied); it is applied at the next step boundary."""
        tensors = self._to_device(self._resolve(update.tensors[0])) if self._split is None else None
        with self._cv:
            self._updates.append((update, tensors))
            self._cv.notify_all()

    def resync(self, latest: list[FragmentUpdate]) -> None:
        """Force-adopt `latest` at the next step boundary, dropping local progress and every cut (see LearnerIsland.resync)."""
        for u in latest:
            if u.delta_from is not None:
                raise ValueError(f"resync needs whole fragments, got a difference for fragment {u.fragment}; "
                                 "pass the outer optimizer's latest()")
        if self._split is not None:  # FSDP: every worker forgets its cuts at the boundary that adopts these
            with self._cv:
                self._updates.clear()
                self._resync_pending = [(u, None) for u in latest]
                self._cv.notify_all()
            return
        fetched: list[Fetched] = [(u, self._to_device(self._resolve(u.tensors[0]))) for u in latest]
        with self._cv:
            self._updates.clear()
            self._forget_progress()
            self._resync_pending = fetched
            self._cv.notify_all()

    def _forget_progress(self) -> None:
        """A resync: drop every cut, and count the progress since them as discarded (caller holds `cv`)."""
        state = self._fragments
        # Outbox tokens were counted as submitted; dropping them makes them "taken, never received".
        self._outbox.clear()
        for p in range(state.num_fragments):
            state.discarded[p] += state.tokens[p]
            state.reset_progress(p)

    def apply_updates(self) -> set[int]:
        """The step boundary: apply every received update in (fragment, version) order. Loop thread only.

        Returns the fragments whose parameters changed (what a multi-worker island's followers must copy).
        """
        return self.apply(*self.take())

    def take(self) -> tuple[list[Fetched], list[Fetched]]:
        """What arrived since the last boundary: (resync, updates), each in the order `apply` applies them."""
        with self._cv:
            updates, self._updates = self._updates, []
            forced, self._resync_pending = self._resync_pending, []
        # In version order per fragment, so a chain of differences applies link by link.
        return forced, sorted(updates, key=lambda u: (u[0].fragment, u[0].version))

    def apply(self, forced: list[Fetched], updates: list[Fetched]) -> set[int]:
        """Apply a resync's fragments, then `updates`, in order; returns the fragments whose parameters changed.

        In an FSDP island every worker calls this with the same updates in the same order (the leader's
        `take`), so the parts of each fragment are fetched and split one fragment at a time."""
        changed: set[int] = set()
        for update, _ in forced + updates:  # the learning rate's progress never runs backwards (late or stale updates)
            if update.progress is not None:
                self._hear_progress(update.progress)
        if forced and self._split is not None:
            with self._cv:
                self._forget_progress()
        for update, tensors in forced:
            tensors = self._part(update, tensors)
            with torch.no_grad():
                for t, g in zip(self._fragments.theta[update.fragment], tensors):
                    t.copy_(g)
            self._fragments.adopted(update.fragment, tensors, version=update.version, epoch=update.epoch)
            changed.add(update.fragment)
        for update, tensors in updates:
            tensors = self._part(update, tensors)
            if update.delta_from is not None:
                tensors = self._undelta(update, tensors)
            if self._apply_one(update, tensors):
                changed.add(update.fragment)
        return changed

    def _part(self, update: FragmentUpdate, tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The update's tensors for this worker: as fetched, or (FSDP) this worker's part of them."""
        if self._split is None:
            assert tensors is not None
            return tensors
        whole = self._to_device(self._resolve(update.tensors[0])) if update.tensors else None  # the leader's copy
        return self._split(update.fragment, whole)

    def _undelta(self, update: FragmentUpdate, delta: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The global fragment a downlink difference stands for, or None if it is not for our copy."""
        p, state = update.fragment, self._fragments
        if update.epoch != state.epoch[p] or update.version <= state.version[p]:
            return None  # from an outer optimizer that has since restarted, or nothing new: bookkeeping only
        if update.delta_from == state.version[p]:
            return apply_delta(state.base[p], delta)
        # The sender encodes each difference from what it last sent us and awaits our adoption before the
        # next, so a gap is a bug, not a race; failing makes the monitor rebuild us from whole fragments.
        raise RuntimeError(f"island {self.island}: a downlink difference for fragment {p} is from version "
                           f"{update.delta_from}, but this island holds version {state.version[p]}")

    def _apply_one(self, update: FragmentUpdate, global_: list[torch.Tensor] | None) -> bool:
        """Adopt one update into fragment p (True) or only resolve the cuts it names (False: stale)."""
        p, state, rebase = update.fragment, self._fragments, self.adoption.kind == "rebase"
        with self._cv:
            mine = self._outbox.mine(update.merged)
            self._outbox.resolve(update.refused)
        # A version from an outer optimizer that has since restarted (a lower epoch) may come from a
        # lineage the restart rolled back: never adopt it over what the new one sent.
        if global_ is None or update.version <= state.version[p] or update.epoch < state.epoch[p]:
            with self._cv:  # an older update that arrived late: bookkeeping only
                self._outbox.resolve(mine)
            return False
        # The parameters that not-yet-merged local progress is measured from: just after this
        # island's newest merged submission if it took part, else the fragment's base.
        anchor = self._outbox.newest_snapshot(mine) if mine and rebase else state.base[p]  # rebase keeps snapshots
        assert anchor is not None  # only overwrite and mix adoptions drop a cut's snapshot (Outbox.follow_adoption)
        shift = self._adopt(p, anchor, global_)
        with self._cv:
            if self.adoption.kind == "overwrite" and state.steps[p]:
                # The fragment's progress since its last cut was just replaced: it never reaches the global
                # parameters, so its tokens and compute are not the next cut's (docs/architecture.md section 6, useful).
                state.overwritten[p] += state.tokens[p]
                state.reset_progress(p)
            self._outbox.resolve(mine)
            self._outbox.follow_adoption(p, shift if rebase else None)
            state.adopted(p, global_, version=update.version, epoch=update.epoch)
            self._cv.notify_all()
        return True

    def _adopt(self, p: int, anchor: list[torch.Tensor], global_: list[torch.Tensor]) -> list[torch.Tensor]:
        """Write the adopted fragment p into theta, in place (the optimizer holds these tensors); returns new - old."""
        theta = self._fragments.theta[p]
        with torch.no_grad():
            if not self._fragments.base[p]:  # first adoption: nothing local to keep
                new = [g.detach().to(t.dtype).clone() for g, t in zip(global_, theta)]
            else:
                new = adopt_fragment(self.adoption, local=[t.detach() for t in theta], anchor=anchor, global_=global_)
            shift = [n - t.detach() for n, t in zip(new, theta)]
            for t, n in zip(theta, new):
                t.copy_(n)  # never modify `global_`: it may be the shared fetched copy
        return shift
