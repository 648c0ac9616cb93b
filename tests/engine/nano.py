"""The small in-process world engine tests build on: the nano model in two fragments, a real
OuterOptimizer core over it, its version-0 fragments as updates, and a random byte corpus."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from islands.messages import FragmentUpdate, Submission
from islands.model import build_model, model_config
from islands.spec import ModelConfig
from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings
from policies.compression import compress
from policies.fragments import FragmentPlan, plan_fragments


@dataclass
class NanoWorld:
    """What an in-process island and its outer optimizer need (see `nano_world`)."""

    cfg: ModelConfig
    plan: FragmentPlan
    outer: OuterOptimizer
    latest: list[FragmentUpdate]
    data: np.ndarray


def nano_world(settings: OuterSettings) -> NanoWorld:
    """The nano model (seed 1) planned in 2 fragments, an outer optimizer with `settings`, its latest()."""
    cfg = model_config("nano")
    model = build_model(cfg, seed=1)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    outer = OuterOptimizer(init, plan, settings=settings, embedding_names=model.embedding_parameter_names())
    latest = [FragmentUpdate(p, 0, [outer.fragment(p)]) for p in range(2)]
    data = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint8)
    return NanoWorld(cfg, plan, outer, latest, data)


def feed_rounds(core: OuterOptimizer, rounds: int, seed: int = 0, start: int = 0) -> int:
    """Each registered island submits every fragment in each of rounds `start`..`start + rounds - 1` (a shared
    direction, 0.05 of the parameters, plus seeded noise), every submission accepted; returns the tokens sent."""
    gen = torch.Generator().manual_seed(seed)
    sent = 0
    for r in range(start, start + rounds):
        for island in sorted(core.islands):
            for p, frag in enumerate(core.params):
                deltas = [0.05 * t + 0.01 * torch.randn(t.shape, generator=gen) for t in frag]
                sub = Submission(island=island, incarnation=1, seq=r * 10 + p, fragment=p,
                                 base_version=core.versions[p], tokens=1000, inner_steps=40, step_time_s=0.1,
                                 train_loss=3.0, payload=[compress(d, "none") for d in deltas])
                _, refusal = core.receive(sub, now=float(r))
                assert refusal is None, refusal.reason
                sent += 1000
    return sent
