"""What the outer-optimizer shell has published, in the downlink's wire formats (outer.downlink, outer.downlink_delta).

`PublishedFragments` keeps the latest version of every fragment as one object-store ref (handed to every
island that fetches or adopts it), its size on the wire, and, when versions go down as differences, what
each island holds (policies.downlink.DownlinkCopies) and the last few versions as islands decode them,
so that an island registering with one of them gets differences at once.

Imported when the shell is constructed (it needs torch), never by a process that only holds a handle.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import ray

from islands.messages import FragmentUpdate
from policies.downlink import DownlinkCopies, decode_fragment

if TYPE_CHECKING:
    import torch

    from orchestrator.core.outer_optimizer import OuterSettings

log = logging.getLogger(__name__)
# Published versions per fragment kept decoded for registering islands (differences down only): a restarted
# island registers a second or two after it fetched latest(), while K = 1 rounds go on.
_REMEMBERED_VERSIONS = 4


class PublishedFragments:
    """Per fragment: the latest published version's ref and wire size; per island: the copy it holds."""

    def __init__(self, settings: OuterSettings, fragments: list[list[torch.Tensor]], versions: list[int]) -> None:
        # What each island holds of each fragment, when versions go down as differences (outer.downlink_delta);
        # its `whole` is the format of every whole fragment that goes down.
        self.copies = DownlinkCopies(settings.downlink, settings.downlink_delta, block_size=settings.compression_block_size,
                                     density=settings.topk_density)
        wire = [self.copies.whole(frag) for frag in fragments]
        # The latest published version of every fragment, in its wire format: one ray.put each, handed out as [ref].
        self.refs = [ray.put(w) for w in wire]
        # Bytes of one published fragment on the wire: fixed for the run (shapes and format do not change).
        self.nbytes = [sum(t.nbytes for t in w) for w in wire]  # torch tensors and Compressed alike
        # With differences down: the last few published versions as islands decode them, per fragment, so that an
        # island registering with one of them gets differences from it at once, not the whole fragment again.
        self.decoded: list[collections.OrderedDict[int, list]] = [collections.OrderedDict() for _ in wire]
        if self.delta:
            for p, w in enumerate(wire):
                self.decoded[p][versions[p]] = decode_fragment(w)
        # Island incarnations a difference was sent to: what they hold may then differ from any whole version by
        # rounding, so they are never seeded again (an unregistered incarnation registering anew).
        self._diffed: set[tuple[int, int]] = set()

    @property
    def delta(self) -> bool:
        """Whether later versions go down as differences from each island's copy."""
        return self.copies.delta is not None

    async def publish(self, fragment: int, version: int, tensors: list[torch.Tensor],
                      run_on_core: Callable[..., Awaitable[Any]]) -> Any:
        """Make `version` of `fragment` the latest: encoded whole (and, with differences down, decoded as the
        islands will hold it) on the core's thread via `run_on_core`, put in the object store. Returns its ref."""
        whole = await run_on_core(self.copies.whole, tensors)
        ref = ray.put(whole)
        if self.delta:
            recent = self.decoded[fragment]
            recent[version] = await run_on_core(decode_fragment, whole)
            while len(recent) > _REMEMBERED_VERSIONS:
                recent.popitem(last=False)
        self.refs[fragment] = ref  # dropping the old ref lets the store free it
        return ref

    def encode(self, island: int, incarnation: int, update: FragmentUpdate, tensors: list) -> tuple[FragmentUpdate, int]:
        """(update as sent, bytes on the wire) for this island's copy: whole or a difference (delta mode only)."""
        enc = self.copies.encode(island, incarnation, update.fragment, update.version, tensors)
        if enc.delta_from is not None:
            self._diffed.add((island, incarnation))
        return dataclasses.replace(update, tensors=[ray.put(enc.payload)], delta_from=enc.delta_from), enc.nbytes

    def may_seed(self, island: int, incarnation: int, live_incarnation: int | None) -> bool:
        """Whether a registering incarnation may be seeded with what it holds: a new incarnation, never sent
        a difference (asked before it is admitted, while nothing is sent to it, so the answer cannot change)."""
        return live_incarnation != incarnation and (island, incarnation) not in self._diffed

    async def held(self, handle: Any) -> list[tuple[int, int]] | None:
        """(version, epoch) of every fragment an island holds, when differences go down (None: not asked, or no
        answer within 10 s; it then gets whole fragments first)."""
        if not self.delta:
            return None
        try:
            st = await asyncio.wait_for(handle.status.remote(), timeout=10.0)  # an ObjectRef is awaitable
        except Exception as err:  # noqa: BLE001 - an island that cannot answer gets whole fragments, as before
            log.info("island status for downlink copies unavailable (%s): whole fragments first", err)
            return None
        return list(zip(st.versions, st.epochs)) if len(st.epochs) == len(st.versions) else None

    def admit(self, island: int, incarnation: int, held: list[tuple[int, int]] | None, epoch: int) -> None:
        """A registered incarnation starts from latest() (or kept what it had): whole fragments first, unless
        it holds a version of this `epoch` that is remembered, which it then gets differences from."""
        self.copies.forget(island)
        for p, (version, held_epoch) in enumerate(held or []):
            if held_epoch == epoch and version in self.decoded[p]:
                self.copies.seed(island, incarnation, p, version, self.decoded[p][version])

    def forget(self, island: int) -> None:
        """Whatever goes to `island` next goes whole (it left, or a send to it failed)."""
        self.copies.forget(island)
