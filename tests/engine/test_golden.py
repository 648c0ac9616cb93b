"""Golden tests: degenerate settings of the engine reproduce known algorithms (docs/architecture.md section 3).

The engine side is the real LearnerIsland and OuterOptimizer, stepped in process. The reference
side is written here from the papers' update rules, sharing only the model definition and the data
batches (which are inputs, not algorithm): M AdamW replicas, H inner steps each, then
  synchronous DiLoCo: Delta = mean_m(Theta - theta_m); buf = mu*buf + Delta; Theta -= lr*(Delta + mu*buf)
  FedAvg:             Theta = mean_m(theta_m)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from islands.data import ShardSampler
from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

M, H, ROUNDS, SEED = 3, 4, 3, 7
INNER = inner_from_config(lr=1e-2, weight_decay=0.0, warmup_steps=0, grad_clip=None, batch_size=4)


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    rng = np.random.default_rng(0)
    # Skewed bytes so that training has something to learn.
    return rng.choice(256, size=60_000, p=np.r_[np.full(16, 0.05), np.full(240, 0.2 / 240)]).astype(np.uint8)


def run_engine(data: np.ndarray, *, lr: float, momentum: float) -> tuple[dict, list[dict]]:
    """Synchronous DiLoCo through the engine: K = M, unbounded grace, uniform, mean, P = 1, overwrite."""
    cfg = model_config("nano")
    model = build_model(cfg, seed=SEED)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 1)
    settings = outer_from_config(min_quorum=M, grace_gamma=float("inf"), grace_cap_s=float("inf"), weighting="uniform",
                                 merge_rule="mean", lr=lr, momentum=momentum)
    outer = OuterOptimizer(init, plan, settings=settings, embedding_names=model.embedding_parameter_names())
    latest = [FragmentUpdate(0, 0, [outer.fragment(0)])]
    islands = []
    for m in range(M):
        spec = spec_from_config(island=m, incarnation=1, pool="p", num_islands=M, model_config=cfg, plan=plan,
                                inner=INNER, sync_every_steps=H, wait_for_round=True, seed=SEED, adoption="overwrite")
        islands.append(LearnerIsland(spec, data, latest))
        outer.register(m, 1)
    for _ in range(ROUNDS):
        results = []
        for isl in islands:
            while isl.step():  # trains H steps, then blocks on its in-flight submission
                pass
            sub = isl.next_submission(0)
            assert sub is not None and sub.inner_steps == H
            got, refusal = outer.receive(sub, now=0.0)
            assert refusal is None
            results += got
        assert len(results) == 1, "the round must close exactly when the last island submits"
        r = results[0]
        for isl in islands:
            isl.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
            isl.step()  # applies the update at the step boundary (and takes the next round's first step)
    return outer.global_parameters(), islands


def run_reference(data: np.ndarray, *, lr: float, momentum: float, fedavg: bool = False) -> dict:
    cfg = model_config("nano")
    global_ = {n: p.detach().clone() for n, p in build_model(cfg, seed=SEED).named_parameters()}
    replicas = [build_model(cfg, seed=SEED) for _ in range(M)]
    opts = [torch.optim.AdamW(r.parameters(), lr=INNER.lr, betas=(INNER.beta1, INNER.beta2), weight_decay=0.0)
            for r in replicas]
    samplers = [ShardSampler(data, shard_index=m, num_shards=M, seq_len=cfg.seq_len, batch_size=INNER.batch_size,
                             seed=SEED) for m in range(M)]
    buf = {n: torch.zeros_like(t) for n, t in global_.items()}
    for _ in range(ROUNDS):
        for r, opt, s in zip(replicas, opts, samplers):
            with torch.no_grad():
                for n, p in r.named_parameters():
                    p.copy_(global_[n])
            for _ in range(H):
                x, y = s.next_batch()
                r.loss(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n in global_:
                thetas = [dict(r.named_parameters())[n].detach() for r in replicas]
                # Accumulate in the order an implementation of "weighted mean with w = 1/M" must
                # (zeros, then += w*x per island), so float32 rounding is the same and equality is exact.
                if fedavg:
                    mean = torch.zeros_like(global_[n])
                    for t in thetas:
                        mean.add_(global_[n] - t, alpha=1.0 / M)
                    global_[n] = global_[n].add(mean, alpha=-1.0)  # FedAvg: Theta - mean(Theta - theta_m) = mean(theta_m)
                    continue
                delta = torch.zeros_like(global_[n])
                for t in thetas:
                    delta.add_(global_[n] - t, alpha=1.0 / M)
                # buf = mu*buf + Delta; Theta -= lr*(Delta + mu*buf), written with fused add(alpha=) so
                # float32 rounding matches any implementation that uses torch's primitives.
                buf[n] = buf[n].mul(momentum).add(delta)
                global_[n] = global_[n].add(delta.add(buf[n], alpha=momentum) if momentum else delta, alpha=-lr)
    return global_


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_sync_diloco_matches_reference(data):
    engine, _ = run_engine(data, lr=0.7, momentum=0.9)
    reference = run_reference(data, lr=0.7, momentum=0.9)
    start = {n: p.detach() for n, p in build_model(model_config("nano"), seed=SEED).named_parameters()}
    assert _max_diff(engine, start) > 1e-3, "training must move the parameters for the comparison to mean anything"
    assert _max_diff(engine, reference) == 0.0


def test_fedavg_matches_reference(data):
    engine, _ = run_engine(data, lr=1.0, momentum=0.0)
    reference = run_reference(data, lr=1.0, momentum=0.0, fedavg=True)
    assert _max_diff(engine, reference) == 0.0
    # And it is not the Nesterov result: the two degenerate settings are told apart.
    assert _max_diff(engine, run_reference(data, lr=0.7, momentum=0.9)) > 1e-4


def test_islands_bitwise_identical_after_sync_round(data):
    cfg = model_config("nano")
    model = build_model(cfg, seed=SEED)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 1)
    outer = OuterOptimizer(init, plan, settings=outer_from_config(min_quorum=M, grace_gamma=float("inf"),
                           grace_cap_s=float("inf"), weighting="uniform", merge_rule="mean"))
    isl = []
    for m in range(M):
        spec = spec_from_config(island=m, incarnation=1, pool="p", num_islands=M, model_config=cfg, plan=plan, inner=INNER,
                                sync_every_steps=H, wait_for_round=True, seed=SEED, adoption="overwrite")
        isl.append(LearnerIsland(spec, data, [FragmentUpdate(0, 0, [outer.fragment(0)])]))
        outer.register(m, 1)
    results = []
    for i in isl:
        while i.step():
            pass
        results += outer.receive(i.next_submission(0), now=0.0)[0]
    before = [i.parameters() for i in isl]
    assert any(_max_diff(before[0], b) > 0 for b in before[1:]), "islands diverge during local steps"
    r = results[0]
    for i in isl:
        i.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
        i.apply_updates()
    # After the synchronous round every island holds bitwise-identical parameters, equal to the global ones.
    params = [i.parameters() for i in isl]
    glob = outer.global_parameters()
    for p in params:
        for n in glob:
            assert torch.equal(p[n], glob[n])
