"""The health monitor's line to the outer optimizer: calls with a timeout, parked state, and restart detection.

The outer optimizer restarts itself from its checkpoint (Ray restarts its actor); each incarnation of
it reports a new `epoch` in `health()`. A new epoch means its islands' connections and registrations
are gone: every live island must fetch the restored global model and register again. The monitor
parks what it knows here too (`keep_monitor_state`), so that its own restart loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import ray

from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.slots import SlotState
from policies.island_states import IslandState

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["OuterLink"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class OuterLink:
    """The outer optimizer's actor by name, and the epoch of it that the islands were last synced with."""

    def __init__(self, *, name: str, namespace: str, call_timeout_s: float) -> None:
        self.name, self.namespace, self.call_timeout_s = name, namespace, call_timeout_s
        self.epoch: int | None = None  # None until the first health round: nothing to resync yet

    def handle(self) -> ActorHandle[_OuterShell]:
        """The outer optimizer's actor handle (looked up each time: it may have restarted)."""
        return ray.get_actor(self.name, namespace=self.namespace)

    async def call(self, ref: Awaitable[T]) -> T:
        """Await a control call's answer, at most `call_timeout_s`."""
        return await asyncio.wait_for(ref, timeout=self.call_timeout_s)

    async def parked(self) -> dict | None:
        """The state a previous monitor of this run parked, or None."""
        return await self.call(call(self.handle(), _OuterShell.monitor_state))

    async def park(self, state: dict) -> None:
        """Park the monitor's state with the outer optimizer (it must survive the monitor's own restart)."""
        await self.call(call(self.handle(), _OuterShell.keep_monitor_state, state))

    async def resync_if_restarted(self, outer: ActorHandle[_OuterShell], epoch: int,
                                  live: list[tuple[SlotState, ActorHandle[_IslandShell]]]) -> dict[int, int]:
        """Resync and register every live island if the outer optimizer restarted since the last round.

        `live`: (slot, handle) of each live island. Returns island -> incarnation registered here (the caller's
        view of registrations predates it). The epoch is taken as synced only once every island is."""
        registered: dict[int, int] = {}
        if self.epoch is not None and epoch != self.epoch:
            log.warning("outer optimizer restarted (epoch %s -> %s): resyncing islands", self.epoch, epoch)
            # Each island fetches the restored model across its own link (counted, and on an EMULATED network
            # delayed, like a restarted island's fetch). Asked for all at once so the transfers overlap; each
            # ref resolves in its island's process (no tensors here).
            fetched = {slot.island: call(outer, _OuterShell.latest, slot.island) for slot, _ in live}
            for slot, handle in live:
                # Ray resolves a ref passed as an argument; `call`'s typing sees the ref, not the list it holds.
                await self.call(call(handle, _IslandShell.resync, fetched[slot.island]))  # type: ignore[call-overload]
                await self.call(call(outer, _OuterShell.register, slot.island, slot.incarnation, handle))
                registered[slot.island] = slot.incarnation
        self.epoch = epoch
        return registered

    async def check(self, handles: dict[int, ActorHandle[_IslandShell]], slots: dict[int, SlotState],
                    fail: Callable[[SlotState, str, str], Awaitable[None]]) -> None:
        """One health round with the outer optimizer: resync every island after its restart, `fail` the
        islands it found diverged or poisoned, and register again every live island it does not know.

        `handles`: the monitor's live island -> leader map, read again after the failures (they remove theirs)."""
        outer = self.handle()
        info = await self.call(call(outer, _OuterShell.health))
        registered = {int(k): v for k, v in info["islands"].items()}
        live = [(slots[island], handle) for island, handle in handles.items()]
        # `info` predates the resync: the reconcile below must not repeat it.
        registered.update(await self.resync_if_restarted(outer, info["epoch"], live))
        broken = [(island, inc, "sent a non-finite outer gradient") for island, inc in info["diverged"]]
        # Its own state is what is wrong (the guard judged it against the others): restarted as a diverged island
        # is, its progress not salvaged (orchestrator/actors/keepers.py).
        broken += [(island, inc, f"outer gradients refused as poisoned ({info['poison_restart_after']} in a row, or one "
                                 "far out of line)")
                   for island, inc in info.get("poisoned", [])]
        for island, inc, why in broken:
            slot = slots.get(island)
            if slot is not None and slot.incarnation == inc:
                await fail(slot, "diverged", why)
        for island, handle in list(handles.items()):  # reconcile after any outer restart
            slot = slots[island]
            if slot.state in (IslandState.TRAINING, IslandState.BLOCKED) and registered.get(island) != slot.incarnation:
                await self.call(call(outer, _OuterShell.register, island, slot.incarnation, handle))
