"""Failure schedules and group timelines: hand-computed cases, no Ray."""

import math

import numpy as np
import pytest

from policies import interruptions as intr


def test_slice_sizes_keep_a_partial_last_slice():
    assert intr.slice_sizes(chips=1000, slice_chips=256).tolist() == [256, 256, 256, 232]
    assert intr.slice_sizes(chips=512, slice_chips=256).tolist() == [256, 256]
    with pytest.raises(ValueError, match="chips=0"):
        intr.slice_sizes(chips=0, slice_chips=256)


def test_no_failures_with_infinite_mtbi():
    t, s = intr.draw_interruptions(sizes=np.array([256]), mtbi_chip_s=math.inf, horizon_s=1e6,
                                   rng=np.random.default_rng(0))
    assert len(t) == 0 and len(s) == 0


def test_interruption_count_and_weights_follow_the_chip_rate():
    # 3 slices of 100, 100, 50 chips; mtbi 1000 s per chip -> 0.25 failures/s; 40000 s -> 10000 expected.
    sizes = np.array([100, 100, 50])
    t, s = intr.draw_interruptions(sizes=sizes, mtbi_chip_s=1000.0, horizon_s=40_000.0,
                                   rng=np.random.default_rng(1))
    assert abs(len(t) - 10_000) < 4 * 100  # Poisson: sd = sqrt(10000)
    assert np.all(np.diff(t) >= 0) and t.min() >= 0 and t.max() < 40_000
    share = np.bincount(s, minlength=3) / len(s)
    assert share == pytest.approx([0.4, 0.4, 0.2], abs=0.02)


def test_draws_are_deterministic_by_seed():
    kw = dict(sizes=np.array([256] * 10), mtbi_chip_s=1e5, horizon_s=1e5)
    a = intr.draw_interruptions(**kw, rng=np.random.default_rng(7))
    b = intr.draw_interruptions(**kw, rng=np.random.default_rng(7))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_recoveries_have_the_requested_mean():
    r = intr.draw_recoveries(200_000, mean_s=20.0, sigma=0.5, rng=np.random.default_rng(2))
    assert r.mean() == pytest.approx(20.0, rel=0.01)
    assert intr.draw_recoveries(3, mean_s=5.0, sigma=0.0, rng=np.random.default_rng(0)).tolist() == [5.0] * 3


def test_failures_while_down_are_absorbed():
    # slice 0: down [0, 10); failures at 5 and 8 land inside it (8 is after the absorbed 5's own end, 6).
    times = np.array([0.0, 5.0, 5.0, 8.0, 12.0])
    slices = np.array([0, 0, 1, 0, 0])
    rec = np.array([10.0, 1.0, 1.0, 1.0, 1.0])
    assert intr.absorb_while_down(times, slices, rec).tolist() == [True, False, True, False, True]


def test_pause_starts_is_a_type_one_counter():
    # Pauses of 3 s: 0 starts [0, 3) and absorbs 1 and 2; 5 starts [5, 8) and absorbs 5.5; 9 starts the next.
    times = np.array([0.0, 1.0, 2.0, 5.0, 5.5, 9.0])
    assert intr.pause_starts(times, np.full(6, 3.0)).tolist() == [0, 3, 5]
    # An event exactly at a pause's end starts a new one; zero-length pauses absorb nothing.
    assert intr.pause_starts(np.array([0.0, 3.0]), np.array([3.0, 3.0])).tolist() == [0, 1]
    assert intr.pause_starts(np.array([1.0, 1.0, 2.0]), np.zeros(3)).tolist() == [0, 1, 2]
    assert intr.pause_starts(np.zeros(0), np.zeros(0)).size == 0


def test_pause_starts_blocks_mu_d_over_one_plus_mu_d_of_a_poisson_stream():
    # Rate 1/s, pauses of 0.5 s: blocked fraction 0.5 / 1.5 exactly for a type-I counter, not 1 - exp(-0.5).
    rng = np.random.default_rng(4)
    times = np.sort(rng.uniform(0.0, 200_000.0, size=rng.poisson(200_000)))
    k = intr.pause_starts(times, np.full(len(times), 0.5))
    assert len(k) * 0.5 / 200_000.0 == pytest.approx(1 / 3, rel=0.01)


def test_stall_timeline_is_not_extended_by_failures_during_a_stall():
    # Failures at 10 (R=5) and 16 (R=5), restart 2: the stall [10, 17) absorbs 16 (its slice is replaced
    # by the same recovery), so 7 s are blocked, not the union's 13, and there is one wipe.
    tl = intr.stall_timeline(np.array([10.0, 16.0]), np.array([5.0, 5.0]), chips=3, restart_s=2.0,
                             horizon_s=100.0)
    assert tl.S[-1] == pytest.approx(93.0)
    assert len(tl.wipes) == 1
    # A failure after the stall starts its own: 10 (R=5) and 17 (R=1) -> blocked [10, 17) and [17, 20).
    tl = intr.stall_timeline(np.array([17.0, 10.0]), np.array([1.0, 5.0]), chips=3, restart_s=2.0,
                             horizon_s=100.0)
    assert tl.S[-1] == pytest.approx(90.0)


