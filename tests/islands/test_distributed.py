"""Data parallel inside an island (islands/distributed.py), without Ray: two real processes, gloo on localhost.

Golden checks against a single process written here from torch primitives: the averaged gradient
of the two workers equals the gradient of the mean loss over both batches concatenated, and one
data-parallel step equals one AdamW step on that batch (AdamW's first step barely depends on the
gradient's scale, so the gradient is checked on its own). Then the leader changes a fragment (as an
adoption would) and hears of later run progress (its cosine learning rate decays), and the follower
must hold the same parameters, bit for bit, after the next step and a clean stop.
"""

from __future__ import annotations

import math
import multiprocessing as mp

import numpy as np
import pytest
import torch

from islands.builtin import as_recipe
from islands.data import ShardSampler
from islands.distributed import WorkerGroup
from islands.follower import IslandFollower
from islands.model import build_model, model_config
from islands.trainer import InnerTrainer
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config

SEED, SHARD, SHARDS = 7, 1, 3
INNER = inner_from_config(lr=1e-2, weight_decay=0.01, warmup_steps=0, grad_clip=1.0, batch_size=4, lr_schedule="cosine",
                          lr_final_ratio=0.1)  # at progress 0 the cosine is the peak, so step 1's reference is plain AdamW
PROGRESS = 0.7  # what the leader heard before its second step
CFG = model_config("nano")


def make_data() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.choice(256, size=30_000, p=np.r_[np.full(16, 0.05), np.full(240, 0.2 / 240)]).astype(np.uint8)


def plan():
    model = build_model(CFG, seed=SEED)
    return plan_fragments([(n, p.numel() * 4) for n, p in model.named_parameters()], 2)


def _numpy(params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    # Plain arrays through the queue: tensors would travel as shared memory that dies with the child.
    return {n: p.detach().numpy().copy() for n, p in params.items()}


def _averaged_gradients(trainer: InnerTrainer, group: WorkerGroup) -> dict[str, np.ndarray]:
    x, y = trainer.sampler.batch_at(group.rank)  # island step 0: batch 0*W + rank
    loss = trainer.model.loss(x, y)
    loss.backward()
    group.average_gradients(trainer.model.parameters(), loss)
    grads = {n: p.grad.numpy().copy() for n, p in trainer.params.items()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def _leader(ports, out) -> None:
    torch.set_num_threads(1)
    group = WorkerGroup(rank=0, world_size=2, addr="127.0.0.1", timeout_s=60)
    ports.put(group.port)
    trainer = InnerTrainer(CFG, make_data(), settings=INNER, shard_index=SHARD, num_shards=SHARDS, seed=SEED, group=group)
    fragments = [[trainer.params[n] for n in frag] for frag in plan().fragments]
    group.connect()
    out.put(("grads0", _averaged_gradients(trainer, group)))
    group.broadcast_([t for frag in fragments for t in frag])  # as LearnerIsland.run does
    group.share_cursor(trainer.sampler.data_cursor)  # ... and where the data stands
    group.lead(fragments, changed=[], train=True)  # as LearnerIsland.step does at every step boundary
    result = trainer.step()
    out.put(("step1", _numpy(trainer.params), result.loss, result.tokens, trainer.sampler.cursor))
    with torch.no_grad():  # an adoption on the leader: fragment 1 changes, the follower must copy it
        for t in fragments[1]:
            t.mul_(0.5)
    trainer.progress = PROGRESS  # ... and the adopted version carried the run's progress
    group.lead(fragments, changed=[1], train=True, progress=trainer.progress)
    trainer.step()
    group.lead(fragments, changed=[], train=False)  # a blocked boundary: no step
    group.lead(fragments, changed=[], train=False, stop=True)
    group.close()
    out.put(("leader", _numpy(trainer.params), trainer.steps, trainer.optimizer.param_groups[0]["lr"]))


def _follower(port, out) -> None:
    torch.set_num_threads(1)
    group = WorkerGroup(rank=1, world_size=2, addr="127.0.0.1", port=port, timeout_s=60)
    follower = IslandFollower(model=as_recipe(CFG, seed=SEED), inner=INNER, plan=plan(), data=make_data(), shard_index=SHARD,
                              num_shards=SHARDS, seed=SEED, group=group)
    group.connect()  # early, for the gradient check; run() finds it connected
    out.put(("grads1", _averaged_gradients(follower.trainer, group)))
    follower.run()
    out.put(("follower", _numpy(follower.parameters()), follower.steps, follower.state,
             follower.trainer.optimizer.param_groups[0]["lr"]))


def reference_step() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """Gradient and one AdamW step of one process on the two workers' batches (c*W + r, c = 0) concatenated."""
    model = build_model(CFG, seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER.lr, betas=(INNER.beta1, INNER.beta2),
                            weight_decay=INNER.weight_decay)
    sampler = ShardSampler(make_data(), shard_index=SHARD, num_shards=SHARDS, seq_len=CFG.seq_len,
                           batch_size=INNER.batch_size, seed=SEED)
    (x0, y0), (x1, y1) = sampler.batch_at(0), sampler.batch_at(1)
    loss = model.loss(torch.cat([x0, x1]), torch.cat([y0, y1]))  # mean over all 2B sequences
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), INNER.grad_clip)
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, float(loss.detach())


