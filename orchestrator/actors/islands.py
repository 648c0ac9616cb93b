"""The island processes' actor shells: the leader (`LearnerIsland`) and its followers.

Torch and the island code are imported when such a process is constructed, not when this module is
imported: the health monitor creates islands from these classes and must be able to unpickle them
without importing torch (a process that imports torch costs ~3 s of CPU to start on a 2-core
machine, and the monitor is restarted on the critical path of recovery). `ray.remote` is applied in
orchestrator/actors/remote.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from orchestrator.actors.handles import call
from orchestrator.actors.keeper import ProgressKeeper
from orchestrator.actors.runtime import placement_group_id, quiet_worker
from policies.island_states import ENDED_BADLY

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from islands.distributed import WorkerGroup
    from islands.island import LearnerIsland
    from islands.messages import FragmentUpdate
    from islands.spec import IslandSpec


def _warm_up() -> None:
    """One throwaway AdamW step on a nano model: what a process loads lazily on its first forward, backward
    and optimizer step loads now, while the spare idles, not after it takes over a failed island's slot.
    The engine's AdamW (policies/torch_optimizers) skips torch's compiler import; a user's own optimizer
    may still pay it (~1.1 s of CPU) on its first step."""
    import torch

    from islands.model import build_model
    from islands.model_api import default_loss
    from islands.spec import model_config
    from policies.torch_optimizers import AdamW

    cfg = model_config("nano")
    model = build_model(cfg, seed=0)
    opt = AdamW(model.parameters())
    x = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    default_loss(model, (x, x)).backward()
    opt.step()


class _Shelver:
    """Hands an island's progress snapshots to its pool's keeper (orchestrator/actors/keeper.py), fire and forget.

    The keeper is looked up by name on first use and again after a call to it failed, so a keeper the
    health monitor replaced is found; until one exists (it starts once its pool's islands are placed,
    policies/keeper_placement.py) snapshots are skipped. While the previous snapshot is still on its
    way the next one is skipped (a slow keeper never builds a backlog); calls from one caller run in
    order.
    """

    def __init__(self, spec: IslandSpec) -> None:
        assert spec.keeper is not None
        self.namespace, self.name = spec.keeper
        self.island, self.incarnation = spec.island, spec.incarnation
        self._handle: ActorHandle[ProgressKeeper] | None = None
        self._last: ObjectRef[bool] | None = None  # ref of the previous keep() call

    def __call__(self, step: int, blob: bytes) -> bool:
        """Send one snapshot; False when it was skipped."""
        if self._last is not None:
            done, _ = ray.wait([self._last], timeout=0)
            if not done:
                return False
            last, self._last = self._last, None
            try:
                ray.get(last)
            except Exception:  # noqa: BLE001 - the keeper died: look it up again below
                self._handle = None
        if self._handle is None:
            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:  # no keeper of that name (yet): skip this snapshot, look again at the next
                return False
        self._last = call(self._handle, ProgressKeeper.keep, self.island, self.incarnation, step, blob)
        return True


class _IslandShell:
    """A LearnerIsland process. Created with a spec it trains at once; created without one it is a
    warm spare (imports done, data fetched, no training) until `activate` gives it an island slot.

    Restarting an island cold costs a new worker process and importing torch (~20 s on a busy 2-core
    machine); activating a spare costs building the model (well under a second).
    """

    def __init__(self, spec: IslandSpec | None, data: list[Any], initial: list[FragmentUpdate] | None = None,
                 cursor: Any = 0, pending: list[Any] | None = None) -> None:
        """`pending`: [ref to the outer optimizer's `latest()`, ref to its `resume_cursor()` or None],
        asked for while this process started; they replace `initial` (and `cursor` when not None)."""
        quiet_worker("warm spare" if spec is None else f"island {spec.island}")
        import islands.island  # noqa: F401 - a spare is warm: torch and the island code load now, not at activation

        self._data = ray.get(data[0])  # fetched once, zero-copy, before any slot needs it
        self._island: LearnerIsland | None = None
        self._group: WorkerGroup | None = None
        if spec is None:
            _warm_up()
        else:
            if pending is not None:
                initial = ray.get(pending[0])
                if pending[1] is not None:
                    cursor = ray.get(pending[1]) or 0
            self.activate(spec, initial or [], cursor)

    def activate(self, spec: IslandSpec, initial: list[FragmentUpdate], cursor: Any = 0) -> tuple[int, int]:
        """`cursor`: an islands.cursor.DataCursor (or a batch count) the island's data resumes at."""
        """Become island `spec.island`, incarnation `spec.incarnation`, and start training."""
        if self._island is not None:
            raise RuntimeError(f"this process already is island {self._island.spec.island}; it cannot be activated twice")
        quiet_worker(f"island {spec.island}")  # its console lines now say which island, not "warm spare"
        import torch

        from islands.distributed import WorkerGroup, backend_for
        from islands.island_kinds import island_for

        torch.set_num_threads(spec.inner.torch_threads)  # the process is this island's alone
        group = self._group = None
        if spec.workers > 1:  # rank 0 hosts the rendezvous on its node; followers get `rendezvous()`
            group = self._group = WorkerGroup(rank=0, world_size=spec.workers, addr=ray.util.get_node_ip_address(),
                                              backend=backend_for(spec.accelerator))
        shelve = _Shelver(spec) if spec.keeper is not None and spec.salvage_every_steps > 0 else None
        self._island = island_for(spec, self._data, initial, cursor=cursor, resolve=ray.get, group=group, shelve=shelve)
        self._island.start()
        return spec.island, spec.incarnation

    def rendezvous(self) -> tuple[str, int]:
        """(address, port) where this island's followers join its process group (islands of several workers)."""
        if self._group is None:
            raise RuntimeError(f"island {self._live().spec.island} has one worker; it has no process group to join")
        return self._group.addr, self._group.port

    def _live(self) -> LearnerIsland:
        if self._island is None:
            raise RuntimeError("this island process is a spare and has not been activated")
        return self._island

    def ping(self) -> tuple[int | None, int | None, float]:
        """Liveness probe: (island, incarnation, wall time); (None, None, t) for a spare."""
        if self._island is None:
            return None, None, time.time()
        return self._island.spec.island, self._island.spec.incarnation, time.time()

    def node_id(self) -> str:
        """The Ray node this process runs on (placement checks)."""
        return ray.get_runtime_context().get_node_id()

    def placement_group_id(self) -> str | None:
        """The id (hex) of the placement group this process runs in (placement checks)."""
        return placement_group_id()

    # The island's interface, delegated (see islands.island.LearnerIsland for each method).
    def next_submission(self, timeout_s: float = 1.0):
        return self._live().next_submission(timeout_s)

    def adopt(self, update: FragmentUpdate) -> None:
        self._live().adopt(update)

    def status(self):
        return self._live().status()

    def stop(self, timeout_s: float = 30.0, flush: bool = False):
        return self._live().stop(timeout_s, flush)

    def watch(self, timeout_s: float = 5.0) -> str:
        return self._live().watch(timeout_s)

    def inject(self, kind: str, *, duration_s: float = 0.0, factor: float = 1.0) -> None:
        self._live().inject(kind, duration_s=duration_s, factor=factor)

    def resync(self, latest: list[FragmentUpdate]) -> None:
        self._live().resync(latest)

    def parameters(self) -> dict:
        return self._live().parameters()


class _IslandWorker:
    """Rank `rank` >= 1 of an island of several workers: a follower that mirrors its leader, or in an FSDP
    island (`spec.shard == "fsdp"`) a LearnerIsland over its 1/W of the model that the leader paces.

    Created by the health monitor on bundle `rank` of the island's placement group once the leader
    says where to join. If its loop fails (the leader died, a collective timed out) the process ends,
    so the rest of the island fails at once too: the island is one failure domain, rebuilt whole.
    """

    def __init__(self, spec: IslandSpec, data: list[Any], rank: int, addr: str, port: int) -> None:
        quiet_worker(f"island {spec.island} worker {rank}")
        import torch

        from islands.distributed import WorkerGroup, backend_for
        from islands.follower import IslandFollower
        from islands.sharded_island import ShardedIsland

        torch.set_num_threads(spec.inner.torch_threads)
        self.spec, self.rank = spec, rank
        group = WorkerGroup(rank=rank, world_size=spec.workers, addr=addr, port=port, backend=backend_for(spec.accelerator))
        self._follower: IslandFollower | ShardedIsland
        if spec.shard == "fsdp":  # the leader sends the initial versions, as its part of each, at the first boundary
            self._follower = ShardedIsland(spec, ray.get(data[0]), [], group=group)
        else:
            self._follower = IslandFollower(
                model=spec.model, inner=spec.inner, plan=spec.plan, data=ray.get(data[0]),
                shard_index=spec.island, num_shards=spec.num_islands, seed=spec.seed, group=group, pool=spec.pool,
            )
        self._thread = threading.Thread(target=self._run, name=f"island-{spec.island}-w{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._follower.run()
        state = self._follower.watch(0)
        if state in ENDED_BADLY:
            logging.getLogger(__name__).error("island %d worker %d ends its process: %s", self.spec.island, self.rank,
                                              getattr(self._follower, "error", None) or self._follower.status().error)
            os._exit(1)  # one failure domain: take the island's collectives down with us

    def ping(self) -> tuple[int, int, int, float]:
        """Liveness probe: (island, incarnation, rank, wall time)."""
        return self.spec.island, self.spec.incarnation, self.rank, time.time()

    def node_id(self) -> str:
        """The Ray node this process runs on (placement checks)."""
        return ray.get_runtime_context().get_node_id()

    def placement_group_id(self) -> str | None:
        """The id (hex) of the placement group this process runs in (placement checks)."""
        return placement_group_id()

    def watch(self, timeout_s: float = 5.0) -> str:
        """Wait up to `timeout_s` for the follower loop to end; returns its state."""
        self._thread.join(timeout_s)
        return self._follower.watch(0)

    def steps(self) -> int:
        """Inner steps this worker has taken."""
        f = self._follower
        return f.status().steps if self.spec.shard == "fsdp" else f.steps

    def parameters(self) -> dict:
        """A copy of this worker's parameters (tests: every worker of an island holds the same ones)."""
        return self._follower.parameters()