def test_elastic_reconfiguration_absorbs_changes_that_arrive_while_it_runs():
    # Slices of 2, 3 and 1 chips; the 2- and 3-chip slices fail at 10 and 10.5 for 20 s; pauses of 1 s.
    # [10, 11) drops both, [30, 31) re-adds both: 2 s paused (the union would be 3 s), 1 chip steps between.
    tl = intr.elastic_timeline(np.array([10.0, 10.5]), np.array([20.0, 20.0]), np.array([2, 3]), chips=6,
                               reconfig_s=1.0, horizon_s=100.0)
    assert tl.S[-1] == pytest.approx(98.0)
    assert tl.Q[-1] == pytest.approx(6 * 10 + 1 * 19 + 6 * 69)
    assert len(tl.wipes) == 0


def test_stall_timeline_rolls_back_to_the_last_checkpoint():
    # Failures at 10 (R=5) and 12 (R=1), restart 2: blocked on [10, 17] (one stall, one wipe).
    tl = intr.stall_timeline(np.array([10.0, 12.0]), np.array([5.0, 1.0]), chips=3, restart_s=2.0,
                             horizon_s=100.0)
    assert tl.S[-1] == pytest.approx(93.0)
    assert len(tl.wipes) == 1
    # Checkpoints every 4 s of stepping: 10 s before the wipe keep 8; the last epoch (83 s) is kept.
    _, chip_s = intr.durable_points(tl, 4.0)
    assert chip_s.sum() == pytest.approx(3 * (8 + 83))
    assert intr.kept_stepping_s(tl, 4.0) == pytest.approx(91.0)


def test_elastic_timeline_runs_smaller_between_two_pauses():
    # Slices of 2 and 3 chips; the 2-chip slice fails at 10 for 20 s; pause 1 s to drop and to re-add.
    tl = intr.elastic_timeline(np.array([10.0]), np.array([20.0]), np.array([2]), chips=5,
                               reconfig_s=1.0, horizon_s=100.0)
    assert tl.S[-1] == pytest.approx(98.0)
    assert tl.Q[-1] == pytest.approx(5 * 10 + 3 * 19 + 5 * 69)
    assert len(tl.wipes) == 0
    _, chip_s = intr.durable_points(tl, 7.0)
    assert chip_s.sum() == pytest.approx(tl.Q[-1])


def test_elastic_group_that_loses_every_slice_rolls_back():
    # One slice of 4 chips fails at 10 for 5 s: state lost; stepping resumes at 16 after the re-add pause.
    tl = intr.elastic_timeline(np.array([10.0]), np.array([5.0]), np.array([4]), chips=4,
                               reconfig_s=1.0, horizon_s=100.0)
    assert len(tl.wipes) == 1
    t, chip_s = intr.durable_points(tl, 4.0)
    assert chip_s.sum() == pytest.approx(4 * (8 + 84))
    assert t[:2].tolist() == pytest.approx([4.0, 8.0]) and t[-1] == 100.0


def test_salvage_keeps_the_work_up_to_the_last_snapshot_before_a_wipe():
    # As above: 10 s of stepping before the wipe at 10, durable points at 4 and 8. Snapshots every 3 s
    # (3, 6, 9): the one at 9 saves 1 s x 4 chips past the point at 8, merged at the wipe; 1 s is lost.
    tl = intr.elastic_timeline(np.array([10.0]), np.array([5.0]), np.array([4]), chips=4,
                               reconfig_s=1.0, horizon_s=100.0)
    t, chip_s = intr.salvage_points(tl, 4.0, 3.0)
    assert t.tolist() == [10.0] and chip_s.tolist() == pytest.approx([4.0])
    _, durable = intr.durable_points(tl, 4.0)
    assert tl.Q[-1] - durable.sum() - chip_s.sum() == pytest.approx(4 * 1.0), "only the last second is lost"
    # Snapshots no more often than the durable points save nothing; neither does a group never wiped.
    assert intr.salvage_points(tl, 4.0, 4.0)[1].size == 0
    assert intr.salvage_points(tl, 4.0, 8.0)[1].size == 0
    whole = intr.elastic_timeline(np.array([10.0]), np.array([20.0]), np.array([2]), chips=5,
                                  reconfig_s=1.0, horizon_s=100.0)
    assert intr.salvage_points(whole, 7.0, 1.0)[1].size == 0
