"""One torchft replica group running torchft's own DiLoCo on this project's model, data and inner step.

A program, as a torchft user's training script is: `python benchmarks/torchft_replica.py SETTINGS.pkl SLOT
INCARNATION`, started (and, under a fault tape, killed and started again) by `torchft_run.py`. It builds
the run's model and inner AdamW exactly as an island does (`islands.trainer.InnerTrainer`: the same recipe
and seed, shard SLOT of M, batch, warmup, lr schedule, clip), wraps that optimizer in
`torchft.local_sgd.DiLoCo` with a `torchft.Manager` (its lighthouse, its own TCPStore, `ProcessGroupGloo`)
and steps until the run's outer step count. Nothing of the algorithm is ours: quorum, pseudo-gradients,
all-reduce, outer Nesterov SGD, commit, healing from a peer are torchft's.

What this file adds, all outside torchft's code path:
- the EMULATED wide-area all-reduce: `EmulatedWanManager.allreduce` sleeps the network model's ring
  all-reduce time of the tensor among the replica groups' regions before torchft's real (local gloo)
  all-reduce; DiLoCo runs with `use_bucketization=True`, so one sync is one all-reduce of the whole model;
- the EMULATED slow pool: after each inner step the replica sleeps (slowdown - 1) x its compute, timed
  without the sync (optimizer hooks around DiLoCo's own), as `InnerTrainer` paces an island;
- records: one JSON line per sync (`records-r<slot>-i<incarnation>.jsonl`), the inner steps taken so far
  (`steps-r<slot>-i<incarnation>`, so a killed incarnation's unsynced steps are counted), and the committed global
  parameters (`params-s<step>-n<participants>-r<slot>.pt`, written by the replica of participating rank 0) for the driver to score.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica group of one torchft run reads (pickled by the driver)."""

    run_dir: str
    lighthouse: str  # the lighthouse's address
    num_replicas: int  # M: replica groups, one per island slot of the config, and data shards
    recipe: Any  # the run's ModelRecipe (orchestrator.run.workload.run_recipe)
    inner: Any  # the run's InnerSettings (orchestrator.settings.inner_settings), emulation off
    seed: int
    train_path: str  # the training tokens as .npy
    sync_every: int  # H
    outer_lr: float
    outer_momentum: float
    outer_steps: int  # torchft's manager steps (syncs committed) after which every replica stops
    token_budget: int  # for the lr schedule's progress only
    allreduce_s: list[float]  # EMULATED seconds of one whole-model all-reduce with n = 1..M participants
    slowdown: list[float]  # per slot: EMULATED pool slowdown (1.0 = none)
    timeout_s: float  # torchft Manager / gloo timeout
    quorum_timeout_s: float


class EmulatedWanManager:
    """Builds a `torchft.manager.Manager` whose `allreduce` first sleeps the EMULATED WAN time (see module doc)."""

    @staticmethod
    def build(allreduce_s: list[float], total_bytes: int, **kwargs: Any):
        from torchft.manager import Manager

        class _Manager(Manager):
            def allreduce(self, tensor, *args, **kw):  # type: ignore[override]
                if not self.errored():
                    self.wait_quorum()
                    n = max(1, self.num_participants())
                    share = tensor.numel() * tensor.element_size() / total_bytes
                    delay = allreduce_s[min(n, len(allreduce_s)) - 1] * share
                    if delay > 0:
                        time.sleep(delay)  # EMULATED wide-area all-reduce
                return super().allreduce(tensor, *args, **kw)

        return _Manager(**kwargs)


