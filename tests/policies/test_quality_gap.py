"""policies.quality_gap against hand-computed values: loss at equal tokens, bytes per token, time to a loss."""

from __future__ import annotations

import math

import pytest

from policies.quality_gap import EvalPoint, loss_at_tokens, quality_gap, time_to_loss

RUN = [EvalPoint(0, 5.0, 0.0), EvalPoint(1000, 3.0, 10.0), EvalPoint(3000, 2.2, 30.0)]
DP = [EvalPoint(0, 5.0, 0.0), EvalPoint(2000, 2.5, 40.0), EvalPoint(2500, 2.0, 50.0)]


def test_loss_is_linear_between_the_evaluations_around_the_tokens():
    assert loss_at_tokens(RUN, 500) == pytest.approx(4.0)
    assert loss_at_tokens(RUN, 2000) == pytest.approx(2.6)  # 3.0 + (2.2 - 3.0) * 1000 / 2000
    assert loss_at_tokens(RUN, 3000) == 2.2 and loss_at_tokens(RUN, 0) == 5.0
    with pytest.raises(ValueError, match="outside the evaluations"):
        loss_at_tokens(RUN, 3001)


def test_the_gap_is_read_at_the_smaller_final_token_count_without_extrapolating():
    g = quality_gap(RUN, DP, run_bytes=3000.0, baseline_bytes=250_000.0)
    assert g.tokens == 2500  # the baseline stopped first
    assert g.loss == pytest.approx(2.4)  # 3.0 + (2.2 - 3.0) * 1500 / 2000
    assert g.baseline_loss == 2.0 and g.relative == pytest.approx(0.2)
    # bytes per token: the baseline's 100 over the run's 1
    assert g.bytes_ratio == pytest.approx(100.0)
    # the run never reached the baseline's final 2.0
    assert g.time_to_baseline_loss_s is None and g.baseline_time_s == 50.0


def test_time_to_loss_interpolates_the_crossing_and_unknown_bytes_give_no_ratio():
    assert time_to_loss(RUN, 3.0) == 10.0
    assert time_to_loss(RUN, 2.6) == pytest.approx(20.0)  # halfway from 3.0 at 10 s to 2.2 at 30 s
    assert time_to_loss(RUN, 5.0) == 0.0 and time_to_loss(RUN, 1.0) is None
    g = quality_gap(DP, RUN, run_bytes=None, baseline_bytes=10.0)
    assert g.bytes_ratio is None and g.relative == pytest.approx(2.0 / 2.4 - 1)
    assert g.time_to_baseline_loss_s == pytest.approx(40 + 10 * (2.5 - 2.2) / 0.5)  # DP crosses RUN's 2.2 at 46 s


def test_non_finite_points_are_left_out_and_a_curve_without_any_is_an_error():
    with_nan = [*RUN, EvalPoint(4000, math.nan, 40.0)]
    assert quality_gap(with_nan, DP).tokens == 2500
    with pytest.raises(ValueError, match="the baseline has no finite held-out evaluation"):
        quality_gap(RUN, [EvalPoint(10, math.inf, 1.0)])
