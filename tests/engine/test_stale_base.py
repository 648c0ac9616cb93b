"""The stale-base check end to end: real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray).

An honest island's base is a bit-for-bit copy of what the outer optimizer published as its version, through real
adoptions (overwrite and rebase, with cuts in flight), so its digest always matches and nothing is refused. An
island poisoned as `stale_submission` keeps measuring from the base it held when the fault began: refused far out
of line at its first submission after it adopted a newer version, and handed to the monitor at once.
"""

from __future__ import annotations

import pytest
import torch

from islands.island import LearnerIsland
from islands.messages import FragmentUpdate, Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.base_check import fragment_digest
from policies.compression import compress
from policies.poison_guard import FAR_OUT
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=1e-2, warmup_steps=0, batch_size=2)
ISLANDS = 3


def _world(adoption: str, **outer):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, poison_guard=True, **outer))
    islands = []
    for i in range(ISLANDS):
        spec = spec_from_config(island=i, incarnation=1, pool="p", num_islands=ISLANDS, model_config=w.cfg,
                                plan=w.plan, inner=INNER, sync_every_steps=8, seed=1 + i, adoption=adoption)
        islands.append(LearnerIsland(spec, w.data, w.latest))  # a cut every 4 steps, fragments in turn
        w.outer.register(i, 1)
    return w, islands


def _run(w, islands: list[LearnerIsland], cuts: int):
    """Each island steps to its next cut, the core takes it, and every island adopts what the core published."""
    refusals = []
    now = 0.0
    for _ in range(cuts):
        for island in islands:
            for _ in range(4):
                island.step()
            sub = island.next_submission(1.0)
            assert sub is not None
            now += 1.0
            results, refusal = w.outer.receive(sub, now=now)
            if refusal is not None:
                refusals.append(refusal)
            for r in results:
                for other in islands:
                    other.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
            for other in islands:
                other.apply_updates()
    return refusals


@pytest.mark.parametrize("adoption", ["overwrite", "rebase"])
def test_honest_islands_bases_match_what_was_published_through_real_adoptions(adoption):
    w, islands = _world(adoption)
    refusals = _run(w, islands, cuts=6)
    assert refusals == [], [r.reason for r in refusals]
    assert min(w.outer.versions) >= 4  # bases moved many times: the check had new versions to compare with
    assert w.outer.base_digests is not None and all(w.outer.base_digests.knows(p, v) for p, v in enumerate(w.outer.versions))


def test_a_stale_base_is_refused_far_out_of_line_once_the_island_holds_a_newer_version():
    w, islands = _world("overwrite")
    islands[0].inject("stale_submission")
    refusals = _run(w, islands, cuts=6)
    assert refusals, "nothing refused"
    assert {r.island for r in refusals} == {0}, [(r.island, r.reason) for r in refusals]
    assert all(r.reason.startswith(FAR_OUT) and "not version" in r.reason for r in refusals), refusals[0].reason
    assert (0, 1) in w.outer.take_poisoned()  # restarted at once: its copy is wrong, not its judgement
    # Its first cut of each fragment is measured from the base it holds (the fault's start): honest, and merged.
    assert w.outer.ledger()["merged"][0] > 0


def _submission(outer: OuterOptimizer, *, digest: str | None, epoch: int = 0) -> Submission:
    deltas = [torch.full(t.shape, 1e-3) for t in outer.params[0]]
    return Submission(island=0, incarnation=1, seq=0, fragment=0, base_version=outer.versions[0], tokens=100,
                      inner_steps=4, step_time_s=0.1, train_loss=3.0, payload=[compress(d, "none") for d in deltas],
                      base_epoch=epoch, base_digest=digest)


def test_a_base_of_another_epoch_or_under_a_lossy_downlink_is_not_judged():
    w, _ = _world("overwrite")
    wrong = fragment_digest([t + 1 for t in w.outer.params[0]])
    # Before an outer restart: the island's copy is of the old lineage, which the monitor resyncs.
    assert w.outer.receive(_submission(w.outer, digest=wrong, epoch=3), now=1.0)[1] is None
    refused = w.outer.receive(_submission(w.outer, digest=wrong), now=2.0)[1]
    assert refused is not None and refused.reason.startswith(FAR_OUT)
    # Islands decode a bf16 downlink to other values than the outer optimizer's float32: nothing to compare.
    lossy, _ = _world("overwrite", downlink="bf16")
    assert lossy.outer.base_digests is None
    assert lossy.outer.receive(_submission(lossy.outer, digest=wrong), now=1.0)[1] is None


def test_an_island_started_mid_run_says_so_in_every_submission():
    # The poison guard reads a cosine from such an incarnation as never beyond doubt (policies/poison_guard.py).
    w, islands = _world("rebase")
    _run(w, islands, cuts=2)
    latest = [FragmentUpdate(p, w.outer.versions[p], [w.outer.fragment(p)]) for p in range(2)]
    spec = spec_from_config(island=0, incarnation=2, pool="p", num_islands=ISLANDS, model_config=w.cfg, plan=w.plan,
                            inner=INNER, sync_every_steps=8, seed=9, adoption="rebase")
    restarted = LearnerIsland(spec, w.data, latest)
    for _ in range(4):
        restarted.step()
    sub = restarted.next_submission(1.0)
    assert sub is not None and sub.started_at_version == max(w.outer.versions) > 0
    for _ in range(4):
        islands[1].step()
    first = islands[1].next_submission(1.0)
    assert first is not None and first.started_at_version == 0, "an island that started with the run"