def main(argv: list[str]) -> int:
    """Run replica group SLOT (incarnation INCARNATION) until the run's outer step count."""
    settings_path, slot, incarnation = argv[0], int(argv[1]), int(argv[2])
    with open(settings_path, "rb") as f:
        s: ReplicaSettings = pickle.load(f)
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from islands.trainer import InnerTrainer

    torch.set_num_threads(s.inner.torch_threads)
    run_dir = Path(s.run_dir)
    trainer = InnerTrainer(s.recipe, np.load(s.train_path), settings=s.inner, shard_index=slot,
                           num_shards=s.num_replicas, seed=s.seed)
    model, inner = trainer.model, trainer.optimizer
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "cursor": trainer.sampler.cursor}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        # Healing takes a peer's state: its cursor counts the same steps, so this shard resumes where its replica would be.
        trainer.sampler.load_state_dict({**trainer.sampler.state_dict(), "cursor": state["cursor"]})

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = EmulatedWanManager.build(
        s.allreduce_s, total_bytes,
        pg=ProcessGroupGloo(timeout=timedelta(seconds=s.timeout_s)), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=1, use_async_quorum=False, store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=s.lighthouse, replica_id=f"rg{slot}",
        timeout=timedelta(seconds=s.timeout_s), quorum_timeout=timedelta(seconds=s.quorum_timeout_s),
        connect_timeout=timedelta(seconds=s.timeout_s), init_sync=False)
    # P = 1, as our sync-diloco mode: the whole model is one fragment, synced every H inner steps.
    outer = torch.optim.SGD(model.parameters(), lr=s.outer_lr, momentum=s.outer_momentum, nesterov=True)
    slowdown = s.slowdown[slot]
    marks: dict[str, float] = {}
    # Around DiLoCo's own step hook: "pre" when the inner step's compute is done, "post" after DiLoCo's sync.
    hooks = [inner.register_step_post_hook(lambda *a: marks.__setitem__("pre", time.perf_counter()))]
    records = open(run_dir / f"records-r{slot}-i{incarnation}.jsonl", "a", buffering=1)
    counter = open(run_dir / f"steps-r{slot}-i{incarnation}", "w")  # inner steps so far, rewritten every step
    (run_dir / f"ready-r{slot}-i{incarnation}").touch()
    go = run_dir / "go"
    while not go.exists():  # the first replica groups start together: the driver's clock starts at `go`
        time.sleep(0.05)
    losses: list[float] = []
    t_start = time.time()
    with DiLoCo(manager, [model], inner, outer, sync_every=s.sync_every, use_bucketization=True) as diloco:
        hooks.append(inner.register_step_post_hook(lambda *a: marks.__setitem__("post", time.perf_counter())))
        while manager.current_step() < s.outer_steps:
            before = manager.current_step()
            # The lr schedule's run progress (cosine), as the outer optimizer tells islands: tokens merged / budget.
            trainer.progress = min(1.0, before * s.num_replicas * s.sync_every * s.inner.batch_size * s.recipe.seq_len
                                   / s.token_budget)
            result = trainer.step()
            losses.append(result.loss)
            counter.seek(0)
            counter.write(f"{trainer.steps:12d}")
            counter.flush()
            sync_s = marks.get("post", 0.0) - marks.get("pre", 0.0)
            if slowdown > 1.0:  # EMULATED slow pool: stretch the compute, not the sync
                time.sleep((result.compute_s - sync_s) * (slowdown - 1.0))
            if diloco._local_step == 0:  # a fragment was just synced (committed or not)
                after = manager.current_step()
                rank = manager.participating_rank()
                rec = {"slot": slot, "incarnation": incarnation, "t": time.time(), "step": after, "committed": after > before,
                       "participants": manager.num_participants(), "rank": rank, "inner_steps": trainer.steps,
                       "sync_s": sync_s, "losses": losses}
                if after > before and rank == 0:
                    # Named by participants too: a group left out of a quorum can commit the same step alone (split
                    # brain at the end of a run, seen with a slow pool); the driver scores the step's largest quorum.
                    tmp = run_dir / f".params-s{after}-r{slot}.tmp"
                    torch.save({n: p.detach().clone() for n, p in model.state_dict().items()}, tmp)
                    os.replace(tmp, run_dir / f"params-s{after}-n{manager.num_participants()}-r{slot}.pt")
                records.write(json.dumps(rec) + "\n")
                losses = []
    for h in hooks:
        h.remove()
    records.write(json.dumps({"slot": slot, "incarnation": incarnation, "t": time.time(), "done": True,
                              "step": manager.current_step(), "inner_steps": trainer.steps, "wall_s": time.time() - t_start}) + "\n")
    records.close()
    counter.close()
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
