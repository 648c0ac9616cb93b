"""What the start-up stages read from a health monitor's snapshot: islands up, islands that stepped (pure)."""

from __future__ import annotations

from orchestrator.run.startup import StartupStages, islands_ready, stepped_islands


def _snapshot(*slots: tuple[int, str | None, int]) -> dict:
    """Slots as (incarnation, node or None, steps), keyed 0.. as the monitor's snapshot keys them."""
    return {"slots": {i: {"incarnation": inc, "node": node, "steps": steps} for i, (inc, node, steps) in enumerate(slots)}}


def test_an_island_is_up_once_its_process_of_this_session_answers():
    snap = _snapshot((1, "n1", 0), (1, None, 0), (3, "n2", 0))
    assert islands_ready(snap, {0: 1, 1: 1, 2: 1}) == 2
    # A resumed run's slot 2 starts at incarnation 4: the snapshot's incarnation 3 is the previous session's.
    assert islands_ready(snap, {0: 1, 1: 1, 2: 4}) == 1


def test_the_first_step_is_seen_on_any_island_while_others_still_start():
    snap = _snapshot((1, "n1", 2), (1, None, 0), (1, "n2", 0), (2, "n3", 5))
    assert stepped_islands(snap, {}) == [0, 3]
    assert stepped_islands(snap, {3: 3}) == [0]  # an earlier session's incarnation stepped, not this one
    assert stepped_islands(_snapshot((1, "n1", 0), (1, "n2", 0)), {}) == []


def test_the_first_step_stage_comes_once_and_is_seen_without_a_listener():
    got: list = []
    stages = StartupStages(got.append)
    stages.first_step([])
    assert got == [] and not stages.first_step_seen
    stages.first_step([0, 3])
    stages.first_step([1])
    assert [(s.name, s.text) for s in got] == [("first_step", "first step (island 0, 3)")]
    quiet = StartupStages(None)  # the driver's loop still needs to know: it scores the starting point then
    quiet.first_step([2])
    assert quiet.first_step_seen and not quiet.listening
