"""`island_for`: the island kind a spec asks for, built behind the one interface of `LearnerIsland`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from islands.cursor import DataCursor
from islands.distributed import WorkerGroup
from islands.group_island import GroupIsland
from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from islands.salvage_shelf import Shelve
from islands.sharded_island import ShardedIsland
from islands.spec import IslandSpec

__all__ = ["GroupIsland", "LearnerIsland", "ShardedIsland", "island_for", "island_kind"]


def island_kind(spec: IslandSpec) -> type[LearnerIsland]:
    """FSDP (`spec.shard == "fsdp"`): ShardedIsland, on every worker; several data-parallel workers: GroupIsland,
    their leader; one worker: LearnerIsland."""
    if spec.shard == "fsdp":
        return ShardedIsland
    return GroupIsland if spec.workers > 1 else LearnerIsland


def island_for(spec: IslandSpec, data: Any, initial: list[FragmentUpdate], *, cursor: DataCursor | int = 0,
               resolve: Callable[[Any], Any] = lambda x: x, group: WorkerGroup | None = None,
               shelve: Shelve | None = None) -> LearnerIsland:
    """The island `spec` asks for (`island_kind`), built with LearnerIsland's arguments."""
    return island_kind(spec)(spec, data, initial, cursor=cursor, resolve=resolve, group=group, shelve=shelve)
