"""Goodput accounting on hand-made timelines with known answers (docs/architecture.md section 6)."""

import math

import pytest

from policies.goodput import (
    TIMELINE_STATES,
    GoodputReport,
    Interval,
    goodput_report,
    merge_timeline,
    pipeline_full_at,
    uptime_fraction,
    uptime_window_from_rounds,
)

# --- merge_timeline ----------------------------------------------------------------------------


def test_merge_timeline_closes_intervals_per_island():
    events = [  # deliberately unsorted
        (30.0, 0, 1, "dead"),
        (0.0, 0, 1, "training"),
        (0.0, 1, 1, "training"),
        (35.0, 0, 2, "restarting"),
        (45.0, 0, 2, "reintegrating"),
        (50.0, 0, 2, "training"),
        (60.0, 1, 1, "blocked"),
        (70.0, 1, 1, "training"),
    ]
    assert merge_timeline(events, end=100.0) == [
        Interval(0, 1, "training", 0.0, 30.0),
        Interval(0, 1, "dead", 30.0, 35.0),
        Interval(0, 2, "restarting", 35.0, 45.0),
        Interval(0, 2, "reintegrating", 45.0, 50.0),
        Interval(0, 2, "training", 50.0, 100.0),
        Interval(1, 1, "training", 0.0, 60.0),
        Interval(1, 1, "blocked", 60.0, 70.0),
        Interval(1, 1, "training", 70.0, 100.0),
    ]


def test_merge_timeline_repeats_zero_length_and_cut():
    events = [
        (0.0, 0, 1, "training"),
        (5.0, 0, 1, "training"),  # a repeat extends, does not split
        (10.0, 0, 1, "blocked"),
        (10.0, 0, 1, "training"),  # equal times keep their given order: blocked lasts 0 s, dropped
        (20.0, 0, 1, "dead"),
        (25.0, 0, 2, "training"),
        (40.0, 0, 2, "dead"),  # after end: ignored
    ]
    assert merge_timeline(events, end=30.0) == [
        Interval(0, 1, "training", 0.0, 20.0),
        Interval(0, 1, "dead", 20.0, 25.0),
        Interval(0, 2, "training", 25.0, 30.0),
    ]
    # Same state, new incarnation: a new interval.
    assert merge_timeline([(0.0, 3, 1, "training"), (4.0, 3, 2, "training")], end=6.0) == [
        Interval(3, 1, "training", 0.0, 4.0), Interval(3, 2, "training", 4.0, 6.0)
    ]
    assert merge_timeline([], end=5.0) == []


def test_merge_timeline_validation():
    with pytest.raises(ValueError, match=r"events\[1\]: state must be one of .*'sleeping'"):
        merge_timeline([(0.0, 0, 1, "training"), (1.0, 0, 1, "sleeping")], end=2.0)
    with pytest.raises(ValueError, match=r"events\[0\] must be \(time, island, incarnation, new_state\)"):
        merge_timeline([(0.0, 0, "training")], end=2.0)


# --- goodput_report ----------------------------------------------------------------------------


def _hand_timeline():
    """Two islands over [0, 100] s: island 0 dies at 30 and is back training at 50; island 1 blocks 10 s."""
    return merge_timeline(
        [
            (0.0, 0, 1, "training"), (30.0, 0, 1, "dead"), (35.0, 0, 2, "restarting"),
            (45.0, 0, 2, "reintegrating"), (50.0, 0, 2, "training"),
            (0.0, 1, 1, "training"), (60.0, 1, 1, "blocked"), (70.0, 1, 1, "training"),
        ],
        end=100.0,
    )


