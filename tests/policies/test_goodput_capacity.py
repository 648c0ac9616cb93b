"""Goodput over the capacity the run had: an elastic slot's `vacant` time is not allocated.

Hand-computed: allocated_s = islands * wall - vacant time (clipped to the run), goodput = useful / allocated,
useful time above that capacity refused. accounting.first_placement leaves out the elastic slots that went
vacant before they trained (the pipeline fill does not wait for them); capacity_s is the same allocation
computed from the health monitor's raw timeline.
"""

import pytest

from orchestrator.core.accounting import capacity_s, first_placement
from policies.goodput import TIMELINE_STATES, Interval, goodput_report


def report(intervals, *, useful_s, islands=3, run_start=0.0, run_end=100.0):
    return goodput_report(intervals=intervals, useful_s=useful_s, run_start=run_start, run_end=run_end, islands=islands,
                          version_advances=[10.0 * k for k in range(1, 10)], uptime_window_s=15.0, tokens_merged=0,
                          tokens_lost=0, tokens_refused=0, tokens_in_flight=0)


# Three slots over [0, 100): 0 and 1 train throughout; slot 2 (elastic) starts, trains, leaves with its drained
# node at 50 and stays vacant from 55 (its pool has no machine for it).
ONE_VACANT = [
    Interval(0, 1, "training", 0.0, 100.0),
    Interval(1, 1, "training", 0.0, 100.0),
    Interval(2, 1, "starting", 0.0, 10.0),
    Interval(2, 1, "training", 10.0, 50.0),
    Interval(2, 1, "leaving", 50.0, 55.0),
    Interval(2, 1, "vacant", 55.0, 100.0),
]


def test_vacant_time_is_not_allocated():
    r = report(ONE_VACANT, useful_s=200.0)
    assert r.allocated_s == pytest.approx(3 * 100.0 - 45.0)  # 255
    assert r.goodput == pytest.approx(200.0 / 255.0)
    assert r.useful_s == pytest.approx(200.0) and r.lost_s == pytest.approx(55.0)


def test_by_state_lists_leaving_and_vacant():
    by_state = report(ONE_VACANT, useful_s=200.0).by_state_s
    assert {"leaving", "vacant"} <= set(TIMELINE_STATES) and set(by_state) == set(TIMELINE_STATES)
    assert by_state == pytest.approx({**{s: 0.0 for s in TIMELINE_STATES}, "training": 240.0, "starting": 10.0,
                                      "leaving": 5.0, "vacant": 45.0})


def test_vacant_time_is_clipped_to_the_run():
    # Vacant from before the run to after it: only [20, 80) of it lies in the run.
    intervals = [Interval(0, 1, "training", 20.0, 80.0), Interval(1, 1, "vacant", 0.0, 100.0)]
    r = report(intervals, useful_s=60.0, islands=2, run_start=20.0, run_end=80.0)
    assert r.allocated_s == pytest.approx(2 * 60.0 - 60.0) and r.goodput == pytest.approx(1.0)


def test_useful_time_above_the_capacity_is_refused():
    # 260 s fits 3 slots x 100 s, not the 255 s the run had.
    with pytest.raises(ValueError, match="useful_s 260.0 exceeds allocated_s 255.0"):
        report(ONE_VACANT, useful_s=260.0)


# --- orchestrator/core/accounting.py ------------------------------------------------------------
# The health monitor's timeline: (time, slot, incarnation, new state), unsorted on purpose.

TIMELINE = [
    (0.0, 0, 1, "starting"), (4.0, 0, 1, "training"),
    (30.0, 1, 1, "training"), (0.0, 1, 1, "starting"), (60.0, 1, 1, "leaving"), (65.0, 1, 1, "vacant"),  # trained, left
    (0.0, 2, 1, "starting"), (8.0, 2, 1, "vacant"), (70.0, 2, 2, "starting"), (75.0, 2, 2, "training"),  # vacant first
    (0.0, 3, 1, "vacant"),  # never placed
    (0.0, 4, 1, "starting"), (5.0, 4, 1, "dead"), (6.0, 4, 1, "vacant"),  # failed, then no machine
]


def test_first_placement_leaves_out_slots_vacant_before_they_trained():
    assert first_placement(TIMELINE, 5) == [0, 1, 4]


def test_first_placement_keeps_every_slot_of_a_fixed_run():
    timeline = [(0.0, 0, 1, "starting"), (3.0, 0, 1, "training"), (0.0, 1, 1, "starting")]
    assert first_placement(timeline, 3) == [0, 1, 2], "a slot still starting, or with no event yet, is placed"


def test_capacity_subtracts_vacant_time_clipped_to_the_run():
    # run [10, 110): slot 1 vacant 65..110 = 45; slot 2 vacant 10..70 = 60; slot 3 vacant 10..110 = 100;
    # slot 4 vacant 10..110 = 100 (its events before the run start count from the run start).
    got = capacity_s(TIMELINE, islands=5, run_start=10.0, run_end=110.0)
    assert got == pytest.approx(5 * 100.0 - (45.0 + 60.0 + 100.0 + 100.0))


def test_capacity_ignores_events_after_the_run_and_stopped_events():
    # "stopped" is not a timeline state: slot 1's vacancy runs from 40 to the run's end.
    timeline = [(0.0, 0, 1, "training"), (0.0, 1, 1, "training"), (40.0, 1, 1, "vacant"), (90.0, 1, 1, "stopped"),
                (150.0, 0, 1, "vacant")]
    assert capacity_s(timeline, islands=2, run_start=0.0, run_end=100.0) == pytest.approx(200.0 - 60.0)


def test_capacity_of_a_run_without_vacancies_is_slots_times_wall():
    timeline = [(0.0, 0, 1, "training"), (10.0, 0, 1, "dead"), (12.0, 0, 2, "restarting")]
    assert capacity_s(timeline, islands=2, run_start=0.0, run_end=50.0) == pytest.approx(100.0)
