"""Pools -> placement groups: one placement group per island, pinned to its pool.

An island is its own failure domain: one group, created whole, removed whole (never partially
rescheduled; docs/architecture.md section 4, ray-project/ray#65147). Pinning uses node labels
(`bundle_label_selector`) and/or custom resources, both taken from the pool's config.

An island of W workers (`workers_per_island`) reserves W bundles, one per worker, every one with the
pool's selector. Strategy PACK: as few nodes as possible (NCCL inside a node is fastest) but allowed
to span nodes of the pool, so an island larger than one node can be placed at all; STRICT_PACK
would refuse it. One-bundle islands keep STRICT_PACK (the same thing for one bundle).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.config import PoolConfig

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """An island's placement group could not be reserved in time; says which pool and why."""


def island_bundle(pool: PoolConfig) -> dict[str, float]:
    """The resources one worker of an island reserves on its pool (one bundle)."""
    gpus = {"GPU": pool.gpus_per_worker} if pool.gpus_per_worker > 0 else {}
    return {"CPU": pool.cpus_per_island, **gpus, **pool.resources}


def request_island_group(pool: PoolConfig, *, name: str, lifetime: str | None = None) -> PlacementGroup:
    """Ask Ray for one island's placement group on `pool` and return at once; it is placed when a node has room.

    A pending group is also the Ray autoscaler's demand for a node of the pool (its bundles and label selector).
    `lifetime="detached"` keeps the group when its creator (the health monitor) restarts.
    """
    workers = pool.workers_per_island
    return placement_group(
        [island_bundle(pool)] * workers,
        strategy="STRICT_PACK" if workers == 1 else "PACK",
        name=name,
        lifetime=lifetime,
        bundle_label_selector=[dict(pool.labels)] * workers if pool.labels else None,
    )


def no_room(pool: PoolConfig, waited_s: float) -> str:
    """What an island of `pool` waits for, in words (a placement error, or an elastic pool's vacant slot)."""
    workers = pool.workers_per_island
    return (f"pool {pool.name!r}: no node with labels {pool.labels or '{}'} could host {workers} x bundle "
            f"{island_bundle(pool)} within {waited_s:.0f}s")


def create_island_group(pool: PoolConfig, *, name: str, timeout_s: float, lifetime: str | None = None) -> PlacementGroup:
    """Reserve one island's placement group on `pool`, waiting up to `timeout_s`.

    Raises PlacementError (after removing the pending group) when no node of the pool can host it.
    `lifetime="detached"` keeps the group when its creator (the health monitor) restarts.
    """
    pg = request_island_group(pool, name=name, lifetime=lifetime)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        raise PlacementError(
            no_room(pool, timeout_s) + "; check node labels/resources with `ray status`, or lower cpus_per_island"
            + (" or workers_per_island" if pool.workers_per_island > 1 else "")
        )
    log.info("placement group %s ready on pool %s (%d x bundle %s)", name, pool.name, pool.workers_per_island,
             island_bundle(pool))
    return pg


def island_scheduling(pg: PlacementGroup, bundle: int = 0) -> PlacementGroupSchedulingStrategy:
    """Schedule an island worker (and anything it starts) on bundle `bundle` of its placement group (rank = bundle)."""
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=True)


def release_group(pg: PlacementGroup) -> None:
    """Remove a placement group; its actors must already be killed (restartable actors would hang)."""
    try:
        remove_placement_group(pg)
    except Exception as err:  # noqa: BLE001 - teardown goes on; the group dies with the job anyway
        log.warning("could not remove placement group: %s", err)


def remove_run_groups(run_id: str, *, keep: Collection[str]) -> int:
    """Remove every live placement group whose name contains `run_id` (detached groups of a dead run), except those
    named in `keep` (a restarted monitor's: the groups of the islands and spares it took back).

    By id, not by name: names resolve only in the creating job's namespace, and a resumed run is a
    new job.
    """
    n = 0
    for pg_id, info in placement_group_table().items():
        name = info.get("name") or ""
        if run_id in name and name not in keep and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            n += 1
    return n


def worker_bundle(pool: PoolConfig) -> dict[str, float]:
    """Resources one worker of an island of `pool` reserves on one node (the placement group's
    bundle, island_bundle above), zero amounts left out."""
    return {k: v for k, v in island_bundle(pool).items() if v > 0}


def label_selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """True when node `labels` satisfy a Ray label selector: each value is `v`, `!v`, `in(a,b)` or
    `!in(a,b)`; a negated term also matches a node without the key."""
    for key, expr in selector.items():
        expr = str(expr).strip()
        negate = expr.startswith("!")
        body = expr[1:].strip() if negate else expr
        if body.startswith("in(") and body.endswith(")"):
            allowed = {v.strip() for v in body[3:-1].split(",")}
        else:
            allowed = {body}
        hit = key in labels and str(labels[key]) in allowed
        if hit == negate:
            return False
    return True


def format_mapping(d: dict[str, Any], sep: str = "=") -> str:
    """`{k=v, ...}` for a label selector or resources (numbers in %g), as one-line messages show them."""
    return "{" + ", ".join(f"{k}{sep}{v:g}" if isinstance(v, (int, float)) else f"{k}{sep}{v}" for k, v in d.items()) + "}"
