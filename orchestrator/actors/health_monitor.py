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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import get_placement_group, placement_group_table

from islands.spec import IslandSpec
from orchestrator.config import PoolConfig
from orchestrator.actors.placement import create_island_group, island_scheduling, release_group
from orchestrator.actors.runtime import DATA_PLANE_RUNTIME_ENV
from policies.health import assess_island
from policies.keeper_placement import NODE_ID_LABEL, keeper_selectors, should_move
from policies.restart import RestartBudget

log = logging.getLogger(__name__)


@dataclass
class SlotState:
    """What the monitor knows about one island slot."""

    island: int
    pool: str
    incarnation: int = 0
    state: str = "restarting"  # training | blocked | dead | restarting | reintegrating | stopped
    name: str | None = None
    node: str | None = None
    steps: int = 0
    last_progress_at: float = 0.0
    last_status_at: float = 0.0
    status: Any = None
    failures: int = 0
    restarts: int = 0
    finals: list = field(default_factory=list)  # last statuses of dead incarnations (token accounting)


def _has_submitted(status) -> bool:
    """Whether an island incarnation's status shows a submission cut (what earns its backoff back)."""
    return status is not None and sum(status.submitted_tokens or ()) > 0


def island_name(run_id: str, island: int, incarnation: int) -> str:
    """The detached actor (and placement group) name of one island incarnation."""
    return f"{run_id}-island{island}-inc{incarnation}"


