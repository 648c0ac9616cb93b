"""Progress keepers, as the health monitor runs them: started, checked, replaced, moved, and asked for salvage.

One keeper per pool (orchestrator/actors/keeper.py) holds its islands' latest progress snapshots
outside their failure domain. This module keeps every pool's keeper alive and well placed: it is
started once the pool's islands are placed (so that it can go to a node without them) and, in a fresh
run, have stepped (a keeper started beside them slowed their first steps), pinged every
KEEPER_CHECK_S and replaced when dead, and moved with its snapshots when a better node comes up
(policies/keeper_placement.py). When an island dies, `salvage` hands its last snapshot, as a ref the
monitor never fetches, to the outer optimizer, which merges what is still valid (policies/salvage.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group_table

from orchestrator.actors.handles import call
from orchestrator.actors.keeper import ProgressKeeper
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.outer_link import OuterLink
from orchestrator.config import PoolConfig
from policies.keeper_placement import NODE_ID_LABEL, keeper_selectors, should_move

if TYPE_CHECKING:
    from ray.actor import ActorHandle

__all__ = ["ProgressKeepers"]

log = logging.getLogger(__name__)


class ProgressKeepers:
    """The keepers of the pools whose island specs name one: handles, replacements, moves and salvages.

    Attributes:
        names: pool -> (namespace, name) of its keeper (IslandSpec.keeper).
        handles: pool -> the keeper's actor handle, once started or found.
        restarts: pool -> keepers replaced after they died.
        moves: pool -> keepers moved to a better node, snapshots included.
        salvages: one dict per salvage attempt: island, incarnation and what the outer optimizer answered.
    """

    KEEPER_WAIT_S = 10.0  # how long a keeper waits for its pool's islands to be placed before it is placed anyway
    KEEPER_CHECK_S = 1.0  # how often keepers are pinged: a dead one is replaced before an island needs it
    KEEPER_PLACE_CHECK_S = 5.0  # how often a live keeper's node is checked against where it would go now

    def __init__(self, *, names: dict[str, tuple[str, str]], keeper_cls: Any, pools: dict[str, PoolConfig],
                 outer: OuterLink, island_groups: Callable[[str], list[Any]], stopping: Callable[[], bool],
                 placement_timeout_s: float, call_timeout_s: float) -> None:
        if names and keeper_cls is None:
            raise ValueError("island specs name progress keepers but no keeper_cls was given; pass "
                             "orchestrator.actors.remote.ProgressKeeperActor (or set health.salvage_every_steps=0)")
        self.names, self.keeper_cls, self.pools, self.outer = names, keeper_cls, pools, outer
        self._island_groups, self._stopping = island_groups, stopping  # the monitor's views of its islands and run
        self.placement_timeout_s, self.call_timeout_s = placement_timeout_s, call_timeout_s
        self.handles: dict[str, ActorHandle[ProgressKeeper]] = {}
        self.restarts: dict[str, int] = {}
        self.moves: dict[str, int] = {}
        self.salvages: list[dict] = []
        self._checked_at = 0.0
        self._placed_at = time.monotonic()  # the first placement check waits a period: keepers just started
        self._check: asyncio.Task | None = None

    def restore(self, saved: dict) -> None:
        """Take back the counts and salvages a previous monitor parked."""
        self.salvages = list(saved.get("salvages", []))
        self.restarts = dict(saved.get("keeper_restarts", {}))
        self.moves = dict(saved.get("keeper_moves", {}))

    async def start(self, placed: Callable[[str], bool]) -> None:
        """Start each pool's keeper as soon as `placed(pool)`: every island slot of the pool holds a placement
        group (or after KEEPER_WAIT_S, when some still wait for capacity: islands that train without a keeper
        lose salvage)."""
        waiting = set(self.names)
        for pool in sorted(waiting):  # a restarted monitor takes its predecessor's keepers as they are
            namespace, name = self.names[pool]
            try:
                self.handles[pool] = ray.get_actor(name, namespace=namespace)
                waiting.discard(pool)
            except ValueError:
                pass
        deadline = time.monotonic() + min(self.KEEPER_WAIT_S, self.placement_timeout_s)
        while waiting and not self._stopping():  # stopping: a keeper started now would outlive stop()
            for pool in sorted(waiting):
                if placed(pool) or time.monotonic() > deadline:
                    self.ensure(pool)
                    waiting.discard(pool)
            if waiting:
                await asyncio.sleep(0.05)

    def check_when_due(self) -> None:
        """Start a check of every keeper if KEEPER_CHECK_S has passed since the last and none is under way."""
        if self._check is None or self._check.done():
            if time.monotonic() - self._checked_at >= self.KEEPER_CHECK_S:
                # Its own task: a keeper on a node not yet known dead may not answer for a while,
                # and that must not hold up the islands' checks.
                self._checked_at = time.monotonic()
                self._check = asyncio.get_running_loop().create_task(self._check_all())

    async def _check_all(self) -> None:
        """Replace every keeper that died (its node failed, or it was killed). Its snapshots are lost, but the
        islands' next ones go to the new keeper, so the next island failure is salvaged again; without this a
        keeper would only be replaced when a salvage found it gone, losing that island's progress."""
        pinged = dict(self.handles)

        async def alive(handle: ActorHandle[ProgressKeeper]) -> bool:
            try:
                await asyncio.wait_for(call(handle, ProgressKeeper.ping), timeout=self.call_timeout_s)
            except RayActorError:
                return False
            except Exception:  # noqa: BLE001 - busy or slow is not dead; the next check asks again
                pass
            return True

        try:
            live = {}
            for (pool, handle), ok in zip(pinged.items(), await asyncio.gather(*map(alive, pinged.values()))):
                if not ok:
                    self._replace(pool, handle, "it died; the snapshots it held are lost")
                else:
                    live[pool] = handle
            if live and time.monotonic() - self._placed_at >= self.KEEPER_PLACE_CHECK_S:
                self._placed_at = time.monotonic()
                await self._place_better(live)
        except Exception as err:  # noqa: BLE001 - the next check tries again
            log.warning("keeper check failed: %s", err)

    async def _place_better(self, live: dict[str, ActorHandle[ProgressKeeper]]) -> None:
        """Move every keeper for which a better node exists now (an island was restarted onto its node and
        an island-free one is there, or such a node joined): policies.keeper_placement.should_move."""
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        labels = {i: {**(n.get("Labels") or {}), NODE_ID_LABEL: i} for i, n in nodes.items()}
        for pool_name, handle in live.items():
            try:
                where = await asyncio.wait_for(call(handle, ProgressKeeper.node), timeout=self.call_timeout_s)
            except Exception:  # noqa: BLE001 - dead or busy: the liveness check deals with it
                continue
            selectors = self._selectors(pool_name, nodes)
            if where in labels and should_move(selectors, labels[where], [v for i, v in labels.items() if i != where]):
                await self._move(pool_name, handle, where)

    async def _move(self, pool: str, old: ActorHandle[ProgressKeeper], where: str) -> None:
        """Replace a live keeper by one placed by today's rule, handing its snapshots over: the old one dumps
        them (the ref stays in the object store after it dies), is killed to free its name, and the new one
        loads them as its first call. Islands shelving meanwhile find the new one at their next snapshot."""
        if self._stopping() or self.handles.get(pool) is not old:
            return
        namespace, name = self.names[pool]
        held = call(old, ProgressKeeper.dump)
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
        if self._stopping():
            return
        # Ray resolves the ref `held` in the new keeper's process; `call`'s typing sees the ref, not the dump it holds.
        if self.handles.get(pool) is not old:  # a salvage found it gone meanwhile and replaced it: hand over to that one
            call(self.handles[pool], ProgressKeeper.load, held)  # type: ignore[call-overload]
            return
        new = self.ensure(pool)
        call(new, ProgressKeeper.load, held)  # type: ignore[call-overload]  # its first call: before any salvage asks it
        self.moves[pool] = self.moves.get(pool, 0) + 1
        log.warning("pool %s: moved its progress keeper, with its snapshots, off node %s: a better node for it is up "
                    "(policies/keeper_placement.py)", pool, where[:12])

    def _replace(self, pool: str, dead: ActorHandle[ProgressKeeper], why: str) -> None:
        if self._stopping() or self.handles.get(pool) is not dead:
            return  # stopping, or already replaced (a salvage and a check can find the same death)
        self.restarts[pool] = self.restarts.get(pool, 0) + 1
        log.warning("pool %s: starting a new progress keeper: %s", pool, why)
        self.ensure(pool)  # a dead keeper's name is free again

    def _island_nodes(self, pool_name: str) -> set[str]:
        """The nodes that hold a bundle of one of the pool's islands or warm spares now."""
        nodes: set[str] = set()
        for group in self._island_groups(pool_name):
            try:
                nodes.update(n for n in (placement_group_table(group).get("bundles_to_node_id") or {}).values() if n)
            except Exception as err:  # noqa: BLE001 - a removed group hosts nothing
                log.debug("placement group table: %s", err)
        return nodes

    def _selectors(self, pool_name: str, nodes: dict[str, dict] | None = None) -> list[dict[str, str]]:
        """Where the pool's keeper should go now, most preferred first (policies.keeper_placement). `nodes`: the
        alive nodes as ray.nodes() gives them, by id, when the caller has them; asked for only when needed."""
        pool = self.pools[pool_name]
        if nodes is None and not pool.labels:
            nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        resources = {i: n["Resources"] for i, n in (nodes or {}).items()}
        return keeper_selectors(pool.labels, pool.resources, resources, self._island_nodes(pool_name))

    def ensure(self, pool_name: str) -> ActorHandle[ProgressKeeper]:
        """The pool's keeper: the live one of that name (a restarted monitor finds its predecessor's) or a new one.

        A new one goes inside its pool, to a node hosting none of the pool's islands when there is one
        (policies/keeper_placement.py). It takes no CPU: a sliver of a pool resource would cost an island slot."""
        namespace, name = self.names[pool_name]
        selectors = self._selectors(pool_name)
        self.handles[pool_name] = self.keeper_cls.options(
            name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
            label_selector=selectors[0],
            **({"fallback_strategy": [{"label_selector": s} for s in selectors[1:]]} if len(selectors) > 1 else {}),
        ).remote(pool_name)
        log.info("pool %s: keeper %s placed by %s", pool_name, name, selectors)
        return self.handles[pool_name]

    async def salvage(self, island: int, pool: str, incarnation: int, kind: str) -> None:
        """Hand the dead incarnation's latest progress snapshot from its pool's keeper to the outer optimizer,
        which merges what is still valid and moves the slot's resume cursor past it (policies/salvage.py).
        The monitor only passes refs on: it never fetches the snapshot (it runs without torch)."""
        keeper = self.handles.get(pool)
        if keeper is None:
            return
        if kind == "diverged":  # its progress is what went wrong: take the snapshot, merge nothing
            call(keeper, ProgressKeeper.take, island, incarnation)
            return
        try:
            got = await asyncio.wait_for(
                call(self.outer.handle(), _OuterShell.salvage, island, incarnation, [call(keeper, ProgressKeeper.take, island, incarnation)]),
                timeout=min(10.0, self.call_timeout_s))
        except Exception as err:  # noqa: BLE001 - best effort: the progress is lost, as without salvage
            log.warning("island %d incarnation %d: no salvage (%s)", island, incarnation,
                        str(err).strip().splitlines()[-1][:200])
            return
        if got.get("keeper_error"):
            self._replace(pool, keeper, f"island {island} incarnation {incarnation} found it gone, "
                                        f"so its progress was not salvaged ({got['keeper_error']})")
        self.salvages.append({"island": island, "incarnation": incarnation, **got})
        if got.get("tokens"):
            log.info("island %d incarnation %d: salvaged %s tokens from step %s (skipped: %s)", island,
                     incarnation, got["tokens"], got.get("step"), got.get("skipped") or "none")

    def teardown(self) -> None:
        """Kill every keeper (the run is over: their snapshots are no longer needed)."""
        for keeper in self.handles.values():
            try:
                ray.kill(keeper, no_restart=True)
            except Exception as err:  # noqa: BLE001 - already gone is fine
                log.info("kill keeper: %s", err)
        self.handles.clear()
