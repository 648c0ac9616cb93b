"""HealthMonitor: keeps every island slot alive. Detects, kills, rebuilds whole, reintegrates.

Liveness of an island comes from two sources: an outstanding `watch` call (fails at once when the
process dies) and periodic `status` heartbeats judged by policies.health (hangs are measured against
the island's own step time, so a slow pool is not a dead pool). A broken island is killed, its
placement group removed, and after a backoff (policies.restart) a new incarnation is placed in the
same pool, started from the outer optimizer's current versions and its last merged data position.

Islands are detached and named `<run_id>-island<i>-inc<n>`, so a restarted monitor re-adopts them by
name instead of taking them down (actors die with their creator otherwise). The monitor starts its
loop lazily on the first call, which also covers a restart by Ray.

An island of several workers (pool `workers_per_island` > 1) is the leader above (rank 0, bundle 0)
plus followers `<leader name>-w<r>` on bundles 1..W-1 of the same placement group. It is one failure
domain: a dead follower fails the leader's next collective, and any failure kills leader and
followers and removes the group before the island is rebuilt whole. Such pools get no warm spares
(a spare would have to be a whole pre-joined worker group; they restart cold).

The monitor is the coordinator (watch, fail, restart, reintegrate); each collaborator owns one concern,
all in orchestrator/actors/: `IslandLauncher` places, starts and kills island processes, taking a
warm spare (`WarmSpares`, spares.py) before a cold start (launcher.py); `ProgressKeepers` runs the
pools' keepers and salvage (keepers.py); `OuterLink` talks to the outer optimizer and notices its
restarts (outer_link.py); `ElasticMembership` starts elastic pools' islands as room appears and has islands
leave drained nodes (membership.py); `RecoveryRecord` keeps the timeline and detect/rejoin times, and what the
monitor parks to survive its own restart (recovery_record.py). Settings are typed (monitor_settings.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from islands.spec import IslandSpec
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.keepers import ProgressKeepers
from orchestrator.actors.launcher import IslandLauncher, find_run_actors, island_statuses, stop_islands
from orchestrator.actors.membership import ElasticMembership
from orchestrator.actors.monitor_settings import ActorClasses, HealthThresholds, MonitorPools, MonitorTimeouts, RunAddress
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.outer_link import OuterLink
from orchestrator.actors.recovery_record import RecoveryRecord, monitor_snapshot, parked_state, restore_parked
from orchestrator.actors.runtime import quiet_worker
from orchestrator.actors.slots import DOWN, SlotState, has_submitted, islands_stepped
from policies.health import assess_island
from policies.island_states import ENDED_BADLY, IslandState
from policies.restart import RestartBudget

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["HealthMonitor"]

log = logging.getLogger(__name__)

def observed_state(reported: str, *, stepped: bool, was: str) -> str:
    """A slot's timeline state from its island's answer: blocked as it says, training once it has stepped, else
    what the slot was (starting or reintegrating until the first step)."""
    if reported == IslandState.BLOCKED:
        return IslandState.BLOCKED
    return IslandState.TRAINING if stepped else was



class HealthMonitor:
    """Plain class driven by an asyncio loop; `ray.remote` is applied in orchestrator/actors/remote.py.

    Args:
        run: the run's id, Ray namespace and outer optimizer's actor name.
        pools: the run's pools and the warm spares kept per pool.
        specs: one spec per island slot (`incarnation` = the first one to start).
        actors: the actor classes it creates.
        timeouts: placement, control-call and tick periods.
        health: thresholds for policies.health.assess_island.
        restart: the restart policy (backoff, limit).
        data: [ref to the training corpus]; usually passed to `ensure_started` instead.

    The driver builds pools, timeouts, health and restart from the config (orchestrator/settings.py).
    """

    def __init__(self, *, run: RunAddress, pools: MonitorPools, specs: list[IslandSpec], actors: ActorClasses,
                 timeouts: MonitorTimeouts, health: HealthThresholds, restart: RestartBudget,
                 data: list[Any] | None = None) -> None:
        quiet_worker("health monitor")
        self.run, self.timeouts, self.data = run, timeouts, data
        self.pools = {p.name: p for p in pools.pools}
        self.specs = {s.island: s for s in specs}
        self.health, self.budget = health.as_kwargs(), restart
        def stopping() -> bool:  # the collaborators' view of this run stopping
            return self._stopping

        self.launcher = IslandLauncher(run=run, pools=self.pools, slot_pools={s.island: s.pool for s in specs},
                                       actors=actors, timeouts=timeouts, warm_spares=pools.warm_spares,
                                       stopping=stopping)
        self.outer = OuterLink(name=run.outer_name, namespace=run.namespace, call_timeout_s=timeouts.call_s)
        self.keepers = ProgressKeepers(
            names={s.pool: s.keeper for s in specs if s.keeper is not None}, keeper_cls=actors.keeper,
            pools=self.pools, outer=self.outer, island_groups=self.launcher.island_groups, stopping=stopping,
            placement_timeout_s=timeouts.placement_s, call_timeout_s=timeouts.call_s)
        self.record = RecoveryRecord()
        # A slot's next start uses incarnation + 1: a resumed run continues above the previous driver's.
        self.slots = {s.island: SlotState(s.island, s.pool, incarnation=s.incarnation - 1) for s in specs}
        self.handles: dict[int, ActorHandle[_IslandShell]] = {}  # island -> leader of its live incarnation
        self.watchers: dict[int, asyncio.Task] = {}
        self.restarting: dict[int, asyncio.Task] = {}
        self.membership = ElasticMembership(
            pools=self.pools, slots=self.slots, handles=self.handles, restarting=self.restarting, record=self.record,
            launcher=self.launcher, outer=self.outer, budget=restart, timeouts=timeouts, start=self._start,
            teardown=self._teardown, fail=self._fail, stopping=stopping)
        self._failing: set[int] = set()  # slots inside _fail(), before their restart task exists
        self._loop_task: asyncio.Task | None = None
        self._after_steps_task: asyncio.Task | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    async def ensure_started(self, fresh: bool = False, data: list[Any] | None = None) -> None:
        """Start (or, after a restart of this monitor, re-adopt) every island and the monitoring loop.

        `fresh`: the driver's first call on a new run. Nothing of the run exists yet, so there is no
        parked state to restore and no island to re-adopt, and the islands start without waiting for
        the outer optimizer's process to come up (they fetch its versions themselves).
        `data`: [ref to the training corpus] the islands are built with. The driver passes it with
        every call rather than to the constructor: Ray cannot promise an actor restart the object-store
        arguments of its constructor (ray-project/ray#53727), and every restart of this monitor is
        followed by the driver's next call here."""
        if data is not None:
            self.data = data
        if self._loop_task is not None:
            return
        if self.data is None:
            raise ValueError("the health monitor has no training data yet; pass data=[ref] to ensure_started")
        self._loop_task = asyncio.get_running_loop().create_task(self._monitor())
        saved = None if fresh else await self.outer.parked()
        if saved:
            restore_parked(saved, self.slots, self.record, self.keepers)
            log.warning("health monitor restored its state (%d timeline events)", len(self.record.timeline))
        adopted = set() if fresh else await self._adopt_existing()
        if saved:
            self.record.mark_lost_in_restart(self.slots.values(), adopted)
        todo = [slot for slot in self.slots.values() if slot.island not in adopted]
        # An elastic pool's slots wait for room in the background; the run needs only its minimum placed.
        for slot in todo:
            if self.pools[slot.pool].elastic:
                self.membership.join_later(slot)
        starts = [self._start(slot) for slot in todo if not self.pools[slot.pool].elastic]
        if fresh:
            await asyncio.gather(*starts, self.membership.until_required())
        else:  # keepers a previous monitor started are taken back at once: salvage needs them from the start
            await asyncio.gather(*starts, self.keepers.start(self.launcher.placed))
        self._after_steps_task = asyncio.get_running_loop().create_task(self._start_when_islands_step(fresh))

    async def _start_when_islands_step(self, keepers: bool) -> None:
        """Once every island has stepped (slots.islands_stepped): the pools' keepers when `keepers`, then
        the warm spares. Keepers start after their islands are placed, so that they can be placed away from
        them; islands look their keeper up by name at each snapshot and skip snapshots until it exists, so
        a failure in the first steps of a fresh run salvages nothing (it had little to salvage)."""
        await islands_stepped(self.slots.values(), wait_s=self.timeouts.placement_s, tick_s=self.timeouts.tick_s,
                              stopping=lambda: self._stopping)
        if keepers:
            await self.keepers.start(self.launcher.placed)
        if not self._stopping:
            self.launcher.spares.refill_all(self.data)

    async def _adopt_existing(self) -> set[int]:
        """Take back the islands, followers and spares a previous monitor of this run left; returns the slots."""
        found = await find_run_actors(run_id=self.run.run_id, namespace=self.run.namespace, slots=set(self.slots),
                                      call_timeout_s=self.timeouts.call_s)
        self.launcher.take_back(found)
        for island, (inc, name, handle) in found.islands.items():
            slot = self.slots[island]
            self.handles[island] = handle
            slot.adopt(inc, name, time.monotonic())
            self.record.mark(slot, IslandState.TRAINING)
            self.watchers[island] = asyncio.get_running_loop().create_task(self._watch(slot, inc))
            log.warning("re-adopted island %d incarnation %d (%s) after a monitor restart", island, inc, name)
        return set(found.islands)

    async def _start(self, slot: SlotState, *, cursor: int | None = None) -> None:
        """Place a new incarnation of `slot` in its pool and reintegrate it from the global state.

        A warm spare of the pool is activated when there is one; otherwise a new process is placed
        (waiting for pool capacity without blocking the other islands): IslandLauncher.place.
        The slot's first start is "starting" until its first step; a start after a failure is
        "restarting" until placed, then "reintegrating" until its first step.
        """
        # A resumed run's new driver session starts its slots afresh too; an island filling a slot another left
        # reintegrates like a restart.
        first = slot.failures == 0 and slot.leaves == 0
        slot.incarnation += 1
        slot.joined_vacant = False
        if slot.state != IslandState.VACANT:
            self.record.mark(slot, IslandState.STARTING if first else IslandState.RESTARTING)
        outer = self.outer.handle()
        spec = dataclasses.replace(self.specs[slot.island], incarnation=slot.incarnation)

        def vacant(since: float) -> None:  # an elastic pool had no room at once: capacity the run does not have
            slot.joined_vacant = True
            self.record.mark(slot, IslandState.VACANT, at=since)

        placed = await self.launcher.place(slot, spec, outer, cursor, self.data, on_wait=vacant)
        if placed is None:
            return  # the run stopped while the island waited for capacity
        handle, cursor = placed
        if not first:  # a first start stays "starting" until its first step
            self.record.mark(slot, IslandState.REINTEGRATING)
        elif slot.state == IslandState.VACANT:
            self.record.mark(slot, IslandState.STARTING)
        try:
            if self.pools[slot.pool].workers_per_island > 1:
                await self.launcher.start_followers(slot, spec, handle, self.data)
            slot.node = await asyncio.wait_for(call(handle, _IslandShell.node_id), timeout=self.timeouts.placement_s)
            await self.outer.call(call(outer, _OuterShell.register, slot.island, slot.incarnation, handle))
        except BaseException:
            ray.kill(handle, no_restart=True)  # never leave a half-started detached island behind
            self.launcher.kill_followers(slot.island)
            raise
        # Health checks see the island only from here on: construction time is not a hang.
        slot.steps, slot.status = 0, None
        slot.last_progress_at = slot.last_status_at = time.monotonic()
        self.handles[slot.island] = handle
        self.watchers[slot.island] = asyncio.get_running_loop().create_task(self._watch(slot, slot.incarnation))
        log.info("island %d incarnation %d up on node %s (cursor %s)", slot.island, slot.incarnation, slot.node,
                 "asked of the outer optimizer" if cursor is None else cursor)

    async def _watch(self, slot: SlotState, incarnation: int) -> None:
        # One outstanding call per island: an error here is the fastest death signal there is.
        handle = self.handles[slot.island]
        while not self._stopping and slot.incarnation == incarnation:
            try:
                state = await call(handle, _IslandShell.watch, 5.0)
            except (RayActorError, RayTaskError) as err:
                if not self._stopping and slot.incarnation == incarnation:
                    await self._fail(slot, "dead", str(err).strip().splitlines()[-1][:200])
                return
            if state in ENDED_BADLY and slot.incarnation == incarnation:
                await self._fail(slot, state, f"inner loop {state}")
                return

    async def _fail(self, slot: SlotState, kind: str, reason: str, *, leaving: bool = False) -> None:
        if slot.island in self.restarting or slot.island in self._failing or slot.state in DOWN:
            return
        if slot.island in self.membership.leaving and not leaving:
            return  # the leave in progress decides: merged and gone, or a failure after all
        # One failure at a time per slot, until its restart task is registered (the teardown below awaits).
        self._failing.add(slot.island)
        try:
            await self._fail_once(slot, kind, reason)
        finally:
            self._failing.discard(slot.island)

    async def _fail_once(self, slot: SlotState, kind: str, reason: str) -> None:
        died_at, recovery_delay_s = self.record.detect(slot, kind, reason)
        slot.failures += 1
        # One line per failure, an injected one included (the injector and the outer optimizer keep theirs quiet).
        fault = self.record.faults.get((slot.island, slot.incarnation))
        cause = f" (injected: {fault['kind']})" if fault else ""
        log.warning("island %d incarnation %d %s%s: %s", slot.island, slot.incarnation, kind, cause, reason)
        self.record.mark(slot, IslandState.DEAD, at=died_at)
        if slot.status is not None:
            slot.finals.append(slot.status)
            slot.status = None
        await self._teardown(slot)
        await self.keepers.salvage(slot.island, slot.pool, slot.incarnation, kind)  # before the restart asks where to resume
        decision = self.budget.on_failure(slot.island, time.monotonic())
        if not decision.restart:
            log.error("island %d will not be restarted: %s", slot.island, decision.reason)
            return
        delay = max(decision.at - time.monotonic(), recovery_delay_s)
        self.restarting[slot.island] = asyncio.get_running_loop().create_task(self._restart(slot, delay, died_at))

    async def _teardown(self, slot: SlotState) -> None:
        # Rebuild whole: kill the actors (leader and followers), then remove the group (never the reverse).
        self.launcher.kill(slot.island, self.handles.pop(slot.island, None))
        try:
            await self.outer.call(call(self.outer.handle(), _OuterShell.unregister, slot.island))
        except Exception as err:  # noqa: BLE001 - the outer optimizer may itself be restarting
            log.warning("unregister island %d: %s", slot.island, err)
        self.launcher.release(slot.island)

    async def _restart(self, slot: SlotState, delay: float, died_at: float) -> None:
        # Retried with backoff until it succeeds or the run stops; each try rebuilds the island whole.
        while not self._stopping:
            await asyncio.sleep(delay)
            if self._stopping:
                break
            try:
                await self._start(slot)
            except Exception as err:  # noqa: BLE001 - e.g. the new actor died while starting
                log.error("restart of island %d incarnation %d failed: %s", slot.island, slot.incarnation, err)
                await self._teardown(slot)
                self.record.mark(slot, IslandState.RESTARTING)
                delay = self.budget.on_failure(slot.island, time.monotonic()).at - time.monotonic()
                continue
            slot.restarts += 1
            self.record.rejoined(died_at)
            try:  # park the count now, not at the next tick: a monitor restart in between would lose it
                await self.outer.park(parked_state(self.slots, self.record, self.keepers))
            except Exception as err:  # noqa: BLE001 - the periodic park retries
                log.warning("could not park the monitor state: %s", err)
            break
        self.restarting.pop(slot.island, None)

    # ------------------------------------------------------------------ monitoring

    async def _monitor(self) -> None:
        last_saved = 0.0
        while not self._stopping:
            await asyncio.sleep(self.timeouts.tick_s)
            try:
                await self.membership.check_drains()
                await self._check_outer()
                await asyncio.gather(*(self._check(slot) for slot in self.slots.values()))
                self.keepers.check_when_due()
                if time.monotonic() - last_saved >= 1.0:
                    # What the monitor knows must survive its own restart: park it with the outer optimizer.
                    await self.outer.park(parked_state(self.slots, self.record, self.keepers))
                    last_saved = time.monotonic()
            except Exception as err:  # noqa: BLE001 - the monitor itself must keep going
                log.warning("health check round failed: %s", err)

    async def _check_outer(self) -> None:
        """One round with the outer optimizer (OuterLink.check): resyncs, diverged islands, registrations."""
        await self.outer.check(self.handles, self.slots, self._fail)

    def _moved_on(self, slot: SlotState, incarnation: int) -> bool:
        """Whether `slot` failed or moved past `incarnation` since a check of it began.

        A check awaits the island's answer; meanwhile the watcher may have declared the same
        incarnation failed. Acting on the stale answer (marking the slot "training" again, then
        failing it a second time) started two restarts of one slot that raced each other (seen
        under load: clobbered names, an untracked incarnation left submitting)."""
        return (slot.incarnation != incarnation or slot.island in self.restarting
                or slot.island in self._failing or slot.state in (IslandState.DEAD, IslandState.RESTARTING, IslandState.STOPPED))

    async def _check(self, slot: SlotState) -> None:
        handle = self.handles.get(slot.island)
        if (handle is None or slot.island in self.restarting or slot.island in self.membership.leaving
                or slot.state in (*DOWN, IslandState.STOPPED, IslandState.LEAVING)):
            return
        now = time.monotonic()
        ok = True
        incarnation = slot.incarnation
        try:
            st = await asyncio.wait_for(call(handle, _IslandShell.status), timeout=min(2.0, self.timeouts.call_s))
            if self._moved_on(slot, incarnation):
                return  # the slot failed (or moved on) while we waited: this answer is about the past
            if slot.observe(st, now) and slot.state in (IslandState.STARTING, IslandState.REINTEGRATING):
                self.budget.on_healthy(slot.island, now, submitted=has_submitted(st))
            self.record.mark(slot, observed_state(st.state, stepped=st.steps > 0, was=slot.state))
        except RayTaskError as err:  # the call ran and raised: a bug, not a slow island; say what it is
            log.error("island %d status() raised: %s", slot.island, str(err).strip().splitlines()[-1][:300])
            ok, st = False, slot.status
        except (asyncio.TimeoutError, RayActorError):
            ok, st = False, slot.status
        if self._moved_on(slot, incarnation):
            return
        verdict = assess_island(
            now=now, state=st.state if st else IslandState.STARTING, steps=slot.steps, last_progress_at=slot.last_progress_at,
            step_time_s=st.step_time_s if st else None, status_ok=ok, last_status_at=slot.last_status_at, **self.health,
        )
        if verdict.healthy:
            self.budget.on_healthy(slot.island, now, submitted=has_submitted(st))
        else:
            await self._fail(slot, verdict.kind, verdict.reason)

    # ------------------------------------------------------------------ interface

    def note_fault(self, island: int, incarnation: int, kind: str, at: float, recovery_delay_s: float = 0.0) -> None:
        """The chaos injector reports a fault it caused (for time-to-detect and the recovery delay)."""
        self.record.note_fault(island, incarnation, kind, at, recovery_delay_s)

    def current(self, island: int) -> tuple[int, str | None, str | None]:
        """(incarnation, actor name, node id) of the live incarnation of a slot."""
        slot = self.slots[island]
        return slot.incarnation, slot.name if island in self.handles else None, slot.node

    def live_islands(self) -> list[int]:
        """The slots with a live incarnation (those `current` names an actor for), in slot order."""
        return sorted(self.handles)

    def snapshot(self) -> dict:
        """Slots, their latest statuses, the timeline so far, detect and rejoin times."""
        return monitor_snapshot(self.slots, self.record, self.keepers, spares=self.launcher.spares.counts(),
                                waiting=self.membership.waiting_notice())

    async def stop(self, flush: bool = False) -> dict:
        """Stop monitoring and every island; returns the final snapshot.

        Outboxes freeze, unless `flush`: then each island cuts its remaining progress into submissions
        the outer optimizer still takes (see `LearnerIsland.stop`)."""
        self._stopping = True
        for task in [*self.restarting.values(), *self.membership.joining.values()]:
            task.cancel()
        for task in list(self.membership.leaving.values()):  # a leave under way finishes: its flush is what stop would do
            await asyncio.wait([task], timeout=self.timeouts.call_s)
        for island, st in (await stop_islands(self.handles, flush=flush, timeout_s=self.timeouts.call_s)).items():
            self.slots[island].status = st
            self.record.mark(self.slots[island], IslandState.STOPPED)
        return self.snapshot()

    async def refresh_statuses(self) -> dict:
        """Ask every stopped island for its status again (after the final flush drained its outbox, so
        that token accounting sees what the outer optimizer took); returns the snapshot."""
        for island, st in (await island_statuses(self.handles, timeout_s=self.timeouts.call_s)).items():
            self.slots[island].status = st
        return self.snapshot()

    async def teardown(self) -> None:
        """Kill every island and warm spare of this run and remove their placement groups."""
        self._stopping = True
        for slot in self.slots.values():
            await self._teardown(slot)
        self.launcher.spares.teardown()
        self.keepers.teardown()