def test_two_workers_step_like_one_process_on_both_batches_and_stay_identical():
    ctx = mp.get_context("spawn")  # not fork: the test process may hold Ray's threads
    ports, out = ctx.Queue(), ctx.Queue()
    leader = ctx.Process(target=_leader, args=(ports, out), daemon=True)
    leader.start()
    follower = ctx.Process(target=_follower, args=(ports.get(timeout=120), out), daemon=True)
    follower.start()
    got = {}
    for _ in range(5):
        item = out.get(timeout=120)
        got[item[0]] = item[1:]
    leader.join(30)
    follower.join(30)
    assert leader.exitcode == 0 and follower.exitcode == 0

    params1, loss1, tokens1, cursor1 = got["step1"]
    ref_grads, ref, ref_loss = reference_step()
    for n, g in ref_grads.items():
        torch.testing.assert_close(torch.from_numpy(got["grads0"][0][n]), g, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        assert np.array_equal(got["grads0"][0][n], got["grads1"][0][n]), f"{n}: workers hold different averaged gradients"
    assert tokens1 == 2 * INNER.batch_size * CFG.seq_len, "an island step counts every worker's tokens"
    assert cursor1 == 1, "the cursor counts island steps, not batches"
    assert loss1 == pytest.approx(ref_loss, abs=1e-6), "the reported loss is the island's mean loss"
    assert ref.keys() == params1.keys()
    init = dict(build_model(CFG, seed=SEED).named_parameters())
    for n, p in ref.items():
        assert not torch.equal(p, init[n].detach()), f"{n} did not move: the check would be vacuous"
        torch.testing.assert_close(torch.from_numpy(params1[n]), p, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")

    lead_params, lead_steps, lead_lr = got["leader"]
    foll_params, foll_steps, state, foll_lr = got["follower"]
    assert state == "stopped" and lead_steps == foll_steps == 2
    # The second step ran at the decayed rate on both workers (a follower at the peak would drift apart).
    assert lead_lr == foll_lr == pytest.approx(INNER.lr * (0.1 + 0.9 * (1 + math.cos(math.pi * PROGRESS)) / 2))
    for n in lead_params:
        assert np.array_equal(lead_params[n], foll_params[n]), f"{n} differs between the workers"


def test_worker_group_says_what_is_wrong():
    with pytest.raises(ValueError, match="needs the leader's port"):
        WorkerGroup(rank=1, world_size=2, addr="127.0.0.1")
    with pytest.raises(ValueError, match="at least 2 workers"):
        WorkerGroup(rank=0, world_size=1, addr="127.0.0.1")
    with pytest.raises(ValueError, match="backend"):
        WorkerGroup(rank=0, world_size=2, addr="127.0.0.1", backend="mpi")
