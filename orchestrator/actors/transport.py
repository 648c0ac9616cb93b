"""The outer-optimizer shell's links to the islands: uplink and downlink transfers (policies.network).

Island i's traffic uses its pool region's link. Bytes are counted per link and direction in every
scenario; over an EMULATED network a submission reaches the core only when its uplink transfer
completes, and a published fragment reaches an island only when its downlink transfer completes
(FIFO per link and direction, off the shell's poll loop: the islands keep computing).

Downlink: whole fragments with no emulated network go at once (fire and forget). Otherwise each
island has one sender task that always sends the newest waiting version of each fragment, whole or
as a difference from the island's copy (outer.downlink_delta, orchestrator/actors/published.py);
differences are awaited until the island confirms them, as it must adopt them in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError

from islands.messages import FragmentUpdate, Submission
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from policies.network import LinkSchedule, NetworkModel

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from orchestrator.actors.published import PublishedFragments

log = logging.getLogger(__name__)

# How long a downlink sender waits for an island to confirm a difference before the next goes whole.
_ADOPT_ACK_S = 30.0


@dataclasses.dataclass(frozen=True)
class ShellHooks:
    """What the transport asks of the shell that owns it."""

    run_on_core: Callable[..., Awaitable[Any]]  # run fn(*args) on the core's thread
    live: Callable[[int], tuple[int, ActorHandle[_IslandShell]] | None]  # island -> (incarnation, handle) while it is registered
    stopping: Callable[[], bool]  # the shell is stopping: nothing more goes down
    # A submission came off its emulated uplink (handle None: a salvage, whose island is gone).
    arrived: Callable[[int, Submission, ActorHandle[_IslandShell] | None], Awaitable[None]]


@dataclasses.dataclass
class NetworkWaits:
    """Delivery delay the emulated links added, in seconds, per direction (kept across restarts)."""

    up: float = 0.0
    down: float = 0.0


class IslandTransport:
    """Counts, and over an EMULATED network delays, every transfer between the shell and the islands."""

    def __init__(self, network: NetworkModel | None, island_regions: dict[int, str] | None,
                 published: PublishedFragments, hooks: ShellHooks, saved: dict | None = None) -> None:
        # No network = scenario none (count, never delay).
        self.network = network or NetworkModel("none", "local", {}, emulated=False)
        self.links = LinkSchedule(self.network)
        self._regions = {int(i): r for i, r in (island_regions or {}).items()}
        self._published = published
        self._hooks = hooks
        # Counting goes on across a restart from the newest checkpoint (what crossed a link after it is not counted).
        saved = saved or {}
        if "links" in saved:
            self.links.restore_counters(saved["links"])
        self.waits = NetworkWaits(**saved.get("network_wait_s", {}))
        self.in_transit: dict[Any, Submission] = {}  # submission key -> submission on its uplink
        self._transfers: set[asyncio.Task] = set()
        # island -> fragment -> (newest waiting update, its float32 tensors: what a difference is taken of)
        self._down_queue: dict[int, dict[int, tuple[FragmentUpdate, list | None]]] = {}
        self._down_senders: set[int] = set()  # islands whose downlink sender task is running

    def region(self, island: int) -> str:
        """The region whose link island `island`'s traffic uses (the hub's for an island of no pool)."""
        return self._regions.get(island, self.network.hub)

    def saved(self) -> dict:
        """What a checkpoint keeps of the links: byte and transfer counters, delivery delays."""
        return {"links": self.links.counters(), "network_wait_s": dataclasses.asdict(self.waits)}

    def status(self) -> dict:
        """Bytes and transfers per link and direction (refused and in flight included), delays, the network."""
        by_link = self.links.bytes_by_link()  # {region: {up, down}}
        return {
            "bytes_by_link": by_link,
            "bytes_down": sum(link["down"] for link in by_link.values()),  # every fragment sent
            "transfers_by_link": self.links.transfers_by_link(),
            "in_transit": len(self._transfers),  # emulated transfers not yet delivered, both directions
            "network_wait_s": dataclasses.asdict(self.waits),
            "network": self.network.describe(),
            "network_emulated": self.network.emulated,
        }

    # ------------------------------------------------------------ uplink

    def send_up(self, island: int, sub: Submission, handle: ActorHandle[_IslandShell] | None, sent_at: float) -> bool:
        """A submission on its island's uplink, counted. True: the caller hands it to the core now; False: it
        is on an EMULATED link and reaches `hooks.arrived` when its transfer from `sent_at` completes."""
        region = self.region(island)
        if self.network.emulated:
            done_at = self.links.reserve(region, "up", sub.nbytes, sent_at)
            self.in_transit[sub.key] = sub
            self._spawn(self._arrive(island, sub, handle, done_at))
            return False
        self.links.account(region, "up", sub.nbytes)
        return True

    async def _arrive(self, island: int, sub: Submission, handle: ActorHandle[_IslandShell] | None, done_at: float) -> None:
        """An uplink transfer: wait until it completes, then hand the submission on."""
        wait = done_at - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.in_transit.pop(sub.key, None) is None:
            return  # stop() already counted it as in flight
        self.waits.up += max(wait, 0.0)
        await self._hooks.arrived(island, sub, handle)

    def take_in_transit(self) -> list[Submission]:
        """At stop: the submissions still on an emulated uplink (they were taken: they count as in flight)."""
        late, self.in_transit = list(self.in_transit.values()), {}
        return late

    def cancel(self) -> None:
        """At stop: cancel every transfer still under way."""
        for task in list(self._transfers):
            task.cancel()

    # ------------------------------------------------------------ downlink

    async def down(self, region: str, nbytes: int) -> None:
        """`nbytes` on `region`'s downlink: counted, and over an EMULATED network awaited until they arrive
        (queued behind the link's earlier transfers; the wait counts as delivery delay)."""
        if not self.network.emulated:
            self.links.account(region, "down", nbytes)
            return
        wait = self.links.reserve(region, "down", nbytes, time.time()) - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self.waits.down += max(wait, 0.0)

    def send_down(self, island: int, handle: ActorHandle[_IslandShell], update: FragmentUpdate, tensors: list | None) -> None:
        """Send a fragment version to an island: now, or over its EMULATED downlink, whole or as a difference.

        `update.tensors` is the version's shared whole-fragment ref; `tensors` are its float32 values,
        from which a difference from the island's copy is taken (outer.downlink_delta; None without it).

        Whole fragments with no emulated network go at once (fire and forget). Otherwise each island has
        one sender that always sends the newest version of each fragment: a version published while an
        older one still waits replaces it (its merged/refused keys carried over), so a slow link delays
        adoption but never builds a backlog of versions nobody needs any more.
        """
        region = self.region(island)
        if not self.network.emulated and not self._published.delta:
            self.links.account(region, "down", self._published.nbytes[update.fragment])
            call(handle, _IslandShell.adopt, update)  # fire and forget: a dead island shows up in its poller
            return
        queue = self._down_queue.setdefault(island, {})
        waiting = queue.get(update.fragment)
        if waiting is not None:
            older, older_tensors = waiting
            if older.version > update.version:
                (older, older_tensors), (update, tensors) = (update, tensors), (older, older_tensors)
            update = dataclasses.replace(update, merged=older.merged + update.merged, refused=older.refused + update.refused)
        queue[update.fragment] = (update, tensors)  # a replaced entry keeps its place in the queue
        if island not in self._down_senders:
            self._down_senders.add(island)
            self._spawn(self._deliver(island, region))

    async def _deliver(self, island: int, region: str) -> None:
        """One island's downlink: the oldest waiting fragment first, one transfer at a time.

        With differences (outer.downlink_delta) each one is encoded just before it goes, from the copy
        the island holds after the previous one, and awaited: the island must adopt them in order. A
        send that fails, or whose island changed incarnation meanwhile, makes the next one whole.
        """
        delta, hooks = self._published.delta, self._hooks
        try:
            queue = self._down_queue.get(island, {})
            while queue and not hooks.stopping():
                fragment = next(iter(queue))
                update, tensors = queue.pop(fragment)
                live = hooks.live(island)
                if live is None:
                    continue
                if delta:
                    update, nbytes = await hooks.run_on_core(self._published.encode, island, live[0], update, tensors)
                else:
                    nbytes = self._published.nbytes[fragment]
                await self.down(region, nbytes)
                now_live = hooks.live(island)
                if now_live is None or now_live[0] != live[0] or hooks.stopping():
                    self._published.forget(island)  # never delivered: whatever goes next goes whole
                    continue
                ack = call(now_live[1], _IslandShell.adopt, update)
                if delta:
                    await self._confirmed(island, update, ack)
        finally:
            self._down_senders.discard(island)

    async def _confirmed(self, island: int, update: FragmentUpdate, ack: ObjectRef[None]) -> None:
        # Whole fragments need no order (fire and forget); a difference is awaited, and one the island did not
        # confirm makes its next fragments go whole.
        try:
            await asyncio.wait_for(ack, timeout=_ADOPT_ACK_S)  # an ObjectRef is awaitable
        except (asyncio.TimeoutError, RayActorError, RayTaskError) as err:
            log.warning("island %d did not confirm fragment %d v%d (%s); its next fragments go whole",
                        island, update.fragment, update.version, type(err).__name__)
            self._published.forget(island)

    # ------------------------------------------------------------ transfer tasks

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._transfers.add(task)  # keep a reference: the loop only holds tasks weakly
        task.add_done_callback(self._transfer_done)

    def _transfer_done(self, task: asyncio.Task) -> None:
        self._transfers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("emulated network transfer failed: %r", task.exception())
