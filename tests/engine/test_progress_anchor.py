"""What an island's unsubmitted progress is measured from, and what adoption keeps of it.

A cut carries fragment p's progress since the previous cut. While it is in flight (taken by nobody yet, or
not merged yet), a later cut, a salvage snapshot or the final flush must measure from the parameters at that
cut, or they would carry its progress a second time. Adoption: `overwrite` replaces the local fragment (the
paper), `rebase` keeps the progress not yet merged on top of the new version (docs/architecture.md section 3).

Real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray). The references are the
island's own parameters recorded step by step and the outer optimizer's published fragments, combined here.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from policies.compression import decompress
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=1e-2, warmup_steps=0, batch_size=2)


def setup(adoption: str, every: int = 0):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, poison_guard=False))
    shelved: list[bytes] = []
    islands = []
    for i in range(2):
        spec = spec_from_config(island=i, incarnation=1, pool="p", num_islands=2, model_config=w.cfg, plan=w.plan, inner=INNER,
                                sync_every_steps=8, seed=1, adoption=adoption, salvage_every_steps=every)  # a cut every 4 steps
        islands.append(LearnerIsland(spec, w.data, w.latest, shelve=lambda step, blob: shelved.append(blob)))
        w.outer.register(i, 1)
    return w, islands, shelved


def frag(island: LearnerIsland, w, p: int = 0) -> list[torch.Tensor]:
    params = island.parameters()
    return [params[n].float() for n in w.plan.fragments[p]]


def decoded(sub) -> list[torch.Tensor]:
    return [decompress(c) for c in sub.payload]


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(a, b))


def sub(a, b):
    return [x - y for x, y in zip(a, b)]


def add(a, b):
    return [x + y for x, y in zip(a, b)]


def merge_and_adopt(w, island: LearnerIsland, submission, *, now: float, version: int) -> list[torch.Tensor]:
    """The outer optimizer merges `submission` into fragment 0's `version`; `island` adopts it at a step boundary."""
    results, refusal = w.outer.receive(submission, now=now)
    assert refusal is None and [r.version for r in results] == [version]
    for r in results:
        island.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
    island.apply_updates()
    return [t.float() for t in results[0].tensors]


def others_round(w, other: LearnerIsland, island: LearnerIsland) -> list[torch.Tensor]:
    """`other` cuts fragment 0 after 4 steps, which makes version 1 without `island`; `island` adopts it."""
    for _ in range(4):
        other.step()
    return merge_and_adopt(w, island, other.next_submission(0), now=1.0, version=1)


def flushed(island: LearnerIsland, p: int):
    island.stop(flush=True)
    cuts = [s for s in iter(lambda: island.next_submission(0), None) if s.fragment == p]
    return cuts[-1]


def test_a_snapshot_and_the_flush_made_while_a_cut_is_in_flight_carry_only_the_steps_since_it():
    w, (_, island), shelved = setup("overwrite", every=3)
    base = [t.float() for t in w.latest[0].tensors[0]]
    theta = {}
    for step in range(1, 7):
        island.step()  # fragment 0 is cut at step 4 (seq 0); snapshots at steps 3 and 6
        theta[step] = frag(island, w)
    island.wait_shelved()
    cut = island.next_submission(0)
    assert (cut.seq, cut.fragment) == (0, 0)
    snap = {s.fragment: s for s in pickle.loads(shelved[-1]).submissions}[0]
    assert close(decoded(cut), sub(base, theta[4]))
    assert close(decoded(snap), sub(theta[4], theta[6])), "the step-6 snapshot holds steps 5-6 only"
    flush = flushed(island, 0)
    assert close(decoded(flush), sub(theta[4], theta[6])), "so does the final flush"
    assert close(add(decoded(cut), decoded(flush)), sub(base, theta[6])), "together: all progress, once"


