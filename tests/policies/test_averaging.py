"""policies.averaging: the served model's moving-average weight (no Ray, no torch)."""

from __future__ import annotations

import math

import pytest

from policies.averaging import average_weight


def test_weight_is_new_tokens_over_the_window_of_everything_merged():
    assert average_weight(100, 100_000, 0.01) == pytest.approx(0.1)  # 100 / (0.01 * 100000)
    assert average_weight(500, 1000, 0.5) == 1.0  # 500 / 500
    assert average_weight(300, 1000, 0.5) == pytest.approx(0.6)


def test_early_updates_replace_the_average():
    assert average_weight(0, 0, 0.05) == 1.0, "nothing merged yet: the average is the model"
    assert average_weight(256, 256, 0.05) == 1.0, "the first round: 1 / window > 1 is capped at 1"
    assert average_weight(256, 2560, 0.05) == 1.0  # 256 / 128 capped
    assert average_weight(256, 25600, 0.05) == pytest.approx(0.2)


def test_the_profile_is_the_power_function_ema():
    """Equal updates n: after T = k n tokens the average weighs update j by w_j prod_{i > j} (1 - w_i), and for
    window = 1 / (gamma + 1) that is the power profile of exponent gamma: each of the last k updates gets
    about (gamma + 1) / k * (j / k) ** gamma. Checked against that closed form, and its spread against window."""
    window, k = 0.05, 40_000
    gamma = 1 / window - 1
    weights, kept = [0.0] * (k + 1), 1.0  # kept: what the updates after j leave of update j
    for j in range(k, 0, -1):
        w = average_weight(1, j, window)
        weights[j] = w * kept
        kept *= 1 - w
    assert sum(weights) == pytest.approx(1.0)
    for j in (k // 2, 3 * k // 4, 9 * k // 10, k):
        assert weights[j] == pytest.approx((gamma + 1) / k * (j / k) ** gamma, rel=0.02), j
    mean = sum(j / k * x for j, x in enumerate(weights))
    std = math.sqrt(sum((j / k - mean) ** 2 * x for j, x in enumerate(weights)))
    assert 1 - mean == pytest.approx(window, rel=0.05), "the average sits about one window behind the model"
    assert std == pytest.approx(window, rel=0.1), "and spreads over about one window (EDM2's sigma_rel)"


@pytest.mark.parametrize("window", [0, -0.1, 1.5, math.nan, math.inf, "0.1"])
def test_a_window_outside_0_1_is_refused(window):
    with pytest.raises(ValueError, match="window must be a fraction in"):
        average_weight(1, 10, window)


def test_inconsistent_token_counts_are_refused():
    with pytest.raises(ValueError, match="need 0 <= new_tokens <= total_tokens"):
        average_weight(20, 10, 0.1)
    with pytest.raises(ValueError, match="need 0 <= new_tokens <= total_tokens"):
        average_weight(-1, 10, 0.1)
