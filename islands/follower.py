"""IslandFollower: worker rank r >= 1 of a data-parallel island, mirroring its leader step for step.

The leader (islands/island.py `LearnerIsland`, rank 0) keeps the island's whole control interface;
a follower only trains: it joins the island's worker group (islands/distributed.py), takes the
leader's parameters, then at every step boundary copies in what the leader adopted and steps when
the leader steps. Imports point one way: follower -> trainer -> distributed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from islands.cursor import DataCursor
from islands.distributed import WorkerGroup
from islands.spec import ModelRecipe
from islands.trainer import InnerSettings, InnerTrainer
from policies.fragments import FragmentPlan
from policies.island_states import IslandState

log = logging.getLogger(__name__)


class IslandFollower:
    """Worker rank r >= 1 of an island: a model replica that mirrors the leader step for step.

    A plain class: the Ray shell (orchestrator/actors/remote.py `_IslandWorker`) runs `run` in a thread.
    It starts from the leader's parameters (broadcast once after joining), adopts what the leader
    adopts, and steps when the leader steps; any collective error ends the loop with `state` =
    "failed", which the shell turns into the end of its process (so the leader fails at once too).
    """

    def __init__(self, *, model: ModelRecipe, inner: InnerSettings, plan: FragmentPlan, data: Any,
                 shard_index: int, num_shards: int, seed: int, group: WorkerGroup, pool: str | None = None) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 is the island's leader (LearnerIsland); followers have rank >= 1")
        self.group = group
        self.trainer = InnerTrainer(model, data, settings=inner, shard_index=shard_index,
                                    num_shards=num_shards, seed=seed, group=group, device=group.device, pool=pool)
        self._fragments = [[self.trainer.params[n] for n in frag] for frag in plan.fragments]
        self.state = IslandState.STARTING  # then TRAINING, then STOPPED or FAILED
        self.error: str | None = None
        self.steps = 0
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        """Join, take the leader's parameters, then mirror it until it says stop; record a failure instead of raising."""
        try:
            self.group.connect()
            self.group.broadcast_([t for frag in self._fragments for t in frag])
            self.trainer.sampler.seek(DataCursor(*self.group.share_cursor(self.trainer.sampler.data_cursor)))
            self.state = IslandState.TRAINING
            while True:
                control = self.group.follow(self._fragments)
                if control.stop:
                    break
                if control.train:
                    self.trainer.progress = control.progress
                    self.trainer.step()
                    self.steps += 1
        except Exception as err:  # noqa: BLE001 - reported through `state`/`error`; the shell ends the process
            self.state, self.error = IslandState.FAILED, f"{type(err).__name__}: {err}"
            log.error("island worker rank %d stopped: %s", self.group.rank, self.error)
            return
        self.group.close()
        self.state = IslandState.STOPPED

    def start(self) -> None:
        """Run the follower loop in a background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name=f"island-worker-{self.group.rank}", daemon=True)
            self._thread.start()

    def watch(self, timeout_s: float = 5.0) -> str:
        """Wait up to `timeout_s` for the loop to end; returns the state."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.state

    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this worker's parameters by name (tests: workers hold identical parameters)."""
        return {n: p.detach().cpu().clone() for n, p in self.trainer.params.items()}
