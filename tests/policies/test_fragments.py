"""Fragment planning: hand-packed plans, a brute-force LPT reference, and the errors."""

import random

import pytest

from policies.fragments import FragmentPlan, plan_fragments


def _reference_lpt(pairs, p):
    """Independent LPT: repeatedly take the largest unplaced tensor (first on ties) into the lightest bin."""
    remaining = list(enumerate(pairs))
    bins = [[] for _ in range(p)]
    totals = [0] * p
    while remaining:
        best = max(remaining, key=lambda item: (item[1][1], -item[0]))
        remaining.remove(best)
        lightest = totals.index(min(totals))  # index() returns the lowest index on ties
        bins[lightest].append(best[0])
        totals[lightest] += best[1][1]
    return tuple(tuple(pairs[i][0] for i in sorted(b)) for b in bins), tuple(totals)


def test_hand_packed_example():
    # Visit by size: d(40) -> f0=40; b(30) -> f1=30; c(20) -> f1=50 (30 < 40); a(10) -> f0=50;
    # e(10) -> f0=60 (50 = 50, lowest index). Names inside a fragment keep input order.
    plan = plan_fragments([("a", 10), ("b", 30), ("c", 20), ("d", 40), ("e", 10)], 2)
    assert plan.fragments == (("a", "d", "e"), ("b", "c"))
    assert plan.nbytes == (60, 50)
    assert plan.num_fragments == 2
    assert plan.fragment_of("e") == 0
    assert plan.fragment_of("c") == 1


def test_ties_go_to_lowest_index_and_keep_input_order():
    plan = plan_fragments([("x", 8), ("y", 8), ("z", 8), ("w", 8)], 3)
    # x -> f0, y -> f1, z -> f2, w -> f0 (all 8, lowest index).
    assert plan.fragments == (("x", "w"), ("y",), ("z",))
    assert plan.nbytes == (16, 8, 8)


def test_one_fragment_keeps_model_order():
    pairs = [("emb", 100), ("w1", 5), ("w2", 300), ("head", 100)]
    plan = plan_fragments(pairs, 1)
    assert plan.fragments == (("emb", "w1", "w2", "head"),)
    assert plan.nbytes == (505,)


def test_matches_reference_on_random_models():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 30)
        pairs = [(f"t{i}", rng.choice([0, 1, 4, 16, 64, rng.randint(0, 1000)])) for i in range(n)]
        p = rng.randint(1, n)
        plan = plan_fragments(pairs, p)
        assert (plan.fragments, plan.nbytes) == _reference_lpt(pairs, p), (trial, pairs, p)
        # Every tensor placed exactly once, and totals are consistent.
        names = [name for frag in plan.fragments for name in frag]
        assert sorted(names) == sorted(name for name, _ in pairs)
        sizes = dict(pairs)
        assert plan.nbytes == tuple(sum(sizes[nm] for nm in frag) for frag in plan.fragments)


def test_deterministic():
    pairs = [(f"t{i}", (i * 37) % 11) for i in range(20)]
    assert plan_fragments(pairs, 4) == plan_fragments(list(pairs), 4)


def test_fragment_of_unknown_name():
    plan = plan_fragments([("a", 1)], 1)
    with pytest.raises(KeyError, match="'nope' is in no fragment"):
        plan.fragment_of("nope")


@pytest.mark.parametrize(
    "pairs, p, match",
    [
        ([("a", 1)], 0, "num_fragments must be >= 1, got 0"),
        ([("a", 1), ("b", 2)], 3, r"number of tensors \(2\), got 3"),
        ([("a", 1), ("a", 2)], 1, "duplicate tensor name 'a'"),
        ([("a", 1), ("b", -2)], 1, "'b' has nbytes -2"),
    ],
)
def test_errors(pairs, p, match):
    with pytest.raises(ValueError, match=match):
        plan_fragments(pairs, p)


def test_plan_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 fragments but 1 byte totals"):
        FragmentPlan(fragments=(("a",), ("b",)), nbytes=(1,))
