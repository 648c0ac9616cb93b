"""Salvage end to end in process (no Ray): a real LearnerIsland leaves progress snapshots, then "dies";
the real OuterOptimizer core merges what the salvage rules keep, without counting it as a vote."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch

from islands.island import LearnerIsland
from policies.compression import decompress
from policies.salvage import salvageable
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=2)


def setup(every: int = 3, compression: str = "none"):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, poison_guard=False))
    shelved: list[tuple[int, bytes]] = []
    islands = []
    for i in range(2):
        spec = spec_from_config(island=i, incarnation=1, pool="p", num_islands=2, model_config=w.cfg, plan=w.plan, inner=INNER,
                                sync_every_steps=8, seed=1, salvage_every_steps=every, compression=compression,
                                adoption="overwrite")  # P = 2: a cut every 4 steps
        islands.append(LearnerIsland(spec, w.data, w.latest, shelve=(lambda step, blob: shelved.append((step, blob))) if i else None))
        w.outer.register(i, 1)
    return w.outer, islands, shelved


@pytest.mark.parametrize("compression", ["none", "int4"])
def test_snapshots_hold_exactly_the_progress_a_cut_would_send(compression):
    # int4: the snapshot is encoded on the sender thread, from differences taken at the step boundary,
    # and still carries exactly the wire form a cut at that boundary sends.
    _, (_, island), shelved = setup(every=3, compression=compression)
    for _ in range(6):
        island.step()  # fragment 0 is cut at step 4 (seq 0); snapshots at steps 3 and 6
    island.wait_shelved()
    assert [step for step, _ in shelved] == [3, 6]
    snap = pickle.loads(shelved[-1][1])
    assert (snap.island, snap.incarnation, snap.next_seq, snap.step) == (1, 1, 1, 6)
    assert [(s.fragment, s.inner_steps) for s in snap.submissions] == [(0, 2), (1, 6)]
    assert island.status().unsubmitted_tokens == [s.tokens for s in snap.submissions], "a snapshot changes no counter"
    assert island.status().shelved_bytes == sum(len(b) for _, b in shelved)
    # The independent reference: the real cuts the final flush makes at the same step boundary.
    island.stop(flush=True)
    cuts = {s.fragment: s for s in iter(lambda: island.next_submission(0), None) if s.seq >= 1}
    for s in snap.submissions:
        assert (cuts[s.fragment].tokens, cuts[s.fragment].cursor) == (s.tokens, s.cursor)
        for a, b in zip(s.payload, cuts[s.fragment].payload):
            assert a.scheme == b.scheme == compression, "the snapshot went out in the run's wire format"
            assert torch.equal(decompress(a), decompress(b))


def test_a_dead_islands_salvaged_progress_merges_with_the_next_live_round_and_is_no_vote():
    outer, (live, dying), shelved = setup(every=3)
    for _ in range(6):
        dying.step()
    dying.wait_shelved()
    first = dying.next_submission(0)  # seq 0, fragment 0, cut at step 4: taken and merged while alive
    results, refusal = outer.receive(first, now=1.0)
    assert refusal is None and [r.version for r in results] == [1]
    outer.unregister(1)  # killed after its step-6 snapshot
    snap = pickle.loads(shelved[-1][1])
    got = salvageable(snap, taken={0: 0}, epoch=snap.epochs[0])
    assert got.skipped == {} and [s.seq for s in got.submissions] == [1, 2]
    salvaged = {s.fragment: s for s in got.submissions}
    # Fragment 0's snapshot is measured from version 0 and the round above made version 1: staleness 1, accepted.
    for s in got.submissions:
        results, refusal = outer.receive(s, now=2.0)
        assert refusal is None and results == [], "a dead island's work alone never closes a K = 1 round"
    assert outer.versions == [1, 0] and outer.pending_tokens() == [salvaged[0].tokens, salvaged[1].tokens]
    for _ in range(8):
        live.step()  # cuts fragment 0 at step 4 and fragment 1 at step 8
    merged = []
    for s in iter(lambda: live.next_submission(0), None):
        results, refusal = outer.receive(s, now=3.0)
        assert refusal is None
        merged += [(r.fragment, r.record.participants) for r in results]
    assert merged == [(0, [1, 0]), (1, [1, 0])], "each salvaged fragment joined the live island's round"
    assert outer.pending_tokens() == [0, 0]
    assert outer.tokens_merged[1] == salvaged[1].tokens + 8 * live.total_tokens // 8
    assert all(math.isfinite(float(t.sum())) for p in range(2) for t in outer.fragment(p))


def test_work_of_an_older_incarnation_is_still_refused():
    outer, (_, dying), _ = setup()
    for _ in range(4):
        dying.step()
    old = dying.next_submission(0)
    outer.unregister(1)
    outer.register(1, 2)  # the slot came back: incarnation 1's work no longer counts
    _, refusal = outer.receive(old, now=1.0)
    assert refusal is not None and "stale incarnation 1" in refusal.reason
    outer.unregister(1)
    _, refusal = outer.receive(old, now=1.0)
    assert refusal is not None and "unknown or dead island 1" in refusal.reason


def test_salvaged_work_is_taken_even_after_the_next_incarnation_registered():
    outer, (_, dying), shelved = setup(every=3)
    for _ in range(3):
        dying.step()
    dying.wait_shelved()
    outer.unregister(1)
    outer.register(1, 2)  # a warm spare took the slot before the salvage came off its (emulated) uplink
    got = salvageable(pickle.loads(shelved[-1][1]), taken={}, epoch=0)
    assert all(s.salvaged for s in got.submissions)
    for s in got.submissions:
        _, refusal = outer.receive(s, now=1.0)
        assert refusal is None
    assert outer.pending_tokens() == [s.tokens for s in got.submissions]
    forged = dataclasses.replace(got.submissions[0], incarnation=3, seq=99)
    _, refusal = outer.receive(forged, now=1.0)
    assert refusal is not None and "unknown or dead island 1: salvaged work of incarnation 3" in refusal.reason


def test_a_submission_keeps_its_vote_when_its_island_dies_after_sending_it():
    # K = 1: island 1 submits, then dies before its round closes (in a grace window, say). The round must
    # still close without waiting for another live island's submission (that wait stalled the run).
    outer, (_, dying), _ = setup()
    outer.hold()  # keep the round open across the death, as a grace window would
    for _ in range(4):
        dying.step()
    _, refusal = outer.receive(dying.next_submission(0), now=1.0)
    assert refusal is None and outer.versions == [0, 0]
    outer.unregister(1)
    outer.holding = False  # the window ends
    assert [(r.fragment, r.record.participants) for r in outer.poll(now=5.0)] == [(0, [1])], "its vote stood"
