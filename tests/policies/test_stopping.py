"""The stop-at-target rule (policies.stopping)."""

from __future__ import annotations

import math

import pytest

from policies.stopping import TARGET_EVALS_IN_A_ROW, target_reached


def test_needs_the_last_evaluations_in_a_row_at_or_below_the_target():
    assert TARGET_EVALS_IN_A_ROW == 2
    assert not target_reached([3.0, 2.5], 2.0)
    assert not target_reached([3.0, 1.9], 2.0)  # one evaluation under it: could be a dip
    assert not target_reached([1.9, 2.1], 2.0)  # a dip that came back up
    assert target_reached([3.0, 2.0, 1.95], 2.0)  # "at" counts
    assert target_reached([1.9, 2.1, 1.8, 1.7], 2.0)


def test_none_never_stops_and_short_histories_do_not_either():
    assert not target_reached([0.1, 0.1, 0.1], None)
    assert not target_reached([], 5.0)
    assert not target_reached([1.0], 5.0)
    assert target_reached([1.0], 5.0, in_a_row=1)


def test_nan_is_not_at_the_target():
    assert not target_reached([1.0, math.nan], 5.0)
    assert not target_reached([math.nan, math.nan], 5.0)


def test_in_a_row_must_be_positive():
    with pytest.raises(ValueError, match="in_a_row must be >= 1"):
        target_reached([1.0], 2.0, in_a_row=0)