def test_goodput_report_hand_computed():
    r = goodput_report(
        intervals=_hand_timeline(), useful_s=120.0, run_start=0.0, run_end=100.0, islands=2,
        version_advances=[10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0], uptime_window_s=10.0,
        tokens_merged=1000, tokens_lost=200, tokens_refused=50, tokens_in_flight=30, tokens_overwritten=7,
    )
    assert r == GoodputReport(
        goodput=0.6,  # 120 / (2 x 100)
        uptime=1.0,  # the clock starts at the first advance (10): [10, 100] is covered
        fill_s=10.0,  # [0, 10): the pipeline fill, reported apart
        allocated_s=200.0,
        useful_s=120.0,
        lost_s=80.0,
        by_state_s={"starting": 0.0, "training": 170.0, "blocked": 10.0, "dead": 5.0, "restarting": 10.0,
                    "reintegrating": 5.0, "leaving": 0.0, "vacant": 0.0},
        tokens={"merged": 1000, "lost": 200, "refused": 50, "in_flight": 30, "overwritten": 7, "processed": 1287},
    )
    assert sum(r.by_state_s.values()) == r.allocated_s  # the timeline covers every slot-second here


def test_by_state_is_clipped_to_the_run_and_lists_every_state():
    intervals = [Interval(0, 1, "training", -10.0, 20.0), Interval(0, 1, "dead", 20.0, 200.0)]
    r = goodput_report(
        intervals=intervals, useful_s=5.0, run_start=0.0, run_end=50.0, islands=3, version_advances=[],
        uptime_window_s=1.0, tokens_merged=0, tokens_lost=0, tokens_refused=0, tokens_in_flight=0,
    )
    assert r.by_state_s == {"starting": 0.0, "training": 20.0, "blocked": 0.0, "dead": 30.0, "restarting": 0.0,
                            "reintegrating": 0.0, "leaving": 0.0, "vacant": 0.0}
    assert list(r.by_state_s) == list(TIMELINE_STATES)
    assert r.allocated_s == 150.0 and r.lost_s == 145.0 and r.goodput == pytest.approx(5.0 / 150.0)
    assert r.uptime == 0.0 and r.fill_s == 50.0 and r.tokens["processed"] == 0


def test_a_first_start_is_starting_and_counts_as_downtime_like_a_reintegration():
    """Two islands' first starts (8 s and 12 s) are "starting", not "reintegrating"; island 0's restart after
    its failure is "restarting" then "reintegrating". Start-up earns no useful time either way."""
    intervals = merge_timeline(
        [(0.0, 0, 1, "starting"), (8.0, 0, 1, "training"), (40.0, 0, 1, "dead"), (41.0, 0, 2, "restarting"),
         (44.0, 0, 2, "reintegrating"), (50.0, 0, 2, "training"),
         (0.0, 1, 1, "starting"), (12.0, 1, 1, "training")],
        end=100.0,
    )
    r = goodput_report(intervals=intervals, useful_s=150.0, run_start=0.0, run_end=100.0, islands=2,
                       version_advances=[20.0], uptime_window_s=100.0, tokens_merged=0, tokens_lost=0,
                       tokens_refused=0, tokens_in_flight=0)
    assert r.by_state_s == {"starting": 20.0, "training": 170.0, "blocked": 0.0, "dead": 1.0, "restarting": 3.0,
                            "reintegrating": 6.0, "leaving": 0.0, "vacant": 0.0}
    downtime = sum(r.by_state_s[k] for k in ("starting", "dead", "restarting", "reintegrating"))
    assert downtime == r.allocated_s - r.by_state_s["training"] == 30.0
    assert r.lost_s == 50.0 and r.goodput == 0.75  # useful 150 of 200: start-up is allocated, not useful


def _report(**overrides):
    kw = dict(intervals=[], useful_s=10.0, run_start=0.0, run_end=10.0, islands=1, version_advances=[0.0],
              uptime_window_s=10.0, tokens_merged=1, tokens_lost=0, tokens_refused=0, tokens_in_flight=0)
    kw.update(overrides)
    return goodput_report(**kw)