class HealthMonitor:
    """Plain class driven by an asyncio loop; `ray.remote` is applied in orchestrator/actors/remote.py."""

    def __init__(self, *, run_id: str, namespace: str, pools: list[PoolConfig], specs: list[IslandSpec],
                 data: list[Any] | None = None, outer_name: str, island_cls: Any, placement_timeout_s: float,
                 call_timeout_s: float, tick_s: float = 0.25, health: dict | None = None,
                 restart: dict | None = None, warm_spares: int = 0, worker_cls: Any = None,
                 island_runtime_env: dict | None = None, keeper_cls: Any = None) -> None:
        self.run_id, self.namespace = run_id, namespace
        self.pools = {p.name: p for p in pools}
        multi = [p.name for p in pools if p.workers_per_island > 1]
        if multi and worker_cls is None:
            raise ValueError(f"pools {multi} have workers_per_island > 1 but no worker_cls was given; pass "
                             "orchestrator.actors.remote.IslandWorkerActor")
        self.worker_cls = worker_cls
        # Pools whose islands leave progress snapshots with a keeper (IslandSpec.keeper): pool -> (namespace, name).
        self.keeper_names = {s.pool: s.keeper for s in specs if s.keeper is not None}
        if self.keeper_names and keeper_cls is None:
            raise ValueError("island specs name progress keepers but no keeper_cls was given; pass "
                             "orchestrator.actors.remote.ProgressKeeperActor (or set health.salvage_every_steps=0)")
        self.keeper_cls = keeper_cls
        self.keepers: dict[str, Any] = {}  # pool -> keeper handle
        self.keeper_restarts: dict[str, int] = {}  # pool -> keepers replaced after they died
        self._keepers_checked_at = 0.0
        self._keepers_placed_at = time.monotonic()  # the first placement check waits a period: keepers just started
        self.keeper_moves: dict[str, int] = {}  # pool -> keepers moved to a better node, snapshots included
        self._keeper_check: asyncio.Task | None = None
        self.salvages: list[dict] = []  # one per salvage attempt: island, incarnation, tokens, skipped
        self.followers: dict[int, list[Any]] = {}  # island -> handles of ranks 1..W-1
        self.specs = {s.island: s for s in specs}
        self.data = data
        self.outer_name = outer_name
        self.island_cls = island_cls
        self.placement_timeout_s, self.call_timeout_s, self.tick_s = placement_timeout_s, call_timeout_s, tick_s
        self.health = health or {}
        self.budget = RestartBudget(**(restart or {}))
        # A slot's next start uses incarnation + 1: a resumed run continues above the previous driver's.
        self.slots = {s.island: SlotState(s.island, s.pool, incarnation=s.incarnation - 1) for s in specs}
        self.handles: dict[int, Any] = {}
        self.groups: dict[int, Any] = {}
        self.watchers: dict[int, asyncio.Task] = {}
        self.restarting: dict[int, asyncio.Task] = {}
        self._failing: set[int] = set()  # slots inside _fail(), before their restart task exists
        self.timeline: list[tuple[float, int, int, str]] = []
        self.detect_s: list[float] = []
        self.detections: list[dict] = []  # one per failure: what, why, when detected, when the fault was injected
        self.rejoin_s: list[float] = []
        self.faults: dict[tuple[int, int], dict] = {}  # (island, incarnation) -> injected fault info
        self.warm_spares = warm_spares
        # The job's runtime env, given back to every island process: this actor runs with its own
        # (CONTROL_PLANE_RUNTIME_ENV, zero-copy tensors off) and actors inherit their creator's.
        self.island_env = dict(island_runtime_env) if island_runtime_env is not None else DATA_PLANE_RUNTIME_ENV
        self.spares: dict[str, list[tuple[str, Any, Any]]] = {name: [] for name in self.pools}  # pool -> (name, handle, group)
        self._spare_seq = 0
        self._spare_tasks: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._outer_epoch: int | None = None
        self._stopping = False

    # ------------------------------------------------------------------ helpers

    def _mark(self, slot: SlotState, state: str, at: float | None = None) -> None:
        if slot.state != state:
            slot.state = state
            self.timeline.append((at if at is not None else time.time(), slot.island, slot.incarnation, state))

    def _outer(self) -> Any:
        return ray.get_actor(self.outer_name, namespace=self.namespace)

    async def _call(self, ref: Any) -> Any:
        return await asyncio.wait_for(ref, timeout=self.call_timeout_s)

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
        saved = None if fresh else await self._call(self._outer().monitor_state.remote())
        if saved:
            self._restore(saved)
        adopted = set() if fresh else await self._adopt_existing()
        for slot in self.slots.values():
            if saved and slot.island not in adopted and slot.state not in ("dead", "restarting"):
                # It was live before this monitor restarted and is gone now: a failure nobody saw.
                slot.failures += 1
                self._mark(slot, "dead")
                log.warning("island %d incarnation %d found dead after a monitor restart", slot.island, slot.incarnation)
        starts = [self._start(slot) for slot in self.slots.values() if slot.island not in adopted]
        # Keepers start once their islands are placed, so that they can be placed away from them; islands
        # look their keeper up by name at each snapshot and skip snapshots until it exists.
        await asyncio.gather(*starts, self._start_keepers())
        for pool in self.pools:
            self._refill(pool)

    async def _adopt_existing(self) -> set[int]:
        # Every process of this run is named `<run_id>-...`; each says which slot it serves (spares: none).
        found: dict[int, tuple[int, str, Any]] = {}
        followers: dict[str, list[Any]] = {}  # leader name -> its followers (`<leader>-w<r>`)
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry.get("namespace") != self.namespace or not name.startswith(f"{self.run_id}-"):
                continue
            if "-keeper-" in name:
                continue  # a progress keeper serves no slot; _ensure_keeper finds it by name
            handle = ray.get_actor(name, namespace=self.namespace)
            follower = re.fullmatch(r"(.*)-w\d+", name)
            if follower:
                followers.setdefault(follower.group(1), []).append(handle)
                continue
            try:
                island, inc, _ = await asyncio.wait_for(handle.ping.remote(), timeout=self.call_timeout_s)
            except Exception as err:  # noqa: BLE001 - a dead process is rebuilt by the normal path
                log.warning("could not re-adopt %s: %s", name, err)
                continue
            if island is None:
                pool = name.split("-spare-")[1].rsplit("-", 1)[0] if "-spare-" in name else None
                if pool in self.spares:
                    self.spares[pool].append((name, handle, get_placement_group(name)))
            elif island in self.slots and inc > found.get(island, (0,))[0]:
                found[island] = (inc, name, handle)
        for island, (inc, name, handle) in found.items():
            slot = self.slots[island]
            slot.incarnation, slot.name = inc, name
            self.handles[island] = handle
            self.groups[island] = get_placement_group(name)
            self.followers[island] = followers.pop(name, [])
            if slot.state in ("restarting", "reintegrating") and slot.failures > slot.restarts:
                # The previous monitor died after placing this incarnation but before it parked the count.
                slot.restarts += 1
            self._mark(slot, "training")
            slot.last_progress_at = slot.last_status_at = time.monotonic()
            self.watchers[island] = asyncio.get_running_loop().create_task(self._watch(slot, inc))
            log.warning("re-adopted island %d incarnation %d (%s) after a monitor restart", island, inc, name)
        for name, orphans in followers.items():  # followers of a leader that is gone: their island is rebuilt whole
            log.warning("killing %d followers of %s, whose leader is gone", len(orphans), name)
            for handle in orphans:
                ray.kill(handle, no_restart=True)
        return set(found)

    # ------------------------------------------------------------------ progress keepers (salvage)

    KEEPER_WAIT_S = 10.0  # how long a keeper waits for its pool's islands to be placed before it is placed anyway

    async def _start_keepers(self) -> None:
        """Start each pool's keeper as soon as every island slot of the pool holds a placement group (or after
        KEEPER_WAIT_S, when some still wait for capacity: islands that train without a keeper lose salvage)."""
        waiting = set(self.keeper_names)
        for pool in sorted(waiting):  # a restarted monitor takes its predecessor's keepers as they are
            namespace, name = self.keeper_names[pool]
            try:
                self.keepers[pool] = ray.get_actor(name, namespace=namespace)
                waiting.discard(pool)
            except ValueError:
                pass
        deadline = time.monotonic() + min(self.KEEPER_WAIT_S, self.placement_timeout_s)
        while waiting and not self._stopping:  # stopping: a keeper started now would outlive stop()
            for pool in sorted(waiting):
                placed = all(s.island in self.groups for s in self.slots.values() if s.pool == pool)
                if placed or time.monotonic() > deadline:
                    self._ensure_keeper(pool)
                    waiting.discard(pool)
            if waiting:
                await asyncio.sleep(0.05)

    KEEPER_CHECK_S = 1.0  # how often keepers are pinged: a dead one is replaced before an island needs it

    async def _check_keepers(self) -> None:
        """Replace every keeper that died (its node failed, or it was killed). Its snapshots are lost, but the
        islands' next ones go to the new keeper, so the next island failure is salvaged again; without this a
        keeper would only be replaced when a salvage found it gone, losing that island's progress."""
        pinged = dict(self.keepers)

        async def alive(handle: Any) -> bool:
            try:
                await asyncio.wait_for(handle.ping.remote(), timeout=self.call_timeout_s)
            except RayActorError:
                return False
            except Exception:  # noqa: BLE001 - busy or slow is not dead; the next check asks again
                pass
            return True

        try:
            live = {}
            for (pool, handle), ok in zip(pinged.items(), await asyncio.gather(*map(alive, pinged.values()))):
                if not ok:
                    self._replace_keeper(pool, handle, "it died; the snapshots it held are lost")
                else:
                    live[pool] = handle
            if live and time.monotonic() - self._keepers_placed_at >= self.KEEPER_PLACE_CHECK_S:
                self._keepers_placed_at = time.monotonic()
                await self._place_keepers_better(live)
        except Exception as err:  # noqa: BLE001 - the next check tries again
            log.warning("keeper check failed: %s", err)

    KEEPER_PLACE_CHECK_S = 5.0  # how often a live keeper's node is checked against where it would go now

    async def _place_keepers_better(self, live: dict[str, Any]) -> None:
        """Move every keeper for which a better node exists now (an island was restarted onto its node and
        an island-free one is there, or such a node joined): policies.keeper_placement.should_move."""
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        labels = {i: {**(n.get("Labels") or {}), NODE_ID_LABEL: i} for i, n in nodes.items()}
        for pool_name, handle in live.items():
            try:
                where = await asyncio.wait_for(handle.node.remote(), timeout=self.call_timeout_s)
            except Exception:  # noqa: BLE001 - dead or busy: the liveness check deals with it
                continue
            selectors = self._keeper_selectors(pool_name, nodes)
            if where in labels and should_move(selectors, labels[where], [v for i, v in labels.items() if i != where]):
                await self._move_keeper(pool_name, handle, where)

    async def _move_keeper(self, pool: str, old: Any, where: str) -> None:
        """Replace a live keeper by one placed by today's rule, handing its snapshots over: the old one dumps
        them (the ref stays in the object store after it dies), is killed to free its name, and the new one
        loads them as its first call. Islands shelving meanwhile find the new one at their next snapshot."""
        if self._stopping or self.keepers.get(pool) is not old:
            return
        namespace, name = self.keeper_names[pool]
        held = old.dump.remote()
        # Wait for the dump without fetching it here (the monitor never holds snapshots); a kill is not queued
        # behind calls, so it must come after.
        ready, _ = await asyncio.get_running_loop().run_in_executor(
            None, lambda: ray.wait([held], timeout=self.call_timeout_s, fetch_local=False))
        if not ready:
            log.warning("pool %s: its keeper did not hand over its snapshots in %.0f s; not moved", pool, self.call_timeout_s)
            return
        ray.kill(old, no_restart=True)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the name is free once the old keeper is known dead
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            await asyncio.sleep(0.05)
        if self._stopping:
            return
        if self.keepers.get(pool) is not old:  # a salvage found it gone meanwhile and replaced it: hand over to that one
            self.keepers[pool].load.remote(held)
            return
        new = self._ensure_keeper(pool)
        new.load.remote(held)  # its first call: before any salvage asks it
        self.keeper_moves[pool] = self.keeper_moves.get(pool, 0) + 1
        log.warning("pool %s: moved its progress keeper, with its snapshots, off node %s: a better node for it is up "
                    "(policies/keeper_placement.py)", pool, where[:12])

    def _replace_keeper(self, pool: str, dead: Any, why: str) -> None:
        if self._stopping or self.keepers.get(pool) is not dead:
            return  # stopping, or already replaced (a salvage and a check can find the same death)
        self.keeper_restarts[pool] = self.keeper_restarts.get(pool, 0) + 1
        log.warning("pool %s: starting a new progress keeper: %s", pool, why)
        self._ensure_keeper(pool)  # a dead keeper's name is free again

    def _island_nodes(self, pool_name: str) -> set[str]:
        """The nodes that hold a bundle of one of the pool's islands or warm spares now."""
        groups = [g for i, g in self.groups.items() if self.slots[i].pool == pool_name]
        groups += [g for _, _, g in self.spares.get(pool_name, [])]
        nodes: set[str] = set()
        for group in groups:
            try:
                nodes.update(n for n in (placement_group_table(group).get("bundles_to_node_id") or {}).values() if n)
            except Exception as err:  # noqa: BLE001 - a removed group hosts nothing
                log.debug("placement group table: %s", err)
        return nodes

    def _keeper_selectors(self, pool_name: str, nodes: dict[str, dict] | None = None) -> list[dict[str, str]]:
        """Where the pool's keeper should go now, most preferred first (policies.keeper_placement). `nodes`: the
        alive nodes as ray.nodes() gives them, by id, when the caller has them; asked for only when needed."""
        pool = self.pools[pool_name]
        if nodes is None and not pool.labels:
            nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        resources = {i: n["Resources"] for i, n in (nodes or {}).items()}
        return keeper_selectors(pool.labels, pool.resources, resources, self._island_nodes(pool_name))

    def _ensure_keeper(self, pool_name: str) -> Any:
        """The pool's keeper: the live one of that name (a restarted monitor finds its predecessor's) or a new one.

        A new one goes inside its pool, to a node hosting none of the pool's islands when there is one
        (policies/keeper_placement.py). It takes no CPU: a sliver of a pool resource would cost an island slot."""
        namespace, name = self.keeper_names[pool_name]
        selectors = self._keeper_selectors(pool_name)
        self.keepers[pool_name] = self.keeper_cls.options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
            label_selector=selectors[0],
            **({"fallback_strategy": [{"label_selector": s} for s in selectors[1:]]} if len(selectors) > 1 else {}),
        ).remote(pool_name)
        log.info("pool %s: keeper %s placed by %s", pool_name, name, selectors)
        return self.keepers[pool_name]

    async def _salvage(self, slot: SlotState, incarnation: int, kind: str) -> None:
        """Hand the dead incarnation's latest progress snapshot from its pool's keeper to the outer optimizer,
        which merges what is still valid and moves the slot's resume cursor past it (policies/salvage.py).
        The monitor only passes refs on: it never fetches the snapshot (it runs without torch)."""
        keeper = self.keepers.get(slot.pool)
        if keeper is None:
            return
        if kind == "diverged":  # its progress is what went wrong: take the snapshot, merge nothing
            keeper.take.remote(slot.island, incarnation)
            return
        try:
            got = await asyncio.wait_for(
                self._outer().salvage.remote(slot.island, incarnation, [keeper.take.remote(slot.island, incarnation)]),
                timeout=min(10.0, self.call_timeout_s))
        except Exception as err:  # noqa: BLE001 - best effort: the progress is lost, as without salvage
            log.warning("island %d incarnation %d: no salvage (%s)", slot.island, incarnation,
                        str(err).strip().splitlines()[-1][:200])
            return
        if got.get("keeper_error"):
            self._replace_keeper(slot.pool, keeper, f"island {slot.island} incarnation {incarnation} found it gone, "
                                            f"so its progress was not salvaged ({got['keeper_error']})")
        self.salvages.append({"island": slot.island, "incarnation": incarnation, **got})
        if got.get("tokens"):
            log.info("island %d incarnation %d: salvaged %s tokens from step %s (skipped: %s)", slot.island,
                     incarnation, got["tokens"], got.get("step"), got.get("skipped") or "none")

    # ------------------------------------------------------------------ warm spares

    def _refill(self, pool: str) -> None:
        if self.pools[pool].workers_per_island > 1:
            return  # no warm spares for islands of several workers: they restart cold (see the module docstring)
        if self.warm_spares and not self._stopping and pool not in self._spare_tasks:
            self._spare_tasks[pool] = asyncio.get_running_loop().create_task(self._ensure_spares(pool))

    async def _ensure_spares(self, pool_name: str) -> None:
        # Best effort: a spare needs free capacity in its pool. Its group is given a short wait and
        # removed if it cannot be placed, so a pending spare never holds capacity a restart needs.
        pool = self.pools[pool_name]
        loop = asyncio.get_running_loop()
        try:
            while len(self.spares[pool_name]) < self.warm_spares and not self._stopping:
                self._spare_seq += 1
                name = f"{self.run_id}-spare-{pool_name}-{self._spare_seq}"
                try:
                    group = await loop.run_in_executor(None, lambda: create_island_group(
                        pool, name=name, timeout_s=5.0, lifetime="detached"))
                except Exception as err:  # noqa: BLE001 - no room now; restarts will start cold
                    log.info("no warm spare for pool %s: %s", pool_name, err)
                    return
                handle = self.island_cls.options(
                    name=name, namespace=self.namespace, lifetime="detached", num_cpus=pool.cpus_per_island,
                    runtime_env=self.island_env,
                    resources=dict(pool.resources), scheduling_strategy=island_scheduling(group),
                ).remote(None, self.data)
                try:
                    await asyncio.wait_for(handle.ping.remote(), timeout=self.placement_timeout_s)
                except Exception as err:  # noqa: BLE001
                    log.warning("warm spare %s failed to start: %s", name, err)
                    ray.kill(handle, no_restart=True)
                    release_group(group)
                    return
                self.spares[pool_name].append((name, handle, group))
                log.info("warm spare %s ready in pool %s", name, pool_name)
        finally:
            self._spare_tasks.pop(pool_name, None)

    async def _activate_spare(self, slot: SlotState, spec: IslandSpec, latest: Any, cursor: int) -> Any | None:
        """`latest`: the ref of the outer optimizer's `latest()`, resolved by Ray in the spare's process
        (the monitor never fetches tensors: it runs without torch)."""
        while self.spares[slot.pool]:
            name, handle, group = self.spares[slot.pool].pop(0)
            try:
                await asyncio.wait_for(handle.activate.remote(spec, latest, cursor), timeout=self.call_timeout_s)
            except Exception as err:  # noqa: BLE001 - e.g. the spare's node died too: try the next, then cold
                if await self._still_a_spare(handle):  # the outer's answer failed, not the spare: keep it
                    self.spares[slot.pool].insert(0, (name, handle, group))
                    raise
                log.warning("warm spare %s unusable: %s", name, err)
                ray.kill(handle, no_restart=True)
                release_group(group)
                continue
            slot.name = name
            self.groups[slot.island] = group
            return handle
        return None

    async def _still_a_spare(self, handle: Any) -> bool:
        try:
            island, _, _ = await asyncio.wait_for(handle.ping.remote(), timeout=self.call_timeout_s)
        except Exception:  # noqa: BLE001 - dead or unreachable
            return False
        return island is None

    @staticmethod
    def _fetcher(slot: SlotState) -> int | None:
        """Whose fetch of the global model the outer optimizer counts on the downlink: a restarted incarnation's
        (it crosses the WAN), not a first start's (islands could build the initial model from the seed)."""
        return slot.island if slot.incarnation > 1 else None

    async def _start(self, slot: SlotState, *, cursor: int | None = None) -> None:
        """Place a new incarnation of `slot` in its pool and reintegrate it from the global state.

        A warm spare of the pool is activated when there is one; otherwise a new process is placed
        (waiting for pool capacity without blocking the other islands).
        """
        slot.incarnation += 1
        self._mark(slot, "restarting")
        pool = self.pools[slot.pool]
        loop = asyncio.get_running_loop()
        outer = self._outer()
        spec = dataclasses.replace(self.specs[slot.island], incarnation=slot.incarnation)
        handle = None
        if pool.workers_per_island == 1 and self.spares[slot.pool]:
            if cursor is None:
                cursor = (await self._call(outer.resume_cursor.remote(slot.island))) or 0
            handle = await self._activate_spare(slot, spec, outer.latest.remote(self._fetcher(slot)), cursor)
        if handle is not None:
            self._refill(slot.pool)
        else:
            # A cold start asks the outer optimizer for the versions (and the data cursor) without waiting:
            # the new process fetches the answers itself, so its start-up (worker, imports, model) overlaps
            # the outer optimizer's own at the start of a run. Nested in a list, the refs are not resolved
            # before the process starts.
            pending = [outer.latest.remote(self._fetcher(slot)),
                       None if cursor is not None else outer.resume_cursor.remote(slot.island)]
            slot.name = island_name(self.run_id, slot.island, slot.incarnation)
            while True:
                try:
                    group = await loop.run_in_executor(None, lambda: create_island_group(
                        pool, name=slot.name, timeout_s=self.placement_timeout_s, lifetime="detached"))
                    break
                except Exception as err:  # noqa: BLE001 - PlacementError: keep waiting, say so once per try
                    log.warning("island %d: %s; retrying", slot.island, err)
                    if self._stopping:
                        return
            self.groups[slot.island] = group
            handle = self.island_cls.options(
                name=slot.name, namespace=self.namespace, lifetime="detached", num_cpus=pool.cpus_per_island,
                runtime_env=self.island_env,
                resources=dict(pool.resources), scheduling_strategy=island_scheduling(group),
                **({"num_gpus": pool.gpus_per_worker} if pool.gpus_per_worker > 0 else {}),
            ).remote(spec, self.data, None, cursor or 0, pending=pending)
        self._mark(slot, "reintegrating")
        try:
            if pool.workers_per_island > 1:
                await self._start_followers(slot, spec, handle, self.groups[slot.island])
            slot.node = await asyncio.wait_for(handle.node_id.remote(), timeout=self.placement_timeout_s)
            await self._call(outer.register.remote(slot.island, slot.incarnation, handle))
        except BaseException:
            ray.kill(handle, no_restart=True)  # never leave a half-started detached island behind
            self._kill_followers(slot.island)
            raise
        # Health checks see the island only from here on: construction time is not a hang.
        slot.steps, slot.status = 0, None
        slot.last_progress_at = slot.last_status_at = time.monotonic()
        self.handles[slot.island] = handle
        self.watchers[slot.island] = loop.create_task(self._watch(slot, slot.incarnation))
        log.info("island %d incarnation %d up on node %s (cursor %s)", slot.island, slot.incarnation, slot.node,
                 "asked of the outer optimizer" if cursor is None else cursor)

    async def _start_followers(self, slot: SlotState, spec: IslandSpec, leader: Any, group: Any) -> None:
        # The leader (rank 0) opened the rendezvous in its constructor; ranks 1..W-1 join it on their own
        # bundles. The leader trains once all have joined (bounded by the group's timeout).
        pool = self.pools[slot.pool]
        addr, port = await asyncio.wait_for(leader.rendezvous.remote(), timeout=self.placement_timeout_s)
        self.followers[slot.island] = [
            self.worker_cls.options(
                name=f"{slot.name}-w{rank}", namespace=self.namespace, lifetime="detached", num_cpus=pool.cpus_per_island,
                runtime_env=self.island_env,
                resources=dict(pool.resources), scheduling_strategy=island_scheduling(group, bundle=rank),
                **({"num_gpus": pool.gpus_per_worker} if pool.gpus_per_worker > 0 else {}),
            ).remote(spec, self.data, rank, addr, port)
            for rank in range(1, pool.workers_per_island)
        ]

    def _kill_followers(self, island: int) -> None:
        for handle in self.followers.pop(island, []):
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill island %d follower: %s", island, err)

    async def _watch(self, slot: SlotState, incarnation: int) -> None:
        # One outstanding call per island: an error here is the fastest death signal there is.
        handle = self.handles[slot.island]
        while not self._stopping and slot.incarnation == incarnation:
            try:
                state = await handle.watch.remote(5.0)
            except (RayActorError, RayTaskError) as err:
                if not self._stopping and slot.incarnation == incarnation:
                    await self._fail(slot, "dead", str(err).strip().splitlines()[-1][:200])
                return
            if state in ("failed", "diverged") and slot.incarnation == incarnation:
                await self._fail(slot, state, f"inner loop {state}")
                return

    async def _fail(self, slot: SlotState, kind: str, reason: str) -> None:
        if slot.island in self.restarting or slot.island in self._failing or slot.state in ("dead", "restarting"):
            return
        # One failure at a time per slot, until its restart task is registered (the teardown below awaits).
        self._failing.add(slot.island)
        try:
            await self._fail_once(slot, kind, reason)
        finally:
            self._failing.discard(slot.island)

    async def _fail_once(self, slot: SlotState, kind: str, reason: str) -> None:
        now_wall = time.time()
        fault = self.faults.get((slot.island, slot.incarnation))
        died_at = fault["at"] if fault else now_wall
        self.detections.append({"island": slot.island, "incarnation": slot.incarnation, "kind": kind, "reason": reason,
                                "detected_at": now_wall, "fault_at": fault["at"] if fault else None})
        if fault:
            self.detect_s.append(max(0.0, now_wall - fault["at"]))
        slot.failures += 1
        log.warning("island %d incarnation %d %s: %s", slot.island, slot.incarnation, kind, reason)
        self._mark(slot, "dead", at=died_at)
        if slot.status is not None:
            slot.finals.append(slot.status)
            slot.status = None
        await self._teardown(slot)
        await self._salvage(slot, slot.incarnation, kind)  # before the restart asks where to resume
        decision = self.budget.on_failure(slot.island, time.monotonic())
        if not decision.restart:
            log.error("island %d will not be restarted: %s", slot.island, decision.reason)
            return
        delay = max(decision.at - time.monotonic(), fault.get("recovery_delay_s", 0.0) if fault else 0.0)
        self.restarting[slot.island] = asyncio.get_running_loop().create_task(self._restart(slot, delay, died_at))

    async def _teardown(self, slot: SlotState) -> None:
        # Rebuild whole: kill the actors (leader and followers), then remove the group (never the reverse).
        handle = self.handles.pop(slot.island, None)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill island %d: %s", slot.island, err)
        self._kill_followers(slot.island)
        try:
            await self._call(self._outer().unregister.remote(slot.island))
        except Exception as err:  # noqa: BLE001 - the outer optimizer may itself be restarting
            log.warning("unregister island %d: %s", slot.island, err)
        group = self.groups.pop(slot.island, None)
        if group is not None:
            release_group(group)

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
                self._mark(slot, "restarting")
                delay = self.budget.on_failure(slot.island, time.monotonic()).at - time.monotonic()
                continue
            slot.restarts += 1
            self.rejoin_s.append(time.time() - died_at)
            try:  # park the count now, not at the next tick: a monitor restart in between would lose it
                await self._park_state()
            except Exception as err:  # noqa: BLE001 - the periodic park retries
                log.warning("could not park the monitor state: %s", err)
            break
        self.restarting.pop(slot.island, None)

    # ------------------------------------------------------------------ monitoring

    async def _monitor(self) -> None:
        last_saved = 0.0
        while not self._stopping:
            await asyncio.sleep(self.tick_s)
            try:
                await self._check_outer()
                await asyncio.gather(*(self._check(slot) for slot in self.slots.values()))
                if self._keeper_check is None or self._keeper_check.done():
                    if time.monotonic() - self._keepers_checked_at >= self.KEEPER_CHECK_S:
                        # Its own task: a keeper on a node not yet known dead may not answer for a while,
                        # and that must not hold up the islands' checks.
                        self._keepers_checked_at = time.monotonic()
                        self._keeper_check = asyncio.get_running_loop().create_task(self._check_keepers())
                if time.monotonic() - last_saved >= 1.0:
                    await self._park_state()
                    last_saved = time.monotonic()
            except Exception as err:  # noqa: BLE001 - the monitor itself must keep going
                log.warning("health check round failed: %s", err)

    async def _park_state(self) -> None:
        # What the monitor knows must survive its own restart: park it with the outer optimizer.
        await self._call(self._outer().keep_monitor_state.remote(self._state()))

    def _state(self) -> dict:
        return {"timeline": list(self.timeline), "detect_s": list(self.detect_s), "rejoin_s": list(self.rejoin_s),
                "detections": list(self.detections), "salvages": list(self.salvages),
                "keeper_restarts": dict(self.keeper_restarts), "keeper_moves": dict(self.keeper_moves),
                "slots": {i: {"failures": s.failures, "restarts": s.restarts, "finals": list(s.finals),
                              "incarnation": s.incarnation, "state": s.state} for i, s in self.slots.items()},
                "faults": dict(self.faults)}

    def _restore(self, saved: dict) -> None:
        self.timeline = list(saved["timeline"])
        self.detect_s, self.rejoin_s = list(saved["detect_s"]), list(saved["rejoin_s"])
        self.detections = list(saved["detections"])
        self.salvages = list(saved.get("salvages", []))
        self.keeper_restarts = dict(saved.get("keeper_restarts", {}))
        self.keeper_moves = dict(saved.get("keeper_moves", {}))
        self.faults = dict(saved["faults"])
        for i, st in saved["slots"].items():
            slot = self.slots[int(i)]
            slot.failures, slot.restarts, slot.finals = st["failures"], st["restarts"], list(st["finals"])
            slot.incarnation = st["incarnation"]  # a slot found dead restarts above this
            slot.state = st.get("state", slot.state)
        log.warning("health monitor restored its state (%d timeline events)", len(self.timeline))

    async def _check_outer(self) -> None:
        outer = self._outer()
        info = await self._call(outer.health.remote())
        registered = {int(k): v for k, v in info["islands"].items()}
        if self._outer_epoch is not None and info["epoch"] != self._outer_epoch:
            log.warning("outer optimizer restarted (epoch %s -> %s): resyncing islands", self._outer_epoch, info["epoch"])
            # Each island fetches the restored model across its own link (counted, and on an EMULATED network
            # delayed, like a restarted island's fetch). Asked for all at once so the transfers overlap; each
            # ref resolves in its island's process (no tensors here).
            handles = list(self.handles.items())
            fetched = {island: outer.latest.remote(island) for island, _ in handles}
            for island, handle in handles:
                slot = self.slots[island]
                await self._call(handle.resync.remote(fetched[island]))
                await self._call(outer.register.remote(island, slot.incarnation, handle))
                registered[island] = slot.incarnation  # `info` predates this: the reconcile below must not repeat it
        self._outer_epoch = info["epoch"]
        for island, inc in info["diverged"]:
            slot = self.slots.get(island)
            if slot is not None and slot.incarnation == inc:
                await self._fail(slot, "diverged", "sent a non-finite outer gradient")
        for island, handle in list(self.handles.items()):  # reconcile after any outer restart
            slot = self.slots[island]
            if slot.state in ("training", "blocked") and registered.get(island) != slot.incarnation:
                await self._call(outer.register.remote(island, slot.incarnation, handle))

    def _moved_on(self, slot: SlotState, incarnation: int) -> bool:
        """Whether `slot` failed or moved past `incarnation` since a check of it began.

        A check awaits the island's answer; meanwhile the watcher may have declared the same
        incarnation failed. Acting on the stale answer (marking the slot "training" again, then
        failing it a second time) started two restarts of one slot that raced each other (seen
        under load: clobbered names, an untracked incarnation left submitting)."""
        return (slot.incarnation != incarnation or slot.island in self.restarting
                or slot.island in self._failing or slot.state in ("dead", "restarting", "stopped"))

    async def _check(self, slot: SlotState) -> None:
        handle = self.handles.get(slot.island)
        if handle is None or slot.island in self.restarting or slot.state in ("dead", "restarting", "stopped"):
            return
        now = time.monotonic()
        ok = True
        incarnation = slot.incarnation
        try:
            st = await asyncio.wait_for(handle.status.remote(), timeout=min(2.0, self.call_timeout_s))
            if self._moved_on(slot, incarnation):
                return  # the slot failed (or moved on) while we waited: this answer is about the past
            slot.status, slot.last_status_at = st, now
            if st.steps != slot.steps:
                slot.steps, slot.last_progress_at = st.steps, now
                if slot.state == "reintegrating":
                    self.budget.on_healthy(slot.island, now, submitted=_has_submitted(st))
            elif st.state == "blocked":
                # Waiting for a round is not a hang, so the hang clock restarts when the island unblocks.
                # Counted from its last step instead, a sync island whose round took 30 s was judged hung
                # by the first check that caught it computing the step after (66 false failures in a run).
                slot.last_progress_at = now
            self._mark(slot, "blocked" if st.state == "blocked" else ("training" if st.steps else slot.state))
        except RayTaskError as err:  # the call ran and raised: a bug, not a slow island; say what it is
            log.error("island %d status() raised: %s", slot.island, str(err).strip().splitlines()[-1][:300])
            ok, st = False, slot.status
        except (asyncio.TimeoutError, RayActorError):
            ok, st = False, slot.status
        if self._moved_on(slot, incarnation):
            return
        verdict = assess_island(
            now=now, state=st.state if st else "starting", steps=slot.steps, last_progress_at=slot.last_progress_at,
            step_time_s=st.step_time_s if st else None, status_ok=ok, last_status_at=slot.last_status_at, **self.health,
        )
        if verdict.healthy:
            self.budget.on_healthy(slot.island, now, submitted=_has_submitted(st))
        else:
            await self._fail(slot, verdict.kind, verdict.reason)

    # ------------------------------------------------------------------ interface

    def note_fault(self, island: int, incarnation: int, kind: str, at: float, recovery_delay_s: float = 0.0) -> None:
        """The chaos injector reports a fault it caused (for time-to-detect and the recovery delay)."""
        self.faults[(island, incarnation)] = {"kind": kind, "at": at, "recovery_delay_s": recovery_delay_s}

    def current(self, island: int) -> tuple[int, str | None, str | None]:
        """(incarnation, actor name, node id) of the live incarnation of a slot."""
        slot = self.slots[island]
        return slot.incarnation, slot.name if island in self.handles else None, slot.node

    def snapshot(self) -> dict:
        """Slots, their latest statuses, the timeline so far, detect and rejoin times."""
        return {
            "slots": {i: dataclasses.asdict(s) | {"status": s.status, "finals": list(s.finals)} for i, s in self.slots.items()},
            "timeline": list(self.timeline), "detect_s": list(self.detect_s), "rejoin_s": list(self.rejoin_s),
            "spares": {pool: len(sp) for pool, sp in self.spares.items()}, "detections": list(self.detections),
            "salvages": list(self.salvages), "keeper_restarts": dict(self.keeper_restarts),
            "keeper_moves": dict(self.keeper_moves),
        }

    async def stop(self, flush: bool = False) -> dict:
        """Stop monitoring and every island; returns the final snapshot.

        Outboxes freeze, unless `flush`: then each island cuts its remaining progress into submissions
        the outer optimizer still takes (see `LearnerIsland.stop`)."""
        self._stopping = True
        for task in list(self.restarting.values()):
            task.cancel()
        # Every island at once: stopped one after another, each waited for the step the previous ones
        # were finishing, and the islands stopped first idled meanwhile (about a step per island after
        # them, counted against goodput; for many islands a long serial stop).
        handles = list(self.handles.items())
        answers = await asyncio.gather(*(self._call(handle.stop.remote(flush=flush)) for _, handle in handles),
                                       return_exceptions=True)
        finals = {}
        for (island, _), answer in zip(handles, answers):
            if isinstance(answer, BaseException):  # a dying island at stop is reported, not fatal
                log.warning("stop island %d: %s", island, answer)
            else:
                finals[island] = answer
        for island, st in finals.items():
            self.slots[island].status = st
            self._mark(self.slots[island], "stopped")
        return self.snapshot()

    async def refresh_statuses(self) -> dict:
        """Ask every stopped island for its status again (after the final flush drained its outbox, so
        that token accounting sees what the outer optimizer took); returns the snapshot."""
        for island, handle in list(self.handles.items()):
            try:
                self.slots[island].status = await self._call(handle.status.remote())
            except Exception as err:  # noqa: BLE001 - a dying island keeps its last status
                log.warning("status of stopped island %d: %s", island, err)
        return self.snapshot()

    async def teardown(self) -> None:
        """Kill every island and warm spare of this run and remove their placement groups."""
        self._stopping = True
        for slot in self.slots.values():
            await self._teardown(slot)
        for spares in self.spares.values():
            for _, handle, group in spares:
                ray.kill(handle, no_restart=True)
                release_group(group)
            spares.clear()
        for keeper in self.keepers.values():
            try:
                ray.kill(keeper, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill keeper: %s", err)
        self.keepers.clear()
