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
import time
from typing import TYPE_CHECKING, Any

import ray

from islands.messages import FragmentUpdate
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from policies.downlink import DownlinkCopies, decode_fragment

if TYPE_CHECKING:
    import torch
    from ray.actor import ActorHandle

    from orchestrator.core.outer_optimizer import OuterSettings

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A version as `PublishedFragments.put` left it: its ref, and with differences down its float32 copy and
    the whole version as islands decode it (None otherwise)."""

    ref: Any
    copy: list | None
    decoded: list | None
    seconds: float  # spent encoding and putting it (part of the round's publish time, t_sync)
# Published versions per fragment kept decoded for registering islands (differences down only): a restarted
# island registers a second or two after it fetched latest(), while K = 1 rounds go on.
_REMEMBERED_VERSIONS = 4


class PublishedFragments:
    """Per fragment: the latest published version's ref, its number and wire size; per island: the copy it holds."""

    def __init__(self, settings: OuterSettings, fragments: list[list[torch.Tensor]], versions: list[int]) -> None:
        # What each island holds of each fragment, when versions go down as differences (outer.downlink_delta);
        # its `whole` is the format of every whole fragment that goes down.
        self.copies = DownlinkCopies(settings.downlink, settings.downlink_delta, block_size=settings.compression_block_size,
                                     density=settings.topk_density)
        wire = [self.copies.whole(frag) for frag in fragments]
        # The latest published version of every fragment, in its wire format: one ray.put each, handed out as [ref].
        self.refs = [ray.put(w) for w in wire]
        # The version each ref holds, changed with it (on the shell's loop): a label read from the core may be a
        # version whose ref is not published yet, and an island would then hold one version under another's number.
        self.versions = list(versions)
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

    def put(self, tensors: list[torch.Tensor]) -> Prepared:
        """A new version encoded whole and put in the object store, on the core's thread while `tensors` (the
        core's live global tensors) cannot change. ray.put copies them into the store: that copy is the only one
        made of a version unless differences go down, which need a private float32 copy to be taken from, later,
        and the decoded whole version for islands that register holding it."""
        t0 = time.perf_counter()
        copy = [t.clone() for t in tensors] if self.delta else None
        whole = self.copies.whole(copy if copy is not None else tensors)
        ref = ray.put(whole)
        return Prepared(ref, copy, decode_fragment(whole) if self.delta else None, time.perf_counter() - t0)

    def publish(self, fragment: int, version: int, prepared: Prepared) -> Any:
        """Make `version` of `fragment`, as `put` prepared it, the latest (on the shell's loop). Returns its ref."""
        if prepared.decoded is not None:
            recent = self.decoded[fragment]
            recent[version] = prepared.decoded
            while len(recent) > _REMEMBERED_VERSIONS:
                recent.popitem(last=False)
        self.refs[fragment] = prepared.ref  # dropping the old ref lets the store free it
        self.versions[fragment] = version
        return prepared.ref

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

    async def held(self, handle: ActorHandle[_IslandShell]) -> list[tuple[int, int]] | None:
        """(version, epoch) of every fragment an island holds, when differences go down (None: not asked, or no
        answer within 10 s; it then gets whole fragments first)."""
        if not self.delta:
            return None
        try:
            st = await asyncio.wait_for(call(handle, _IslandShell.status), timeout=10.0)  # an ObjectRef is awaitable
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