def test_useful_equal_to_allocated_is_goodput_one():
    r = _report()
    assert (r.goodput, r.lost_s, r.uptime) == (1.0, 0.0, 1.0)
    assert _report(useful_s=10.0 + 1e-12).goodput == 1.0  # float noise within 1e-9 is clamped


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"run_end": 0.0}, "run_end must be > run_start, got run_start=0.0, run_end=0.0"),
        ({"useful_s": 10.5}, "useful_s 10.5 exceeds allocated_s 10.0"),
        ({"useful_s": -1.0}, "useful_s must be >= 0"),
        ({"islands": 0}, "islands must be an int >= 1, got 0"),
        ({"uptime_window_s": 0.0}, "uptime_window_s must be > 0"),
        ({"tokens_lost": -3}, "tokens_lost must be an int >= 0, got -3"),
        ({"intervals": [Interval(0, 1, "napping", 0.0, 1.0)]}, r"intervals\[0\]: state must be one of"),
        ({"intervals": [Interval(0, 1, "dead", 5.0, 1.0)]}, r"intervals\[0\] ends before it starts"),
        ({"intervals": [Interval(0, 1, "training", 0.0, 6.0), Interval(0, 2, "dead", 5.0, 8.0)]},
         "island 0: intervals overlap"),
    ],
)
def test_goodput_report_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        _report(**overrides)


# --- uptime ------------------------------------------------------------------------------------


def test_uptime_is_one_when_advances_are_dense():
    advances = [0.5 * k for k in range(200)]  # every 0.5 s over [0, 100)
    assert uptime_fraction(advances, run_start=0.0, run_end=100.0, uptime_window_s=1.5) == 1.0


def test_uptime_drops_by_exactly_the_gap():
    # Advances every 1 s from 0 to 40 and from 70 to 100, window 2 s: covered [0, 42] and [70, 100].
    advances = [float(t) for t in range(0, 41)] + [float(t) for t in range(70, 101)]
    assert uptime_fraction(advances, run_start=0.0, run_end=100.0, uptime_window_s=2.0) == pytest.approx(0.72)


def test_uptime_overlapping_windows_and_clipping():
    # Windows [5, 15] and [10, 20] overlap: union 15 s; [-5, 5] is clipped to [0, 5]; [95, 105] to [95, 100].
    advances = [10.0, 5.0, -5.0, 95.0]
    assert uptime_fraction(advances, run_start=0.0, run_end=100.0, uptime_window_s=10.0) == pytest.approx(0.25)
    assert uptime_fraction([], run_start=0.0, run_end=1.0, uptime_window_s=1.0) == 0.0
    assert uptime_fraction([200.0], run_start=0.0, run_end=100.0, uptime_window_s=10.0) == 0.0


def test_uptime_window_from_rounds():
    assert uptime_window_from_rounds([0.0, 2.0, 4.0, 10.0]) == 6.0  # gaps 2, 2, 6: median 2, x3
    assert uptime_window_from_rounds([4.0, 0.0, 2.0, 3.0], factor=2.0) == 2.0  # gaps 2, 1, 1 sorted: median 1
    assert uptime_window_from_rounds([0.0, 1.0, 1.0, 1.0, 3.0]) == 4.5  # equal times count once: gaps 1, 2
    assert uptime_window_from_rounds([0.0, 0.1, 0.2]) == 1.0  # 3 x 0.1 = 0.3 < floor
    assert uptime_window_from_rounds([5.0]) == 1.0
    assert uptime_window_from_rounds([], floor_s=2.5) == 2.5
    with pytest.raises(ValueError, match="factor must be > 0"):
        uptime_window_from_rounds([0.0, 1.0], factor=0.0)
    with pytest.raises(ValueError, match="floor_s must be > 0"):
        uptime_window_from_rounds([0.0, 1.0], floor_s=-1.0)


def test_report_uses_the_derived_window():
    # Rounds every 2 s, then a 20 s stall: window 3 x 2 = 6 s leaves [26, 40) uncovered.
    advances = [2.0 * k for k in range(11)] + [40.0 + 2.0 * k for k in range(11)]
    window = uptime_window_from_rounds(advances)
    assert window == 6.0
    r = _report(run_end=60.0, useful_s=0.0, version_advances=advances, uptime_window_s=window)
    assert r.uptime == pytest.approx((60.0 - 14.0) / 60.0)


