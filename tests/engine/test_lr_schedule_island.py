"""An island's inner learning rate follows the run progress its published fragments carry.

A real LearnerIsland over the real OuterOptimizer core, stepped in process (no Ray). The reference for
the rate is the cosine written out here; the reference for what AdamW applied is the optimizer's own
param group after the step.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from islands.island import LearnerIsland
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

PEAK, FINAL, WARMUP = 1e-2, 0.2, 2


def cosine(progress: float) -> float:
    return PEAK * (FINAL + (1 - FINAL) * (1 + math.cos(math.pi * min(progress, 1.0))) / 2)


def island(schedule: str = "cosine", initial_progress: float | None = None):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0))
    inner = inner_from_config(lr=PEAK, warmup_steps=WARMUP, batch_size=2, lr_schedule=schedule, lr_final_ratio=FINAL)
    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=1, model_config=w.cfg, plan=w.plan, inner=inner,
                            sync_every_steps=8, seed=1, adoption="rebase")
    latest = [dataclasses.replace(u, progress=initial_progress) for u in w.latest]
    return w, LearnerIsland(spec, w.data, latest)


def applied_lr(isl: LearnerIsland) -> float:
    return isl.trainer.optimizer.param_groups[0]["lr"]


def test_the_rate_follows_the_progress_published_fragments_carry_and_never_rises_again():
    w, isl = island()
    assert isl.status().lr == pytest.approx(PEAK / WARMUP)  # step 0 of the warmup, progress 0 (latest() had none)
    for _ in range(WARMUP):
        isl.step()
    assert applied_lr(isl) == pytest.approx(PEAK)  # warmed up, no progress heard: the peak

    # A published version says the run is 60% through its budget: the next step runs at the cosine's rate there.
    isl.adopt(dataclasses.replace(w.latest[0], version=1, progress=0.6))
    assert isl.status().lr == pytest.approx(PEAK)  # applied at the next step boundary, not on receipt
    isl.step()
    assert applied_lr(isl) == pytest.approx(cosine(0.6)) and isl.status().lr == pytest.approx(cosine(0.6))

    # A late update with older progress (another fragment's version published earlier) does not raise it back.
    isl.adopt(dataclasses.replace(w.latest[1], version=1, progress=0.3))
    isl.step()
    assert applied_lr(isl) == pytest.approx(cosine(0.6))
    # Past the budget (the last steps before the driver stops the run) it holds the final rate.
    isl.adopt(dataclasses.replace(w.latest[0], version=2, progress=1.02))
    isl.step()
    assert applied_lr(isl) == pytest.approx(PEAK * FINAL)


def test_a_restarted_island_warms_up_to_the_decayed_rate_and_constant_ignores_progress():
    _, late = island(initial_progress=0.5)  # a new incarnation built from latest() half way through the run
    late.step()
    assert applied_lr(late) == pytest.approx(cosine(0.5) / WARMUP)
    late.step()
    assert applied_lr(late) == pytest.approx(cosine(0.5))

    w, flat = island(schedule="constant", initial_progress=0.9)
    for _ in range(WARMUP + 1):
        flat.step()
    assert applied_lr(flat) == pytest.approx(PEAK) and flat.trainer.progress == 0.9
