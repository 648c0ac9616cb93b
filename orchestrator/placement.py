"""Pools -> placement groups: one placement group per island, pinned to its pool.

An island is its own failure domain: one group, created whole, removed whole (never partially
rescheduled; see shared/notes/ray-2.60.md on ray-project/ray#65147). Pinning uses node labels
(`bundle_label_selector`) and/or custom resources, both taken from the pool's config.
"""

from __future__ import annotations

import logging

from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import PoolConfig

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """An island's placement group could not be reserved in time; says which pool and why."""


def island_bundle(pool: PoolConfig) -> dict[str, float]:
    """The resources one island reserves on its pool."""
    return {"CPU": pool.cpus_per_island, **pool.resources}


def create_island_group(pool: PoolConfig, *, name: str, timeout_s: float, lifetime: str | None = None) -> PlacementGroup:
    """Reserve one island's placement group on `pool`, waiting up to `timeout_s`.

    Raises PlacementError (after removing the pending group) when no node of the pool can host it.
    `lifetime="detached"` keeps the group when its creator (the health monitor) restarts.
    """
    bundle = island_bundle(pool)
    pg = placement_group(
        [bundle],
        strategy="STRICT_PACK",
        name=name,
        lifetime=lifetime,
        bundle_label_selector=[dict(pool.labels)] if pool.labels else None,
    )
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise PlacementError(
            f"pool {pool.name!r}: no node with labels {pool.labels or '{}'} could host bundle {bundle} "
            f"within {timeout_s:.0f}s; check node labels/resources with `ray status`, or lower cpus_per_island"
        )
    log.info("placement group %s ready on pool %s (bundle %s)", name, pool.name, bundle)
    return pg


def island_scheduling(pg: PlacementGroup) -> PlacementGroupSchedulingStrategy:
    """Schedule an island actor (and anything it starts) inside its placement group."""
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)


def release_group(pg: PlacementGroup) -> None:
    """Remove a placement group; its actors must already be killed (restartable actors would hang)."""
    try:
        remove_placement_group(pg)
    except Exception as err:  # noqa: BLE001 - teardown goes on; the group dies with the job anyway
        log.warning("could not remove placement group: %s", err)


def remove_run_groups(run_id: str) -> int:
    """Remove every live placement group whose name contains `run_id` (detached groups of a dead run).

    By id, not by name: names resolve only in the creating job's namespace, and a resumed run is a
    new job.
    """
    n = 0
    for pg_id, info in placement_group_table().items():
        name = info.get("name") or ""
        if run_id in name and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            n += 1
    return n
