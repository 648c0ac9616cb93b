"""The outer optimizer's K where pools are elastic: K = all counts only the elastic slots holding an island.

The real OuterOptimizer core, settings built from a config as a run builds them (orchestrator.settings), no Ray.
Slots: a fixed pool of one island (slot 0) and an elastic pool {min: 0, max: 2} (slots 1, 2); K = 'all' = 3.
Without elastic slots a round keeps waiting for K islands (the synchronous baseline's stall), as before.
"""

from __future__ import annotations

import dataclasses

import torch

from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.fragments import plan_fragments
from tests.engine.test_outer_refusals import SHAPES, good
from tests.from_config import outer_from_config

ELASTIC_POOLS = [{"name": "fixed", "islands": 1}, {"name": "spot", "islands": {"min": 0, "max": 2}}]
FIXED_POOLS = [{"name": "fixed", "islands": 1}, {"name": "more", "islands": 2}]


def outer_for(pools: list[dict], registered: list[int]) -> OuterOptimizer:
    """An outer optimizer over test_outer_refusals' SHAPES in two fragments, K = all and no grace, its settings from
    a config of `pools`; `registered` slots hold an island (incarnation 1)."""
    torch.manual_seed(0)
    init = {n: torch.randn(s) for n, s in SHAPES.items()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    settings = outer_from_config({"pools": pools, "outer": {"min_quorum": "all", "grace_gamma": 0.0}})
    outer = OuterOptimizer(init, plan, settings=settings, embedding_names={"emb.weight"})
    for island in registered:
        outer.register(island, 1)
    return outer


def submit(outer: OuterOptimizer, islands: list[int], now: float = 1.0) -> list:
    """Fragment 0 submissions from `islands` (incarnation 1) in turn; the round results they close."""
    results = []
    for island in islands:
        got, refusal = outer.receive(good(outer, island=island), now=now)
        assert refusal is None
        results += got
    return results


def test_settings_carry_the_elastic_slots():
    s = outer_for(ELASTIC_POOLS, []).settings
    assert (s.min_quorum, s.elastic_slots, s.fixed_slots) == (3, frozenset({1, 2}), 1)


def test_fixed_and_one_elastic_island_close_a_k_all_round():
    outer = outer_for(ELASTIC_POOLS, [0, 1])
    assert submit(outer, [0]) == [], "one of the two islands the run has: still waiting"
    results = submit(outer, [1])
    assert [(r.fragment, r.version) for r in results] == [(0, 1)]
    assert sorted(set(results[0].record.participants)) == [0, 1]


def test_fixed_island_alone_closes_once_the_elastic_one_left():
    outer = outer_for(ELASTIC_POOLS, [0, 1])
    outer.unregister(1)
    assert [r.version for r in submit(outer, [0])] == [1]


def test_k_grows_back_when_an_elastic_island_joins():
    outer = outer_for(ELASTIC_POOLS, [0])
    outer.register(1, 1)
    outer.register(2, 1)
    assert submit(outer, [0, 1]) == [], "all three slots hold an island: K = 3"
    assert [r.version for r in submit(outer, [2])] == [1]


def test_without_elastic_slots_two_of_three_do_not_close():
    outer = outer_for(FIXED_POOLS, [0, 1, 2])
    assert outer.settings.elastic_slots == frozenset()
    assert submit(outer, [0, 1]) == [] and outer.versions == [0, 0]
    assert outer.poll(now=100.0) == []


def test_without_elastic_slots_a_dead_fixed_island_stalls_k_all():
    # The synchronous baseline waits for a dead fixed island's restart (decide_round's rule 1).
    outer = outer_for(FIXED_POOLS, [0, 1, 2])
    outer.unregister(2)
    assert submit(outer, [0, 1]) == [] and outer.poll(now=100.0) == []
    assert outer.versions == [0, 0]


def test_a_dead_fixed_island_still_counts_beside_elastic_slots():
    # Slot 0 is fixed: its island's death does not lower K, so the two elastic islands wait for its restart.
    outer = outer_for(ELASTIC_POOLS, [0, 1, 2])
    outer.unregister(0)
    assert submit(outer, [1, 2]) == [] and outer.poll(now=100.0) == [], "K = 1 fixed + 2 members = 3"
    outer.register(0, 2)  # restarted
    got, refusal = outer.receive(dataclasses.replace(good(outer, island=0), incarnation=2), now=101.0)
    assert refusal is None and [r.version for r in got] == [1]
