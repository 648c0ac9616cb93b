"""The driver's goodput and uptime (orchestrator.core.accounting.run_goodput) over a monitor timeline and advances."""

from __future__ import annotations

import pytest

from orchestrator.core.accounting import kept_accounting, run_goodput

# Three islands; island 0 trained from 1 s, islands 1 and 2 from 6 s (they started cold, it in a prestarted worker).
TIMELINE = [(0.0, i, 1, "starting") for i in range(3)] + [(1.0, 0, 1, "training"), (6.0, 1, 1, "training"),
                                                           (6.0, 2, 1, "training")]
# Island 0 alone advanced at 10 and 20; from 22, with every island merged, every 2 s to the stop at 60.
ADVANCES = [10.0, 20.0] + [22.0 + 2.0 * k for k in range(20)]
FATES = {k: [0] for k in ("merged", "lost", "refused", "in_flight", "overwritten")}


def _good(**kw):
    return run_goodput(timeline=TIMELINE, useful_s=100.0, run_start=6.0, run_end=60.0, islands=3, advances=ADVANCES,
                       fates=FATES, stop_began=60.0, **kw)


def test_uptime_counts_from_the_first_advance_once_every_island_was_merged():
    full = _good(first_merged={0: 10.0, 1: 20.0, 2: 22.0})
    assert full["fill_s"] == 16.0 and full["uptime"] == 1.0 and full["uptime_window_s"] == 6.0
    # From the first advance, island 0's lone 10 s gap (4 s beyond the window) read as a stall in a clean run.
    early = _good()
    assert early["fill_s"] == 4.0 and early["uptime"] == pytest.approx(46.0 / 50.0)
    # An island never merged in the run (a short run's slow island): the clock starts at the first advance.
    assert _good(first_merged={0: 10.0, 1: 20.0}) == early


def test_an_island_that_failed_before_its_first_merge_ends_its_fill_at_the_failure():
    timeline = TIMELINE + [(8.0, 2, 1, "dead"), (9.0, 2, 2, "restarting")]
    good = run_goodput(timeline=timeline, useful_s=100.0, run_start=6.0, run_end=60.0, islands=3, advances=ADVANCES,
                       fates=FATES, stop_began=60.0, first_merged={0: 10.0, 1: 20.0, 2: 40.0})
    # Full at 20 (island 2's fill ended with its death at 8): the clock starts at the advance at 20, not at 40.
    assert good["fill_s"] == 14.0 and good["uptime"] == 1.0


def test_uptime_survives_an_outer_optimizer_restart():
    # Soak (benchmarks/soak.py): the outer optimizer killed at 31 s and back at 40 s restores a checkpoint that holds
    # no advances and no first merges; read alone, its accounting put the pipeline's fill at 40 s, after its own
    # restart, and uptime counted only from there: the stall the restart made was never seen.
    before = {"useful_s": 40.0, "advances": ADVANCES[:7], "first_merged": {0: 10.0, 1: 20.0, 2: 22.0}}
    after = {"useful_s": 38.0, "advances": [a for a in ADVANCES if a >= 40.0], "first_merged": {0: 40.0, 1: 40.0, 2: 42.0}}
    kept = kept_accounting(kept_accounting(None, before), after)
    assert kept["useful_s"] == 38.0  # the restored checkpoint's: work after it was undone
    assert kept["first_merged"] == {0: 10.0, 1: 20.0, 2: 22.0}
    assert kept["advances"] == ADVANCES[:7] + after["advances"]

    def good(acct):
        return run_goodput(timeline=TIMELINE, useful_s=100.0, run_start=6.0, run_end=60.0, islands=3,
                           advances=acct["advances"], fates=FATES, stop_began=60.0, first_merged=acct["first_merged"])

    alone, full = good(after), good(kept)
    assert alone["fill_s"] == 36.0 and alone["uptime"] == 1.0
    assert full["fill_s"] == 16.0 and full["uptime"] < 0.9  # 30 s to 40 s without an advance: a stall