def test_rebase_keeps_unmerged_progress_through_others_rounds_and_its_own():
    w, (other, island), _ = setup("rebase")
    v0 = [t.float() for t in w.latest[0].tensors[0]]
    for _ in range(4):
        island.step()  # cut of fragment 0 at step 4 (seq 0)
    at_cut = frag(island, w)
    mine = island.next_submission(0)
    for _ in range(2):
        island.step()
    before = frag(island, w)
    v1 = others_round(w, other, island)  # another island's round makes version 1 of fragment 0 without us
    assert close(frag(island, w), add(v1, sub(before, v0))), "rebase: v1 plus everything since v0"
    # Our cut, still in flight, now merges: version 2 holds it; only the steps after it stay local.
    shifted_cut = add(at_cut, sub(v1, v0))
    before = frag(island, w)
    v2 = merge_and_adopt(w, island, mine, now=2.0, version=2)
    assert close(frag(island, w), add(v2, sub(before, shifted_cut))), "its own round: v2 plus the steps after its cut"
    island.step()
    end = frag(island, w)
    flush = flushed(island, 0)
    assert close(decoded(flush), sub(v2, end)), "nothing in flight: measured from the version it holds"


def test_rebase_measures_a_cut_made_while_an_earlier_one_is_in_flight_from_that_cut_shifted_by_rounds():
    w, (other, island), _ = setup("rebase")
    v0 = [t.float() for t in w.latest[0].tensors[0]]
    for _ in range(4):
        island.step()
    at_cut = frag(island, w)
    assert island.next_submission(0).seq == 0  # taken, never merged: in flight to the end
    v1 = others_round(w, other, island)
    island.step()
    island.step()
    end = frag(island, w)
    flush = flushed(island, 0)
    assert close(decoded(flush), sub(add(at_cut, sub(v1, v0)), end)), "from the cut, moved by v1 - v0 as theta was"


def test_overwrite_measures_from_the_new_version_once_a_round_replaced_the_fragment():
    w, (other, island), _ = setup("overwrite")
    for _ in range(4):
        island.step()
    assert island.next_submission(0).seq == 0  # in flight
    v1 = others_round(w, other, island)
    assert close(frag(island, w), v1), "overwrite: the local fragment is replaced"
    island.step()
    end = frag(island, w)
    flush = flushed(island, 0)
    assert close(decoded(flush), sub(v1, end)), "the cut in flight no longer measures anything"


def test_a_flush_behind_a_cut_in_flight_puts_the_global_fragment_at_the_islands_parameters():
    # K = 2: the island's cut waits in the outer optimizer for a second island that never submits.
    w = nano_world(outer_from_config(min_quorum=2, grace_gamma=float("inf"), grace_cap_s=float("inf")))
    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=2, model_config=w.cfg, plan=w.plan, inner=INNER,
                            sync_every_steps=8, seed=1, adoption="overwrite")
    island = LearnerIsland(spec, w.data, w.latest)
    w.outer.register(0, 1)
    w.outer.register(1, 1)
    for _ in range(6):
        island.step()  # fragment 0 cut at step 4, pending in the outer optimizer
    results, refusal = w.outer.receive(island.next_submission(0), now=1.0)
    assert refusal is None and results == []
    end = frag(island, w)
    flush = flushed(island, 0)  # steps 5-6, measured from the cut
    results, refusal = w.outer.receive(flush, now=2.0)
    assert refusal is None and results == []
    (final, *_) = w.outer.close_all(now=3.0)
    assert final.fragment == 0 and final.record.participants == [0, 0]
    assert close([t.float() for t in final.tensors], end), \
        "its two segments are one outer gradient: the final step lands on the island's parameters"
    assert sum(final.record.weights) == pytest.approx(1.0)


def test_overwritten_progress_is_counted_as_overwritten_not_as_the_next_cuts():
    for adoption in ("overwrite", "rebase"):
        w, (other, island), _ = setup(adoption)
        for _ in range(6):
            island.step()  # cut of fragment 0 at step 4; steps 5-6 unsubmitted on both fragments
        per_step = island.total_tokens // island.total_steps
        others_round(w, other, island)
        st = island.status()
        if adoption == "overwrite":
            assert st.overwritten_tokens == [2 * per_step, 0] and st.unsubmitted_tokens == [0, 6 * per_step]
        else:
            assert st.overwritten_tokens == [0, 0] and st.unsubmitted_tokens == [2 * per_step, 6 * per_step]
        island.step()
        flush = flushed(island, 0)
        assert flush.tokens == (1 if adoption == "overwrite" else 3) * per_step, adoption
