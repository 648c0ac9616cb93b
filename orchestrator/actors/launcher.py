"""Island processes of a run: placed, started, found again and killed. The health monitor decides when.

An island incarnation is one placement group named after it, holding its leader (rank 0, bundle 0)
and, in a pool of `workers_per_island` > 1, followers `<leader name>-w<r>` on bundles 1..W-1. All are
detached and named `<run_id>-...`, so that a restarted monitor finds them again by name
(`find_run_actors`) instead of losing them with their creator. A new incarnation takes a warm spare
of its pool when there is one (orchestrator/actors/spares.py): an island process started with no
slot, in a group of its own.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_placement_group

from islands.spec import IslandSpec
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell, _IslandWorker
from orchestrator.actors.monitor_settings import ActorClasses, MonitorTimeouts, RunAddress
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.placement import (
    create_island_group,
    island_scheduling,
    release_group,
    remove_run_groups,
    request_island_group,
)
from orchestrator.actors.runtime import DATA_PLANE_RUNTIME_ENV
from orchestrator.actors.slots import SlotState, island_name
from orchestrator.actors.spares import WarmSpares
from orchestrator.config import PoolConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from islands.cursor import DataCursor

__all__ = ["IslandLauncher", "RunActors", "find_run_actors", "island_statuses", "stop_islands"]

log = logging.getLogger(__name__)

# An elastic slot's group placed within ROOM_NOW_S had room at once; past it the slot is vacant until a node has
# room. Its readiness is polled every ROOM_POLL_S (a local check of an object's readiness, not a GCS call).
ROOM_NOW_S, ROOM_POLL_S = 1.0, 0.25


class IslandLauncher:
    """Creates and kills the Ray processes of island incarnations; keeps each island's group and followers.

    Attributes:
        groups: island -> placement group of its current incarnation.
        followers: island -> handles of its current incarnation's ranks 1..W-1.
        spares: the pools' warm spares, which `place` uses before starting a process cold.
    """

    def __init__(self, *, run: RunAddress, pools: dict[str, PoolConfig], slot_pools: dict[int, str],
                 actors: ActorClasses, timeouts: MonitorTimeouts, warm_spares: int,
                 stopping: Callable[[], bool]) -> None:
        multi = [name for name, p in pools.items() if p.workers_per_island > 1]
        if multi and actors.worker is None:
            raise ValueError(f"pools {multi} have workers_per_island > 1 but no worker_cls was given; pass "
                             "orchestrator.actors.remote.IslandWorkerActor")
        self.run, self.pools, self.slot_pools, self.actors = run, pools, slot_pools, actors
        self.placement_timeout_s, self.call_timeout_s = timeouts.placement_s, timeouts.call_s
        self._stopping = stopping
        # The job's runtime env, given back to every island process: the monitor may run with its own
        # (CONTROL_PLANE_RUNTIME_ENV, zero-copy tensors off) and actors inherit their creator's.
        env = actors.island_runtime_env
        self.island_env = dict(env) if env is not None else DATA_PLANE_RUNTIME_ENV
        self.groups: dict[int, Any] = {}
        self.pending: dict[int, Any] = {}  # island -> its elastic slot's group, requested and not placed yet
        self.followers: dict[int, list[ActorHandle[_IslandWorker]]] = {}
        self.spares = WarmSpares(run_id=run.run_id, pools=pools, count=warm_spares, start_spare=self._start_spare,
                                 placement_timeout_s=timeouts.placement_s, call_timeout_s=timeouts.call_s,
                                 stopping=stopping)

    def placed(self, pool: str) -> bool:
        """Whether every island slot of `pool` holds a placement group, or waits for room in an elastic pool (its
        keeper may be placed now, away from them)."""
        return all(island in self.groups or island in self.pending for island, p in self.slot_pools.items() if p == pool)

    def island_groups(self, pool: str) -> list[Any]:
        """The placement groups of `pool`'s islands and warm spares (where its keeper should not go)."""
        return [g for i, g in self.groups.items() if self.slot_pools[i] == pool] + self.spares.groups(pool)

    def adopt(self, island: int, name: str, followers: list[ActorHandle[_IslandWorker]]) -> None:
        """Take over the group and followers of an incarnation named `name` that a previous monitor started."""
        self.groups[island] = get_placement_group(name)
        self.followers[island] = followers

    def take_back(self, found: RunActors) -> None:
        """After a monitor restart, what `found` (find_run_actors) holds: the warm spares, and each leader's group
        and followers; followers whose leader is gone are killed (their island is rebuilt whole)."""
        for name, handle in found.spares:
            self.spares.adopt(name, handle)
        for island, (_, name, _) in found.islands.items():
            self.adopt(island, name, found.followers.pop(name, []))
        for name, orphans in found.followers.items():
            log.warning("killing %d followers of %s, whose leader is gone", len(orphans), name)
            for handle in orphans:
                ray.kill(handle, no_restart=True)
        # The groups the previous monitor reserved for restarts it did not finish hold the pool's capacity with no
        # island in them, and their names are the ones this monitor's restarts of those slots ask for: found by a
        # soak, whose every island restart failed for its last 12 minutes after a monitor kill ("no node could host",
        # "name already exists").
        kept = {name for _, name, _ in found.islands.values()} | {name for name, _ in found.spares}
        orphans = remove_run_groups(self.run.run_id, keep=kept)
        if orphans:
            log.warning("removed %d placement groups of restarts the previous monitor did not finish", orphans)

    async def place(self, slot: SlotState, spec: IslandSpec, outer: ActorHandle[_OuterShell],
                    cursor: DataCursor | int | None, data: list[Any], on_wait: Callable[[float], None] | None = None,
                    ) -> tuple[ActorHandle[_IslandShell], DataCursor | int | None] | None:
        """A process for the new incarnation of `slot` (named in `slot.name`): a warm spare of its pool when there
        is one, else a new process in a new group, waiting for pool capacity without blocking the other islands.
        In an elastic pool the group stays requested until a node has room (`on_wait(since)`, wall time, is
        called once if it is not placed at once: the slot is vacant meanwhile).

        Returns (leader handle, data cursor; None when the new process asks the outer optimizer for it itself),
        or None if the run stopped while it waited for capacity."""
        pool = self.pools[slot.pool]
        if pool.workers_per_island == 1 and self.spares.available(slot.pool):
            if cursor is None:
                cursor = (await asyncio.wait_for(call(outer, _OuterShell.resume_cursor, slot.island),
                                                 timeout=self.call_timeout_s)) or 0
            spare = await self.spares.activate(slot.pool, spec, call(outer, _OuterShell.latest, slot.fetcher), cursor)
            if spare is not None:
                slot.name, handle, self.groups[slot.island] = spare
                self.spares.refill(slot.pool, data)
                return handle, cursor
        # A cold start asks the outer optimizer for the versions (and the data cursor) without waiting:
        # the new process fetches the answers itself, so its start-up (worker, imports, model) overlaps
        # the outer optimizer's own at the start of a run. Nested in a list, the refs are not resolved
        # before the process starts.
        pending = [call(outer, _OuterShell.latest, slot.fetcher),
                   None if cursor is not None else call(outer, _OuterShell.resume_cursor, slot.island)]
        slot.name = island_name(self.run.run_id, slot.island, slot.incarnation)
        if pool.elastic:
            group = await self._wait_for_room(pool, slot.name, slot.island, on_wait or (lambda since: None))
        else:
            group = await self._place_group(pool, slot.name, slot.island)
        if group is None:
            return None
        self.groups[slot.island] = group
        handle = self.actors.island.options(
            name=slot.name, namespace=self.run.namespace, lifetime="detached", num_cpus=pool.cpus_per_island,
            runtime_env=self.island_env,
            resources=dict(pool.resources), scheduling_strategy=island_scheduling(group),
            **({"num_gpus": pool.gpus_per_worker} if pool.gpus_per_worker > 0 else {}),
        ).remote(spec, data, None, cursor or 0, pending=pending)
        return handle, cursor

    async def _place_group(self, pool: PoolConfig, name: str, island: int) -> Any | None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await loop.run_in_executor(None, lambda: create_island_group(
                    pool, name=name, timeout_s=self.placement_timeout_s, lifetime="detached"))
            except Exception as err:  # noqa: BLE001 - PlacementError: keep waiting, say so once per try
                log.warning("island %d: %s; retrying", island, err)
                if self._stopping():
                    return None

    async def _wait_for_room(self, pool: PoolConfig, name: str, island: int, on_wait: Callable[[float], None]) -> Any | None:
        """An elastic slot's group: requested once and left pending until a node of the pool has room (a node
        joins, or an island leaves), so Ray places it the moment there is, and the autoscaler sees the demand."""
        group = self.pending[island] = request_island_group(pool, name=name, lifetime="detached")
        ready, began, told = group.ready(), time.time(), False
        try:
            while not self._stopping():
                done, _ = ray.wait([ready], timeout=0)  # no blocking call in the monitor's event loop
                if done:
                    log.info("placement group %s ready on elastic pool %s", name, pool.name)
                    return group
                if not told and time.time() - began >= ROOM_NOW_S:
                    on_wait(began)
                    told = True
                await asyncio.sleep(ROOM_POLL_S)
            release_group(group)
            return None
        finally:
            self.pending.pop(island, None)

    def _start_spare(self, pool_name: str, name: str, group: Any, data: list[Any]) -> ActorHandle[_IslandShell]:
        """Start a warm spare: an island process with no slot yet, on bundle 0 of `group`."""
        pool = self.pools[pool_name]
        return self.actors.island.options(
            name=name, namespace=self.run.namespace, lifetime="detached", num_cpus=pool.cpus_per_island,
            runtime_env=self.island_env,
            resources=dict(pool.resources), scheduling_strategy=island_scheduling(group),
        ).remote(None, data)

    async def start_followers(self, slot: SlotState, spec: IslandSpec, leader: ActorHandle[_IslandShell], data: list[Any]) -> None:
        """Start ranks 1..W-1 of `slot`'s island on bundles 1..W-1 of its group, joining the leader's rendezvous."""
        # The leader (rank 0) opened the rendezvous in its constructor; the leader trains once all have
        # joined (bounded by the group's timeout).
        pool, group = self.pools[slot.pool], self.groups[slot.island]
        addr, port = await asyncio.wait_for(call(leader, _IslandShell.rendezvous), timeout=self.placement_timeout_s)
        self.followers[slot.island] = [
            self.actors.worker.options(
                name=f"{slot.name}-w{rank}", namespace=self.run.namespace, lifetime="detached",
                num_cpus=pool.cpus_per_island, runtime_env=self.island_env,
                resources=dict(pool.resources), scheduling_strategy=island_scheduling(group, bundle=rank),
                **({"num_gpus": pool.gpus_per_worker} if pool.gpus_per_worker > 0 else {}),
            ).remote(spec, data, rank, addr, port)
            for rank in range(1, pool.workers_per_island)
        ]

    def kill(self, island: int, leader: ActorHandle[_IslandShell] | None) -> None:
        """Kill an island's leader (if any) and followers; those already gone are fine. Its group stays (`release`)."""
        if leader is not None:
            try:
                ray.kill(leader, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill island %d: %s", island, err)
        self.kill_followers(island)

    def kill_followers(self, island: int) -> None:
        """Kill the followers of an island's current incarnation; those already gone are fine."""
        for handle in self.followers.pop(island, []):
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill island %d follower: %s", island, err)

    def release(self, island: int) -> None:
        """Remove an island's placement group, once its processes are killed (never the reverse), and any group
        still requested for it."""
        for group in (self.groups.pop(island, None), self.pending.pop(island, None)):
            if group is not None:
                release_group(group)


@dataclass
class RunActors:
    """The live processes of a run, found by name after a monitor restart.

    Attributes:
        islands: island -> (incarnation, name, handle) of its newest leader that answered.
        spares: (name, handle) of each warm spare that answered.
        followers: leader name -> its followers' handles.
    """

    islands: dict[int, tuple[int, str, ActorHandle[_IslandShell]]] = field(default_factory=dict)
    spares: list[tuple[str, ActorHandle[_IslandShell]]] = field(default_factory=list)
    followers: dict[str, list[ActorHandle[_IslandWorker]]] = field(default_factory=dict)


async def find_run_actors(*, run_id: str, namespace: str, slots: set[int], call_timeout_s: float) -> RunActors:
    """Every process of run `run_id` in `namespace` except its keepers; each leader says which slot it serves."""
    found = RunActors()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry.get("namespace") != namespace or not name.startswith(f"{run_id}-"):
            continue
        if "-keeper-" in name:
            continue  # a progress keeper serves no slot; the monitor's keepers find it by name
        handle = ray.get_actor(name, namespace=namespace)
        follower = re.fullmatch(r"(.*)-w\d+", name)
        if follower:
            found.followers.setdefault(follower.group(1), []).append(handle)
            continue
        try:
            island, inc, _ = await asyncio.wait_for(call(handle, _IslandShell.ping), timeout=call_timeout_s)
        except Exception as err:  # noqa: BLE001 - a dead process is rebuilt by the normal path
            log.warning("could not re-adopt %s: %s", name, err)
            continue
        if island is None:
            found.spares.append((name, handle))
        elif island in slots and inc > found.islands.get(island, (0,))[0]:
            found.islands[island] = (inc, name, handle)
    return found


async def _ask_every_island(handles: dict[int, ActorHandle[_IslandShell]], ask: Callable[[ActorHandle[_IslandShell]], Any], *,
                            timeout_s: float, what: str) -> dict[int, Any]:
    """`ask(handle)` of every island in `handles` (island -> leader) at once, each bounded by `timeout_s`; returns
    island -> answer of those that answered. One that fails or does not answer is logged as `what`, not fatal: asked
    one after another, each silent island would hold the whole call for `timeout_s`, past its caller's bound."""
    items = list(handles.items())
    answers = await asyncio.gather(*(asyncio.wait_for(ask(handle), timeout=timeout_s) for _, handle in items),
                                   return_exceptions=True)
    out = {}
    for (island, _), answer in zip(items, answers):
        if isinstance(answer, BaseException):
            log.warning("%s %d: %s", what, island, answer)
        else:
            out[island] = answer
    return out


async def stop_islands(handles: dict[int, ActorHandle[_IslandShell]], *, flush: bool, timeout_s: float) -> dict[int, Any]:
    """Stop every island in `handles` (island -> leader) at once; returns island -> final status of those that
    answered (a dying island at stop is reported, not fatal). `flush`: see `LearnerIsland.stop`."""
    # Every island at once: stopped one after another, each waited for the step the previous ones
    # were finishing, and the islands stopped first idled meanwhile (about a step per island after
    # them, counted against goodput; for many islands a long serial stop).
    return await _ask_every_island(handles, lambda handle: call(handle, _IslandShell.stop, flush=flush), timeout_s=timeout_s,
                                   what="stop island")


async def island_statuses(handles: dict[int, ActorHandle[_IslandShell]], *, timeout_s: float) -> dict[int, Any]:
    """Ask every island in `handles` (island -> leader) for its status at once; returns island -> status of those
    that answered (a dying island keeps its last status, so it is left out)."""
    return await _ask_every_island(handles, lambda handle: call(handle, _IslandShell.status), timeout_s=timeout_s,
                                   what="status of stopped island")
