"""Quorum and grace: hand-computed windows and decisions, one rule at a time."""

import math

import pytest

from policies.quorum import MovingAverage, RoundDecision, decide_round, grace_window_s


def test_moving_average_first_sample_then_ema():
    avg = MovingAverage(alpha=0.25)
    assert avg.value is None
    assert avg.update(4.0) == 4.0
    assert avg.update(8.0) == pytest.approx(0.75 * 4.0 + 0.25 * 8.0)  # 5.0
    assert avg.update(0.0) == pytest.approx(0.75 * 5.0)  # 3.75
    assert avg.value == pytest.approx(3.75)


def test_moving_average_alpha_one_keeps_last():
    avg = MovingAverage(alpha=1.0)
    avg.update(3.0)
    assert avg.update(7.0) == 7.0


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_moving_average_rejects_alpha(alpha):
    with pytest.raises(ValueError, match=f"alpha must be in \\(0, 1\\], got {alpha}"):
        MovingAverage(alpha=alpha)


def _grace(**overrides):
    kwargs = dict(gamma=0.5, tau_steps=10, step_time_s=1.0, quorum_time_s=2.0, sync_time_s=1.0, cap_s=100.0)
    kwargs.update(overrides)
    return grace_window_s(**kwargs)


def test_grace_formula():
    # 0.5 * (10 * 1.0 - 2.0 - 1.0) = 3.5
    assert _grace() == pytest.approx(3.5)


def test_grace_clamped_to_cap_and_zero():
    assert _grace(cap_s=2.0) == 2.0
    # 10 * 0.1 - 2 - 1 < 0 -> 0
    assert _grace(step_time_s=0.1) == 0.0


def test_grace_none_measurements():
    assert _grace(step_time_s=None) == 0.0
    # quorum and sync unknown count as 0: 0.5 * 10 = 5
    assert _grace(quorum_time_s=None, sync_time_s=None) == pytest.approx(5.0)


def test_grace_infinite_gamma_and_cap():
    assert _grace(gamma=math.inf) == 100.0
    assert _grace(gamma=math.inf, cap_s=math.inf) == math.inf
    assert _grace(gamma=math.inf, cap_s=math.inf, step_time_s=None) == math.inf
    assert _grace(cap_s=math.inf) == pytest.approx(3.5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"gamma": -1.0}, "gamma must be >= 0"),
        ({"tau_steps": -1}, "tau_steps must be >= 0"),
        ({"cap_s": -1.0}, "cap_s must be >= 0"),
    ],
)
def test_grace_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _grace(**overrides)


def _decide(**overrides):
    kwargs = dict(now=10.0, pending=2, min_quorum=2, live_islands=4, quorum_reached_at=9.0, grace_s=3.0)
    kwargs.update(overrides)
    return decide_round(**kwargs)


def test_waiting_for_quorum():
    d = _decide(pending=1)
    assert d == RoundDecision(close=False, wait_s=math.inf, reason="waiting for quorum 1/2")


def test_all_live_islands_closes_even_inside_grace():
    d = _decide(pending=4)
    assert d.close and d.wait_s == 0.0
    assert d.reason.startswith("all live islands submitted")


def test_in_grace_window_waits_until_deadline():
    d = _decide(now=10.0)  # deadline 9 + 3 = 12
    assert not d.close
    assert d.wait_s == pytest.approx(2.0)
    assert d.reason.startswith("in grace window")


def test_grace_expired_closes_at_deadline():
    d = _decide(now=12.0)
    assert d.close and d.wait_s == 0.0
    assert d.reason.startswith("grace window expired")


def test_quorum_reached_at_none_counts_as_now():
    d = _decide(quorum_reached_at=None)
    assert not d.close and d.wait_s == pytest.approx(3.0)
    assert _decide(quorum_reached_at=None, grace_s=0.0).close


def test_infinite_grace_waits_for_every_live_island():
    # K = M with infinite grace: synchronous DiLoCo.
    d = _decide(grace_s=math.inf, now=1e9)
    assert not d.close and d.wait_s == math.inf
    assert _decide(grace_s=math.inf, pending=4).close


def test_quorum_above_live_islands_stalls():
    # Synchronous baseline with K = 3 while one of three islands is dead: never closes.
    d = _decide(pending=2, min_quorum=3, live_islands=2, now=1e9)
    assert not d.close and d.wait_s == math.inf


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"min_quorum": 0}, "min_quorum must be >= 1, got 0"),
        ({"pending": -1}, "pending must be >= 0, got -1"),
        ({"grace_s": -0.5}, "grace_s must be >= 0, got -0.5"),
    ],
)
def test_decide_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _decide(**overrides)
