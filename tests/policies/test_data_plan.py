"""The data plan (policies/data_plan.py): which island reads which units, in which order; pure, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from policies.data_plan import assign_units, block_permutation, copies_differ, epoch_order


def loads(sizes: list[int], plan: list[list[int]]) -> list[int]:
    return [sum(sizes[u] for u in units) for units in plan]


def assert_partition(plan: list[list[int]], n: int) -> None:
    flat = [u for units in plan for u in units]
    assert sorted(flat) == list(range(n)), plan  # every unit exactly once
    assert all(plan), plan  # every island has a unit


# --- assign_units, shuffled ---------------------------------------------------------------------


@pytest.mark.parametrize("islands", [1, 2, 3, 7])
@pytest.mark.parametrize("seed", [0, 5])
def test_shuffled_plan_gives_every_unit_once_and_balances_tokens_within_the_largest_unit(islands: int, seed: int) -> None:
    sizes = np.random.default_rng(123).integers(1, 1000, size=40).tolist()
    plan = assign_units(sizes, islands, seed=seed)
    assert len(plan) == islands
    assert_partition(plan, len(sizes))
    # Greedy to the least-loaded island keeps every island within one unit of every other.
    per_island = loads(sizes, plan)
    assert max(per_island) - min(per_island) <= max(sizes), per_island


def test_shuffled_plan_of_equal_units_differs_by_at_most_one_unit_per_island() -> None:
    plan = assign_units([10] * 23, 4, seed=3)
    assert sorted(len(units) for units in plan) == [5, 6, 6, 6]


def test_an_island_given_a_huge_unit_gets_nothing_after_it() -> None:
    # The other islands never catch up with 1000 tokens, so the least-loaded rule never picks that island again.
    sizes = [1] * 10 + [1000] + [1] * 10
    for seed in range(5):
        plan = assign_units(sizes, 2, seed=seed)
        big = next(units for units in plan if 10 in units)
        assert big[-1] == 10, (seed, plan)


def test_every_island_gets_a_unit_even_when_one_unit_holds_almost_everything() -> None:
    for seed in range(5):
        plan = assign_units([10**6, 1, 1], 3, seed=seed)
        assert sorted(len(units) for units in plan) == [1, 1, 1]


def test_shuffled_plan_is_a_function_of_the_seed() -> None:
    sizes = list(range(1, 31))
    first = assign_units(sizes, 3, seed=11)
    assert assign_units(sizes, 3, seed=11) == first
    assert assign_units(tuple(sizes), 3, seed=11) == first  # any sequence
    assert assign_units(sizes, 3, seed=12) != first
    assert assign_units(sizes, 3, seed=11, shuffle=False) != first


def test_one_island_gets_every_unit() -> None:
    assert sorted(assign_units([3, 1, 2], 1, seed=0)[0]) == [0, 1, 2]
    assert assign_units([3, 1, 2], 1, seed=0, shuffle=False) == [[0, 1, 2]]


# --- assign_units, source order -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "islands", "expected"),
    [
        ([10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
        ([30, 10, 10, 10], 2, [[0], [1, 2, 3]]),  # unit 1 starts at 30 = half of 60
        ([100, 1, 1], 2, [[0], [1, 2]]),
        ([5] * 10, 3, [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]),  # starts 20 >= 50/3 and 35 >= 100/3
        ([1, 1, 1, 100], 3, [[0, 1], [2], [3]]),  # no unit starts past 1/3: moved so every island keeps one
        ([0, 0, 0], 3, [[0], [1], [2]]),  # no tokens at all
    ],
)
def test_source_order_plan_is_contiguous_runs_cut_at_the_token_fractions(sizes, islands, expected) -> None:
    plan = assign_units(sizes, islands, seed=0, shuffle=False)
    assert plan == expected
    assert assign_units(sizes, islands, seed=99, shuffle=False) == expected  # the seed plays no part


def test_source_order_plan_on_many_units_is_contiguous_and_roughly_balanced() -> None:
    sizes = np.random.default_rng(0).integers(1, 50, size=200).tolist()
    plan = assign_units(sizes, 5, seed=0, shuffle=False)
    assert [u for units in plan for u in units] == list(range(200))
    assert all(plan)
    total = sum(sizes)
    for units in plan:
        assert abs(sum(sizes[u] for u in units) - total / 5) <= max(sizes)


# --- assign_units, errors -----------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_fewer_units_than_islands_is_an_error_that_says_what_to_do(shuffle: bool) -> None:
    with pytest.raises(ValueError, match="2 units for 3 islands") as exc:
        assign_units([5, 5], 3, seed=0, shuffle=shuffle)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError):
        assign_units([], 1, seed=0, shuffle=shuffle)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(sizes=[1, 2], islands=0, seed=0), "islands=0"),
        (dict(sizes=[1, 2], islands=2.0, seed=0), "islands=2.0"),
        (dict(sizes=[1, 2], islands=1, seed=-1), "seed=-1"),
        (dict(sizes=[1, -2], islands=1, seed=0), "non-negative"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        assign_units(**kwargs)


# --- epoch_order, block_permutation -------------------------------------------------------------


def test_epoch_order_is_a_permutation_seeded_by_seed_island_and_epoch() -> None:
    order = epoch_order(20, seed=1, island=0, epoch=0)
    assert sorted(order) == list(range(20)) and order != list(range(20))
    assert epoch_order(20, seed=1, island=0, epoch=0) == order
    assert epoch_order(20, seed=1, island=0, epoch=1) != order
    assert epoch_order(20, seed=1, island=1, epoch=0) != order
    assert epoch_order(20, seed=2, island=0, epoch=0) != order
    assert epoch_order(1, seed=1, island=3, epoch=9) == [0]


def test_epoch_order_without_shuffle_is_source_order() -> None:
    assert epoch_order(5, seed=1, island=2, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kwargs", [dict(count=0, island=0, epoch=0), dict(count=3, island=-1, epoch=0),
                                    dict(count=3, island=0, epoch=-1)])
def test_epoch_order_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises(ValueError):
        epoch_order(seed=0, **kwargs)


def test_block_permutation_is_a_permutation_seeded_per_block() -> None:
    perm = block_permutation(32, seed=4, island=1, block=0)
    assert isinstance(perm, np.ndarray) and sorted(perm.tolist()) == list(range(32))
    assert np.array_equal(block_permutation(32, seed=4, island=1, block=0), perm)
    for other in (dict(seed=4, island=1, block=1), dict(seed=4, island=0, block=0), dict(seed=5, island=1, block=0)):
        assert not np.array_equal(block_permutation(32, **other), perm), other
    assert block_permutation(1, seed=0, island=0, block=7).tolist() == [0]
    with pytest.raises(ValueError):
        block_permutation(0, seed=0, island=0, block=0)
    with pytest.raises(ValueError):
        block_permutation(4, seed=0, island=0, block=-1)


def test_the_plans_random_streams_are_apart() -> None:
    # The same (seed, island, index) must not give the epoch order and the block order the same permutation.
    assert epoch_order(32, seed=0, island=0, epoch=0) != block_permutation(32, seed=0, island=0, block=0).tolist()


# --- copies_differ ------------------------------------------------------------------------------

REFERENCE = [("a.bin@0", 100), ("a.bin@100", 100), ("b.bin@0", 40)]


def test_equal_copies_do_not_differ() -> None:
    assert copies_differ(REFERENCE, list(REFERENCE)) is None
    assert copies_differ([], []) is None


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (REFERENCE[:2], ["2 entries", "3"]),
        (REFERENCE + [("c.bin@0", 1)], ["4 entries", "3"]),
        ([REFERENCE[0], ("x.bin@100", 100), REFERENCE[2]], ["'x.bin@100'", "'a.bin@100'"]),
        ([REFERENCE[0], REFERENCE[1], ("b.bin@0", 39)], ["'b.bin@0'", "39", "40"]),
    ],
)
def test_copies_that_differ_are_described_in_one_line(other, words) -> None:
    message = copies_differ(REFERENCE, other)
    assert message is not None and "\n" not in message
    for word in words:
        assert word in message, message


def test_copies_differ_names_the_first_difference() -> None:
    other = [("a.bin@0", 99), ("z", 100), ("b.bin@0", 40)]
    assert copies_differ(REFERENCE, other) == "'a.bin@0' holds 99 against 100"
