"""GroupIsland: the leader of a data-parallel island of several workers (`spec.workers` > 1).

It is rank 0 of the island's worker group (islands/distributed.py) and keeps the island's whole
interface, as a one-worker island does; at every step boundary it tells its followers
(islands/follower.py) whether to step and sends them the fragments it just adopted, so all workers
hold the same parameters.
"""

from __future__ import annotations

import logging

from islands.distributed import WorkerGroup
from islands.island import LearnerIsland, check_group
from islands.salvage_shelf import Shelve

log = logging.getLogger(__name__)


class GroupIsland(LearnerIsland):
    """A data-parallel island's leader: a LearnerIsland whose step boundaries its followers follow."""

    _group: WorkerGroup

    def _check_kind(self, group: WorkerGroup | None, shelve: Shelve | None) -> None:
        check_group(self.spec, group)
        assert group is not None  # check_group refused a missing one (workers > 1)
        if self.spec.shard == "fsdp":
            raise ValueError(f"island {self.spec.island} shards its model (fsdp): build a ShardedIsland "
                             "(islands.island_kinds.island_for picks it)")
        if group.rank != 0:
            raise ValueError(f"a GroupIsland is rank 0 of its group, got rank {group.rank}; use IslandFollower")

    def _begin(self) -> None:
        self._group.connect()  # blocks until every follower joined (bounded by the group's timeout)
        # Followers start from our parameters and our place in the data.
        self._group.broadcast_([t for frag in self.fragments.theta for t in frag])
        self._group.share_cursor(self.trainer.sampler.data_cursor)

    def _boundary(self, changed: set[int], train: bool) -> None:
        # Followers adopt exactly what this step boundary adopted, and step only when we do.
        self._group.lead(self.fragments.theta, changed=changed, train=train, progress=self.trainer.progress)

    def _end(self) -> None:
        try:
            self._group.lead(self.fragments.theta, changed=(), train=False, stop=True)
            self._group.close()
        except Exception as err:  # noqa: BLE001 - stopping anyway; a dead follower is killed with the island
            log.warning("island %d: could not stop its followers cleanly: %s", self.spec.island, err)