def test_uptime_clock_starts_at_the_first_advance_and_still_sees_a_stall():
    # Fill [0, 8), rounds every 2 s to 30, a 20 s stall, rounds every 2 s from 50 to 70, end at 80.
    advances = [8.0 + 2.0 * k for k in range(12)] + [50.0 + 2.0 * k for k in range(11)]
    window = uptime_window_from_rounds(advances)  # 3 x 2 s
    r = _report(run_end=80.0, useful_s=0.0, version_advances=advances, uptime_window_s=window)
    # Down: [36, 50) (the stall beyond the window) and [76, 80) (the end beyond it), over [8, 80].
    assert r.fill_s == 8.0
    assert r.uptime == pytest.approx((72.0 - 14.0 - 4.0) / 72.0)
    # Advances outside the run count neither for the clock nor for coverage.
    r = _report(run_start=10.0, run_end=20.0, useful_s=0.0, version_advances=[5.0, 12.0, 25.0], uptime_window_s=4.0)
    assert r.fill_s == 2.0 and r.uptime == pytest.approx(4.0 / 8.0)
    # The clock stops when the run began stopping: a held end is not a stall.
    r = _report(run_end=80.0, useful_s=0.0, version_advances=advances, uptime_window_s=window, uptime_until=70.0)
    assert r.uptime == pytest.approx((62.0 - 14.0) / 62.0)
    with pytest.raises(ValueError, match="uptime_until must lie in"):
        _report(run_end=80.0, version_advances=advances, uptime_window_s=window, uptime_until=81.0)
    # A single advance at the very end leaves nothing after it: uptime 0, the whole run was fill.
    r = _report(run_end=10.0, useful_s=0.0, version_advances=[10.0], uptime_window_s=4.0)
    assert r.uptime == 0.0 and r.fill_s == 10.0
    assert not math.isnan(r.goodput)


def test_an_early_island_alone_is_still_the_fill_once_the_pipeline_is_full_a_stall_counts():
    # Island 0 started early and advanced versions alone at 10 and 20; islands 1 and 2 were first merged at 20
    # and 22; from 22 rounds every 2 s to 60, then a 10 s stall, then every 2 s to 80.
    advances = [10.0, 20.0] + [22.0 + 2.0 * k for k in range(20)] + [70.0 + 2.0 * k for k in range(6)]
    full = pipeline_full_at(range(3), first_merged={0: 10.0, 1: 20.0, 2: 22.0}, first_failed={})
    assert full == 22.0
    r = _report(run_end=80.0, useful_s=0.0, version_advances=advances, uptime_window_s=6.0, fill_until=full)
    # The clock runs [22, 80]: down only where the stall outlasts the window, [66, 70).
    assert r.fill_s == 22.0 and r.uptime == pytest.approx((58.0 - 4.0) / 58.0)
    # Without it the early island's 10 s gap (10 -> 20, 4 s beyond the window) was counted as down too.
    early = _report(run_end=80.0, useful_s=0.0, version_advances=advances, uptime_window_s=6.0)
    assert early.fill_s == 10.0 and early.uptime == pytest.approx((70.0 - 4.0 - 4.0) / 70.0)


def test_the_pipeline_is_full_when_each_island_was_merged_or_failed():
    # Island 2 died before its first submission: its failure ends its fill (its absence is downtime from then).
    assert pipeline_full_at([0, 1, 2], first_merged={0: 5.0, 1: 9.0}, first_failed={2: 7.0, 0: 30.0}) == 9.0
    assert pipeline_full_at([0, 1, 2], first_merged={0: 5.0, 1: 9.0, 2: 12.0}, first_failed={2: 7.0}) == 9.0
    # An island that has done neither yet (a short run's slow island): not full, the first advance starts the clock.
    assert pipeline_full_at([0, 1], first_merged={0: 5.0}, first_failed={}) is None
    # A fill_until past every advance leaves no clock: uptime 0, all of it fill.
    r = _report(run_end=50.0, useful_s=0.0, version_advances=[10.0, 20.0], uptime_window_s=6.0, fill_until=40.0)
    assert r.uptime == 0.0 and r.fill_s == 50.0
