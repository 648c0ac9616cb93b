"""The worked merge rule examples/extending/trimmed_mean.py against the default: one crafted bad island among the
default run's four moves the default merge (rda) and the plain mean, not the trimmed mean, whose result is worked
out here by hand. Through the real outer optimizer core, named by its import path in the config (no Ray). How it
trains through islands, resumes from a checkpoint and refuses what does not load: tests/plugins."""

from __future__ import annotations

import pytest
import torch

from examples.extending.trimmed_mean import TrimmedMean
from islands.messages import Submission
from islands.plugins import load_merge_rule
from orchestrator.config import load_config
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress
from policies.fragments import plan_fragments
from tests.from_config import outer_from_config

RULE = "examples.extending.trimmed_mean:TrimmedMean"
HONEST = [[torch.tensor([0.10, 0.20, 0.30, 0.40]), torch.tensor([0.050, -0.050])],
          [torch.tensor([0.15, 0.25, 0.25, 0.45]), torch.tensor([0.025, -0.025])],
          [torch.tensor([0.12, 0.22, 0.28, 0.41]), torch.tensor([0.030, -0.040])]]
# The bad island: its outer gradient 100 times an honest one and sign-flipped in two coordinates.
BAD = [torch.tensor([10.0, -20.0, 30.0, -40.0]), torch.tensor([-5.0, 5.0])]
# By hand: per coordinate of the four values, drop the largest and the smallest, average the middle two.
#   w: [0.10 0.15 0.12 10] -> (0.12 + 0.15) / 2; [0.20 0.25 0.22 -20] -> (0.20 + 0.22) / 2;
#      [0.30 0.25 0.28 30] -> (0.28 + 0.30) / 2; [0.40 0.45 0.41 -40] -> (0.40 + 0.41) / 2
#   b: [0.050 0.025 0.030 -5] -> (0.025 + 0.030) / 2; [-0.050 -0.025 -0.040 5] -> (-0.040 - 0.025) / 2
TRIMMED = [[0.135, 0.21, 0.29, 0.405], [0.0275, -0.0325]]


def _round(rule: str, deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """One full round of a fresh core (global parameters zero, plain step: lr 1, no momentum, so the new
    fragment is minus the merged outer gradient) over `deltas`, one island each, merged by `rule`."""
    cfg = {"outer": {"merge_rule": rule, "lr": 1.0, "momentum": 0.0, "partial_momentum": 0.0}}
    init = {"w": torch.zeros(4), "b": torch.zeros(2)}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 1)
    core = OuterOptimizer(init, plan, settings=outer_from_config(cfg, min_quorum=len(deltas), grace_gamma=0.0,
                                                                 grace_cap_s=0.0))
    for island in range(len(deltas)):
        core.register(island, 1)
    for island, ds in enumerate(deltas):
        sub = Submission(island=island, incarnation=1, seq=0, fragment=0, base_version=0, tokens=1000 * (island + 1),
                         inner_steps=40, step_time_s=0.1, train_loss=3.0, payload=[compress(d, "none") for d in ds])
        results, refusal = core.receive(sub, now=0.0)
        assert refusal is None, refusal
    assert len(results) == 1
    return [-t for t in results[0].tensors]


def test_the_config_names_it_by_import_path():
    assert load_config(None, [f"outer.merge_rule={RULE}"]).outer.merge_rule == RULE
    assert isinstance(load_merge_rule(RULE), TrimmedMean)


def test_one_bad_island_moves_the_default_and_the_mean_but_not_the_trimmed_mean():
    deltas = [*HONEST, BAD]
    trimmed = _round(RULE, deltas)
    assert [t.tolist() for t in trimmed] == [pytest.approx(x, abs=1e-6) for x in TRIMMED]
    # Without the bad island the trimmed mean of three is the per-coordinate median: close to the above.
    honest = _round(RULE, HONEST)
    assert all((a - b).abs().max() < 0.03 for a, b in zip(trimmed, honest))
    for rule in ("rda", "mean"):  # the default rule and the plain mean: the bad island drags both
        moved = _round(rule, deltas)
        assert all((a - b).abs().max() > 1.0 for a, b in zip(moved, trimmed)), rule


def test_under_three_islands_it_is_the_unweighted_mean():
    two = _round(RULE, HONEST[:2])
    assert [t.tolist() for t in two] == [pytest.approx(x, abs=1e-6) for x in ([0.125, 0.225, 0.275, 0.425],
                                                                              [0.0375, -0.0375])]
