"""Merge weights: hand-computed values for each scheme and the staleness discount."""

import pytest

from policies.weighting import WEIGHT_SCHEMES, merge_weights


def test_tokens_scheme_is_quantity_times_quality():
    # 100 * (100 / 10) = 1000 and 200 * (200 / 10) = 4000 -> 0.2, 0.8
    assert merge_weights(tokens=[100, 200], steps=[10, 10]) == pytest.approx([0.2, 0.8])


def test_tokens_scheme_rewards_larger_batches():
    # Same tokens, half the steps (twice the batch): 100 * 10 = 1000 vs 100 * 20 = 2000.
    assert merge_weights(tokens=[100, 100], steps=[10, 5]) == pytest.approx([1 / 3, 2 / 3])


def test_uniform_scheme():
    assert merge_weights(tokens=[5, 0, 7], steps=[1, 2, 3], scheme="uniform") == pytest.approx([1 / 3] * 3)


def test_staleness_discount():
    # 4000 * (1 + 3) ** -0.5 = 2000 against 1000 -> 1/3, 2/3
    w = merge_weights(tokens=[100, 200], steps=[10, 10], staleness=[0, 3], staleness_discount=0.5)
    assert w == pytest.approx([1 / 3, 2 / 3])


def test_zero_discount_ignores_staleness():
    w = merge_weights(tokens=[1, 1], steps=[1, 1], scheme="uniform", staleness=[0, 100])
    assert w == pytest.approx([0.5, 0.5])


def test_weights_sum_to_one():
    w = merge_weights(tokens=[3.5, 1e6, 12], steps=[7, 1000, 1], staleness=[2, 0, 5], staleness_discount=1.3)
    assert sum(w) == pytest.approx(1.0, abs=1e-12)
    assert all(x > 0 for x in w)


def test_a_zero_token_submission_gets_zero_weight():
    assert merge_weights(tokens=[0, 10], steps=[3, 2]) == [0.0, 1.0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=[], steps=[]), "no submissions"),
        (dict(tokens=[1, 2], steps=[1]), "tokens has 2 entries but steps has 1"),
        (dict(tokens=[1], steps=[0]), r"steps\[0\] must be > 0, got 0"),
        (dict(tokens=[-1], steps=[1]), r"tokens\[0\] must be >= 0, got -1"),
        (dict(tokens=[1], steps=[1], scheme="bytes"), "unknown weighting scheme 'bytes'"),
        (dict(tokens=[0, 0], steps=[1, 1]), "all merge weights are zero"),
        (dict(tokens=[1], steps=[1], staleness_discount=-1.0), "staleness_discount must be >= 0"),
        (dict(tokens=[1], steps=[1], staleness_discount=1.0), "needs staleness"),
        (dict(tokens=[1], steps=[1], staleness=[1, 2], staleness_discount=1.0), "staleness has 2 entries"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        merge_weights(**kwargs)


def test_unknown_scheme_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        merge_weights(tokens=[1], steps=[1], scheme="nope")
    for name in WEIGHT_SCHEMES:
        assert name in str(info.value)
