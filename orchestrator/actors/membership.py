"""ElasticMembership: islands that join an elastic pool when it has room, and leave a node being drained.

The health monitor's collaborator for capacity that comes and goes (docs/elastic.md): an elastic pool's slots
wait in the background for room (`join_later`), the run waits only for every pool's minimum (`until_required`,
`waiting_for`), and an island on a drained node (drains.py) stops with a flush, has its cuts merged, and leaves its
slot vacant until the pool has room again (`check_drains`). What fails on the way fails through the monitor's own
failure path (`fail`: salvage, restart), and an island is placed by the monitor's `start`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from orchestrator.actors.drains import DrainWatch
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.launcher import IslandLauncher
from orchestrator.actors.monitor_settings import MonitorTimeouts
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.outer_link import OuterLink
from orchestrator.actors.placement import no_room
from orchestrator.actors.recovery_record import RecoveryRecord
from orchestrator.actors.slots import DOWN, SlotState
from policies.island_states import IslandState
from policies.restart import RestartBudget

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["DRAIN_MARGIN_S", "DRAIN_WITHOUT_DEADLINE_S", "WAIT_NOTICE_S", "ElasticMembership"]

log = logging.getLogger(__name__)

# A drained island stops DRAIN_MARGIN_S before its node's deadline at the latest; a drain without a deadline
# gives it DRAIN_WITHOUT_DEADLINE_S.
DRAIN_MARGIN_S, DRAIN_WITHOUT_DEADLINE_S = 2.0, 60.0
# A run below an elastic pool's minimum says what it waits for once the monitor has been up this long.
WAIT_NOTICE_S = 5.0


class ElasticMembership:
    """Joins and leaves of the monitor's slots. It shares the monitor's `slots`, `handles` (islands up) and
    `restarting` (slots being restarted), and calls back into it: `start(slot)` places an island, `teardown(slot)`
    removes one, `fail(slot, kind, reason, leaving=True)` is a failure, `stopping()` says the run stops."""

    def __init__(self, *, pools: dict[str, Any], slots: dict[int, SlotState],
                 handles: dict[int, ActorHandle[_IslandShell]],
                 restarting: dict[int, asyncio.Task], record: RecoveryRecord, launcher: IslandLauncher,
                 outer: OuterLink, budget: RestartBudget, timeouts: MonitorTimeouts,
                 start: Callable[[SlotState], Awaitable[None]], teardown: Callable[[SlotState], Awaitable[None]],
                 fail: Callable[..., Awaitable[None]], stopping: Callable[[], bool]) -> None:
        self.pools, self.slots, self.handles, self.restarting = pools, slots, handles, restarting
        self.record, self.launcher, self.outer, self.budget, self.timeouts = record, launcher, outer, budget, timeouts
        self._start, self._teardown, self._fail, self._stopping = start, teardown, fail, stopping
        self.joining: dict[int, asyncio.Task] = {}  # elastic slots waiting for room in their pool
        self.leaving: dict[int, asyncio.Task] = {}  # islands leaving with their drained node
        self.drains = DrainWatch(timeouts.tick_s)
        self._began = time.monotonic()

    # ------------------------------------------------------------------ joins

    def join_later(self, slot: SlotState) -> None:
        """Start `slot` in the background once its pool has room (`_join`)."""
        self.joining[slot.island] = asyncio.get_running_loop().create_task(self._join(slot))

    def waiting_for(self) -> list[str]:
        """What the run waits for before it can start, one line per elastic pool below its minimum (empty when
        none is): how many of its islands are placed, and the room it lacks."""
        lines = []
        for name, pool in self.pools.items():
            if not pool.elastic:
                continue
            placed = sum(1 for s in self.slots.values() if s.pool == name and s.island in self.handles)
            if placed < pool.required_islands:
                lines.append(f"{no_room(pool, 0).split(' within ')[0]}: {placed} of min {pool.required_islands} "
                             f"islands placed; add nodes with labels {pool.labels or '{}'} (ray start --labels ...)")
        return lines

    def waiting_notice(self) -> list[str]:
        """`waiting_for`, once the monitor has been up WAIT_NOTICE_S (placing and starting an island takes seconds
        even where a node has room: saying "no node could host" before that would be wrong)."""
        return self.waiting_for() if time.monotonic() - self._began >= WAIT_NOTICE_S else []

    async def until_required(self) -> None:
        """Return once every elastic pool has its minimum of islands up, logging what it waits for meanwhile (in
        this actor's log; the driver says it to the user from the snapshot's "waiting")."""
        said = 0.0
        while not self._stopping():
            lines = self.waiting_for()
            if not lines:
                return
            if time.monotonic() - said >= 30.0:
                for line in lines:
                    log.info("waiting for %s", line)
                said = time.monotonic()
            await asyncio.sleep(self.timeouts.tick_s)

    async def _join(self, slot: SlotState) -> None:
        """An elastic slot: wait for room in its pool, then start an island there (a join when it had been vacant).
        Retried with backoff if the start fails, like a restart, until it succeeds or the run stops."""
        while not self._stopping():
            vacant_before = slot.state == IslandState.VACANT
            try:
                await self._start(slot)
            except Exception as err:  # noqa: BLE001 - e.g. the new actor died while starting
                log.error("island %d incarnation %d failed to join: %s", slot.island, slot.incarnation, err)
                await self._teardown(slot)
                await asyncio.sleep(max(self.budget.on_failure(slot.island, time.monotonic()).at - time.monotonic(), 0.5))
                continue
            if slot.island in self.handles and (vacant_before or slot.joined_vacant):
                slot.joins += 1
                self.record.joins.append({"island": slot.island, "incarnation": slot.incarnation, "node": slot.node,
                                          "at": time.time()})
                log.warning("island %d incarnation %d joined on node %s", slot.island, slot.incarnation, slot.node)
            break
        self.joining.pop(slot.island, None)

    # ------------------------------------------------------------------ leaves

    async def check_drains(self) -> None:
        """Islands on a node being drained (a preemption notice, the autoscaler taking it back) leave before its
        deadline, their progress merged (`_leave`)."""
        draining = await self.drains.poll()
        for slot in self.slots.values():
            if (slot.node in draining and slot.island in self.handles and slot.island not in self.leaving
                    and slot.island not in self.restarting and slot.state not in DOWN):
                self.leaving[slot.island] = asyncio.get_running_loop().create_task(
                    self._leave(slot, slot.node, draining[slot.node]))

    async def _leave(self, slot: SlotState, node: str, deadline: float | None) -> None:
        """Island `slot` leaves its drained node: it stops with a flush (every fragment's progress cut), the outer
        optimizer takes and merges the cuts (`OuterOptimizer.leave`), and the slot turns vacant until its pool has
        room again (another node, or this one if its drain is cancelled). If the island dies first, or the
        leave cannot finish before the deadline, it fails as today (salvage, restart)."""
        island, inc, handle = slot.island, slot.incarnation, self.handles[slot.island]
        left_s = (deadline - time.time()) if deadline else DRAIN_WITHOUT_DEADLINE_S
        log.warning("island %d incarnation %d leaves node %s, which is being drained (%s)", island, inc, node,
                    f"{left_s:.0f} s to its deadline" if deadline else "no deadline")
        self.record.mark(slot, IslandState.LEAVING)
        try:
            budget = max(left_s - DRAIN_MARGIN_S, 1.0)
            t0 = time.monotonic()
            await asyncio.wait_for(call(handle, _IslandShell.stop, timeout_s=budget, flush=True), timeout=budget)
            rest = max(budget - (time.monotonic() - t0), 1.0)
            outer = self.outer.handle()
            took = await asyncio.wait_for(call(outer, _OuterShell.leave, island, inc, rest), timeout=rest + self.timeouts.call_s)
            final = await asyncio.wait_for(call(handle, _IslandShell.status), timeout=self.timeouts.call_s)
        except Exception as err:  # noqa: BLE001 - gone before it could leave: today's failure path
            self.leaving.pop(island, None)
            if slot.incarnation == inc:
                await self._fail(slot, "dead", f"drained node went before the island left: {err}"[:200], leaving=True)
            return
        slot.finals.append(final)
        slot.status, slot.leaves = None, slot.leaves + 1
        self.launcher.kill(island, self.handles.pop(island, None))
        self.launcher.release(island)
        self.record.leaves.append({"island": island, "incarnation": inc, "node": node, "at": time.time(),
                                   "deadline": deadline, "merged": took["merged"], "waited_s": took["waited_s"],
                                   # every token it processed reached the outer optimizer when the two agree
                                   "tokens": final.tokens, "received": took["received"]})
        self.record.mark(slot, IslandState.VACANT)
        log.warning("island %d incarnation %d left node %s after %.1f s (its progress %s; %d of %d tokens received)",
                    island, inc, node, took["waited_s"], "merged" if took["merged"] else "not all merged in time",
                    took["received"], final.tokens)
        self.leaving.pop(island, None)
        if not self._stopping():
            self.join_later(slot)
