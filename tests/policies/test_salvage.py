"""Salvage rules (policies/salvage.py) and the keeper's bookkeeping (orchestrator/actors/keeper.py), without Ray."""

from __future__ import annotations

import pytest

from islands.messages import Submission
from orchestrator.actors.keeper import ProgressKeeper, keeper_name
from policies.salvage import ProgressSnapshot, salvage_due, salvageable


def sub(fragment: int, seq: int, *, island: int = 1, incarnation: int = 2, tokens: int = 100) -> Submission:
    return Submission(island=island, incarnation=incarnation, seq=seq, fragment=fragment, base_version=3,
                      tokens=tokens, inner_steps=tokens // 10, step_time_s=0.1, train_loss=2.0, payload=[])


def snapshot(next_seq: int = 5, epochs=(0, 0, 0), subs=None) -> ProgressSnapshot:
    subs = subs if subs is not None else [sub(0, next_seq), sub(1, next_seq + 1), sub(2, next_seq + 2)]
    return ProgressSnapshot(island=1, incarnation=2, next_seq=next_seq, epochs=list(epochs), step=50, submissions=subs)


def test_salvage_due_every_n_steps_and_never_when_off():
    assert [s for s in range(1, 16) if salvage_due(s, 5)] == [5, 10, 15]
    assert not any(salvage_due(s, 0) for s in range(1, 16))
    assert not salvage_due(0, 5), "no step taken, no progress to keep"


def test_nothing_taken_since_the_snapshot_salvages_every_fragment_renumbered_after_the_snapshot():
    got = salvageable(snapshot(next_seq=5), taken={0: 2, 1: 3, 2: 4}, epoch=0)
    assert got.skipped == {}
    assert [(s.fragment, s.seq, s.tokens) for s in got.submissions] == [(0, 5, 100), (1, 6, 100), (2, 7, 100)]


def test_a_fragment_cut_again_after_the_snapshot_is_covered_by_that_cut():
    # Seq 5 (fragment 2) and 6 (fragment 0) were cut and taken after the snapshot: their progress is in them.
    got = salvageable(snapshot(next_seq=5), taken={0: 6, 1: 4, 2: 5}, epoch=0)
    assert sorted(got.skipped) == [0, 2] and "cut again after the snapshot" in got.skipped[0]
    assert [(s.fragment, s.seq) for s in got.submissions] == [(1, 7)], "renumbered above every seq seen"


def test_a_cut_taken_before_the_snapshot_does_not_cover_it():
    got = salvageable(snapshot(next_seq=5), taken={1: 4}, epoch=0)
    assert 1 not in got.skipped and len(got.submissions) == 3


def test_progress_measured_from_a_restarted_outer_optimizers_lineage_is_skipped():
    got = salvageable(snapshot(epochs=(0, 1, 1)), taken={}, epoch=1)
    assert list(got.skipped) == [0] and "epoch 0, now 1" in got.skipped[0]
    assert [s.fragment for s in got.submissions] == [1, 2]


def test_a_snapshot_mixing_incarnations_is_an_error():
    bad = snapshot(subs=[sub(0, 5), sub(1, 6, incarnation=1)])
    with pytest.raises(ValueError, match="holds a submission of 1/1"):
        salvageable(bad, taken={}, epoch=0)


def test_keeper_holds_the_newest_snapshot_per_island_and_hands_it_over_once():
    k = ProgressKeeper("a")
    assert k.keep(1, 2, 10, b"ten") and k.keep(1, 2, 15, b"fifteen")
    assert not k.keep(1, 2, 12, b"late"), "an older step never replaces a newer one"
    assert not k.keep(1, 1, 99, b"zombie"), "nor does an older incarnation"
    assert k.keep(0, 1, 5, b"other")
    assert {i: (h["incarnation"], h["step"], h["bytes"]) for i, h in k.held().items()} == {1: (2, 15, 7), 0: (1, 5, 5)}
    assert k.take(1, 1) is None, "only the incarnation that died is salvaged"
    assert k.take(1, 2) == b"fifteen"
    assert k.take(1, 2) is None, "handed over once"
    assert k.keep(1, 3, 5, b"new incarnation") and k.take(1, 3) == b"new incarnation"
    assert keeper_name("run7", "a") == "run7-keeper-a"


def test_a_moved_keeper_adopts_its_predecessors_snapshots_but_never_over_newer_ones():
    old, new = ProgressKeeper("a"), ProgressKeeper("a")
    old.keep(0, 1, 10, b"zero@10")
    old.keep(1, 2, 20, b"one@20")
    old.keep(2, 1, 30, b"two@30")
    new.keep(1, 2, 25, b"one@25")  # island 1 shelved into the new keeper before the hand-over arrived
    new.keep(2, 1, 5, b"two@5")  # an out-of-order older one: the predecessor's newer one wins
    assert new.load(old.dump()) == 2
    assert {i: (h["incarnation"], h["step"]) for i, h in new.held().items()} == {0: (1, 10), 1: (2, 25), 2: (1, 30)}
    assert new.take(0, 1) == b"zero@10" and new.take(1, 2) == b"one@25" and new.take(2, 1) == b"two@30"
    assert old.dump() is not old._held, "a dump is a copy"

