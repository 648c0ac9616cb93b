"""The inner learning-rate schedule (policies/lr_schedule.py), against torch's own schedulers."""

from __future__ import annotations

import math

import pytest
import torch

from policies.lr_schedule import LR_SCHEDULES, lr_factor

PEAK = 3e-3


def torch_cosine(t_max: int, eta_min: float) -> list[float]:
    """The rate torch's CosineAnnealingLR gives at epochs 0..t_max (the independent reference)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max, eta_min=eta_min)
    rates = []
    for _ in range(t_max + 1):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("final_ratio", [0.0, 0.1, 0.5])
def test_cosine_matches_torch_cosine_annealing_at_every_progress(final_ratio):
    t_max = 50
    for t, want in enumerate(torch_cosine(t_max, final_ratio * PEAK)):
        got = PEAK * lr_factor("cosine", step=1000, warmup_steps=20, progress=t / t_max, final_ratio=final_ratio)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), t
    assert lr_factor("cosine", step=1000, warmup_steps=20, progress=0.0, final_ratio=final_ratio) == 1.0
    assert lr_factor("cosine", step=1000, warmup_steps=20, progress=1.0, final_ratio=final_ratio) == pytest.approx(final_ratio)


def test_warmup_counts_the_incarnations_own_steps_and_multiplies_the_decay():
    # Warmup is linear in the island's steps as before (step 0 takes 1/warmup of the rate) ...
    assert [lr_factor("constant", step=s, warmup_steps=4, progress=0.3, final_ratio=0.1) for s in range(6)] == \
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor("constant", step=0, warmup_steps=0, progress=0.9, final_ratio=0.1) == 1.0
    # ... and a restarted island late in a run warms up to the decayed rate, not to the peak.
    decayed = lr_factor("cosine", step=100, warmup_steps=4, progress=0.75, final_ratio=0.1)
    assert decayed == pytest.approx(0.1 + 0.9 * (1 + math.cos(0.75 * math.pi)) / 2)
    assert lr_factor("cosine", step=1, warmup_steps=4, progress=0.75, final_ratio=0.1) == pytest.approx(0.5 * decayed)


def test_cosine_holds_the_final_rate_past_the_budget_and_constant_never_decays():
    end = lr_factor("cosine", step=10, warmup_steps=0, progress=1.0, final_ratio=0.2)
    assert lr_factor("cosine", step=10, warmup_steps=0, progress=1.3, final_ratio=0.2) == end == pytest.approx(0.2)
    rates = [lr_factor("cosine", step=10, warmup_steps=0, progress=p / 10, final_ratio=0.2) for p in range(11)]
    assert all(a > b for a, b in zip(rates, rates[1:])), rates  # strictly decreasing on [0, 1]
    assert {lr_factor("constant", step=10, warmup_steps=0, progress=p / 10, final_ratio=0.2) for p in range(15)} == {1.0}
    assert LR_SCHEDULES == ("constant", "cosine")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": "linear"}, "unknown; use one of constant, cosine"),
        ({"step": -1}, "must both be >= 0"),
        ({"warmup_steps": -2}, "must both be >= 0"),
        ({"progress": -0.1}, "progress must be a finite fraction"),
        ({"progress": math.nan}, "progress must be a finite fraction"),
        ({"final_ratio": 1.5}, r"final_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_input_is_named_in_one_line(kwargs, match):
    args = {"schedule": "cosine", "step": 0, "warmup_steps": 0, "progress": 0.5, "final_ratio": 0.1, **kwargs}
    schedule = args.pop("schedule")
    with pytest.raises(ValueError, match=match) as err:
        lr_factor(schedule, **args)
    assert "\n" not in str(err.value)
