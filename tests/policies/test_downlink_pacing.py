"""The downlink's pacing rule (outer.downlink_every), pure: which versions go to an island."""

from __future__ import annotations

import pytest

from policies.downlink_pacing import paced_send


def sent(rounds: list[bool], every: int, last: int | None = 0) -> list[int]:
    """Versions 1..n sent to one island, given whether it took part in each version's round (the rule, replayed)."""
    out = []
    for version, participant in enumerate(rounds, start=1):
        if paced_send(version, last, every, participant):
            out.append(version)
            last = version
    return out


def test_every_one_sends_every_version():
    assert sent([False] * 6, every=1) == [1, 2, 3, 4, 5, 6]


def test_every_two_with_four_islands_in_turn_halves_the_sends():
    # K = 1, four islands taking part in turn: this island's own rounds are versions 1, 5, 9.
    turns = [v % 4 == 1 for v in range(1, 13)]
    assert sent(turns, every=2) == [1, 3, 5, 7, 9, 11]
    assert sent(turns, every=4) == [1, 5, 9]  # only its own rounds: publish_to participants' M = 1
    assert sent(turns, every=3) == [1, 4, 5, 8, 9, 12]


def test_own_rounds_always_go_and_a_fresh_incarnation_gets_the_next_version():
    assert paced_send(8, 7, every=5, participant=True)
    assert not paced_send(8, 7, every=5, participant=False)
    assert paced_send(8, None, every=5, participant=False)
    assert paced_send(12, 7, every=5, participant=False)


def test_every_below_one_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="downlink_every must be >= 1, got 0; use 1 to send every version"):
        paced_send(3, 1, every=0, participant=False)
