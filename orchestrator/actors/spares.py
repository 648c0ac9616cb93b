"""Warm spares: idle island processes kept ready per pool, so that a restart skips the process start.

A spare is an island process started with no slot (imports done, model not yet built), in a
placement group of its own named `<run_id>-spare-<pool>-<n>`. A restart in its pool activates one
(`activate`: it takes the slot's spec, the global model and the data cursor) in under a second
instead of placing and starting a new process, and the pool is refilled in the background. Spares
are best effort: one is started only when its pool has free capacity now, so a pending spare never
holds capacity a restart needs. Pools whose islands have several workers get none: a spare would
have to be a whole pre-joined worker group; they restart cold. Elastic pools get none either: their free
capacity belongs to their vacant slots, and a spare would take the room a joining island needs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import get_placement_group

from islands.spec import IslandSpec
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.placement import create_island_group, release_group
from orchestrator.config import PoolConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from islands.cursor import DataCursor

__all__ = ["WarmSpares"]

log = logging.getLogger(__name__)


class WarmSpares:
    """Up to `count` ready island processes per pool: started, adopted after a monitor restart, handed out."""

    def __init__(self, *, run_id: str, pools: dict[str, PoolConfig], count: int,
                 start_spare: Callable[[str, str, Any, list[Any]], ActorHandle[_IslandShell]], placement_timeout_s: float,
                 call_timeout_s: float, stopping: Callable[[], bool]) -> None:
        self.run_id, self.pools, self.count = run_id, pools, count
        self._start_spare = start_spare  # (pool, name, group, data) -> handle: IslandLauncher's
        self.placement_timeout_s, self.call_timeout_s = placement_timeout_s, call_timeout_s
        self._stopping = stopping
        self.ready: dict[str, list[tuple[str, ActorHandle[_IslandShell], Any]]] = {name: [] for name in pools}  # pool -> (name, handle, group)
        self._seq = 0
        self._tasks: dict[str, asyncio.Task] = {}

    def available(self, pool: str) -> bool:
        """Whether `pool` has a spare ready now."""
        return bool(self.ready[pool])

    def counts(self) -> dict[str, int]:
        """Spares ready per pool."""
        return {pool: len(sp) for pool, sp in self.ready.items()}

    def groups(self, pool: str) -> list[Any]:
        """The placement groups of `pool`'s spares."""
        return [g for _, _, g in self.ready.get(pool, [])]

    def adopt(self, name: str, handle: ActorHandle[_IslandShell]) -> None:
        """Take back a spare a previous monitor started (found by name after a monitor restart)."""
        pool = name.split("-spare-")[1].rsplit("-", 1)[0] if "-spare-" in name else None
        if pool in self.ready:
            self.ready[pool].append((name, handle, get_placement_group(name)))

    def refill_all(self, data: list[Any]) -> None:
        """Start every pool's spares in the background (HealthMonitor does this once its islands have stepped)."""
        for pool in self.pools:
            self.refill(pool, data)

    def refill(self, pool: str, data: list[Any]) -> None:
        """Start spares for `pool` in the background until it has `count` (no-op while that is under way)."""
        if not self.pools[pool].spares:
            return  # none for islands of several workers (they restart cold) or elastic pools (module docstring)
        if self.count and not self._stopping() and pool not in self._tasks:
            self._tasks[pool] = asyncio.get_running_loop().create_task(self._fill(pool, data))

    async def _fill(self, pool_name: str, data: list[Any]) -> None:
        # Best effort: a spare needs free capacity in its pool. Its group is given a short wait and
        # removed if it cannot be placed, so a pending spare never holds capacity a restart needs.
        pool = self.pools[pool_name]
        loop = asyncio.get_running_loop()
        try:
            while len(self.ready[pool_name]) < self.count and not self._stopping():
                self._seq += 1
                name = f"{self.run_id}-spare-{pool_name}-{self._seq}"
                try:
                    group = await loop.run_in_executor(None, functools.partial(
                        create_island_group, pool, name=name, timeout_s=5.0, lifetime="detached"))
                except Exception as err:  # noqa: BLE001 - no room now; restarts will start cold
                    log.info("no warm spare for pool %s: %s", pool_name, err)
                    return
                handle = self._start_spare(pool_name, name, group, data)
                try:
                    await asyncio.wait_for(call(handle, _IslandShell.ping), timeout=self.placement_timeout_s)
                except Exception as err:  # noqa: BLE001
                    # A run that stops while a spare starts kills it: nothing went wrong, so not a console warning.
                    (log.info if self._stopping() else log.warning)("warm spare %s failed to start: %s", name, err)
                    ray.kill(handle, no_restart=True)
                    release_group(group)
                    return
                self.ready[pool_name].append((name, handle, group))
                log.info("warm spare %s ready in pool %s", name, pool_name)
        finally:
            self._tasks.pop(pool_name, None)

    async def activate(self, pool: str, spec: IslandSpec, latest: Any, cursor: DataCursor | int) -> tuple[str, ActorHandle[_IslandShell], Any] | None:
        """Hand the next usable spare of `pool` the slot of `spec`; returns its (name, handle, group), or None
        when no spare is left (the caller starts a process cold).

        `latest`: the ref of the outer optimizer's `latest()`, resolved by Ray in the spare's process
        (the monitor never fetches tensors: it runs without torch). Raises if the outer optimizer's answer
        failed rather than the spare (the spare is kept)."""
        while self.ready[pool]:
            name, handle, group = self.ready[pool].pop(0)
            try:
                await asyncio.wait_for(call(handle, _IslandShell.activate, spec, latest, cursor), timeout=self.call_timeout_s)
            except Exception as err:  # e.g. the spare's node died too: try the next, then cold
                if await self._still_a_spare(handle):  # the outer's answer failed, not the spare: keep it
                    self.ready[pool].insert(0, (name, handle, group))
                    raise
                log.warning("warm spare %s unusable: %s", name, err)
                ray.kill(handle, no_restart=True)
                release_group(group)
                continue
            return name, handle, group
        return None

    async def _still_a_spare(self, handle: ActorHandle[_IslandShell]) -> bool:
        try:
            island, _, _ = await asyncio.wait_for(call(handle, _IslandShell.ping), timeout=self.call_timeout_s)
        except Exception:  # noqa: BLE001 - dead or unreachable
            return False
        return island is None

    def teardown(self) -> None:
        """Kill every spare and remove its placement group."""
        for spares in self.ready.values():
            for _, handle, group in spares:
                ray.kill(handle, no_restart=True)
                release_group(group)
            spares.clear()
