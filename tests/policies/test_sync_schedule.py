"""H over the run (policies/sync_schedule.py): the phase lookup, its validation and the bytes it implies."""

from __future__ import annotations

import pytest

from policies.sync_schedule import check_sync_schedule, mean_inverse_h, sync_every_at

SCHEDULE = [(0.1, 40), (0.5, 100)]


@pytest.mark.parametrize("progress, h", [
    (None, 40),  # nothing heard yet: the start of the run
    (0.0, 40), (0.0999, 40),
    (0.1, 100),  # `until` is exclusive: at 10% the next phase has begun
    (0.3, 100), (0.5, 186), (0.99, 186),
    (1.2, 186),  # past the budget (the last steps before the stop): the final H
])
def test_each_phase_runs_until_its_fraction_then_the_final_h(progress, h):
    assert sync_every_at(progress, SCHEDULE, 186) == h


def test_no_schedule_is_the_constant_h():
    assert [sync_every_at(p, [], 186) for p in (None, 0.0, 0.7)] == [186, 186, 186]


def test_mean_inverse_h_is_the_token_weighted_mean_of_one_over_h():
    # Written out: 10% of the tokens at H = 40, 40% at 100, 50% at 186.
    assert mean_inverse_h(SCHEDULE, 186) == pytest.approx(0.1 / 40 + 0.4 / 100 + 0.5 / 186)
    assert mean_inverse_h([], 140) == pytest.approx(1 / 140)
    assert mean_inverse_h([(1.0, 40)], 186) == pytest.approx(1 / 40)  # a phase to the end: the final H never runs


@pytest.mark.parametrize("schedule, message", [
    ([(0.1, 41)], r"H = 41, not a multiple of num_fragments \(P=2\); pick H = 40"),
    ([(0.0, 40)], r"ends at 0.0; each until_fraction must be in \(0, 1\]"),
    ([(1.5, 40)], "ends at 1.5"),
    ([(0.5, 40), (0.5, 20)], r"sync_every_schedule\[1\] ends at 0.5; .* above the one before \(0.5\)"),
    ([(0.2, 0)], "H = 0; H must be an integer >= 1"),
    ([(0.2, 40.0)], "H = 40.0; H must be an integer"),
    ([(0.2,)], r"give \[until_fraction, H\] pairs"),
])
def test_bad_schedules_say_what_is_wrong_in_one_line(schedule, message):
    with pytest.raises(ValueError, match=message) as err:
        check_sync_schedule(schedule, 2)
    assert "\n" not in str(err.value)


def test_good_schedules_pass():
    check_sync_schedule([], 2)
    check_sync_schedule(SCHEDULE, 2)
    check_sync_schedule([(1.0, 3)], 1)
