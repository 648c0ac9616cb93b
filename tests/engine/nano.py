"""The small in-process world engine tests build on: the nano model in two fragments, a real
OuterOptimizer core over it, its version-0 fragments as updates, and a random byte corpus."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from islands.spec import ModelConfig
from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings
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
