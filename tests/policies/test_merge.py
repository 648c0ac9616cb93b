"""Merge rules: a hand golden value, a numpy reference for RDA, and the property RDA exists for."""

import math

import numpy as np
import pytest
import torch

from policies.merge import MERGE_RULES, join_segments, mean_merge, merge_fragment, rda_merge


def _rda_reference(deltas, weights):
    """Independent float64 numpy RDA."""
    arrays = [np.asarray(d, dtype=np.float64) for d in deltas]
    r = sum(w * np.linalg.norm(a) for a, w in zip(arrays, weights))
    u = np.zeros_like(arrays[0])
    for a, w in zip(arrays, weights):
        n = np.linalg.norm(a)
        if n > 0:
            u += w * a / n
    un = np.linalg.norm(u)
    return np.zeros_like(u) if un == 0 else r * u / un


def test_golden_hand_example():
    d1, d2 = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 2.0])
    # r = 0.5*5 + 0.5*2 = 3.5; u = 0.5*[0.6, 0.8] + 0.5*[0, 1] = [0.3, 0.9]; |u| = sqrt(0.9)
    expected = [3.5 * 0.3 / math.sqrt(0.9), 3.5 * 0.9 / math.sqrt(0.9)]  # [1.10680, 3.32039]
    got = rda_merge([d1, d2], [0.5, 0.5])
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(expected, rel=1e-6)
    assert mean_merge([d1, d2], [0.5, 0.5]).tolist() == [1.5, 3.0]


def test_matches_numpy_reference():
    gen = torch.Generator().manual_seed(0)
    for m in (1, 2, 5):
        deltas = [torch.randn(7, 3, generator=gen) * (i + 1) for i in range(m)]
        weights = torch.rand(m, generator=gen).tolist()
        weights = [w / sum(weights) for w in weights]
        ref = _rda_reference([d.numpy() for d in deltas], weights)
        np.testing.assert_allclose(rda_merge(deltas, weights).numpy(), ref, rtol=1e-5, atol=1e-6)
        mean_ref = sum(w * d.double().numpy() for d, w in zip(deltas, weights))
        np.testing.assert_allclose(mean_merge(deltas, weights).numpy(), mean_ref, rtol=1e-5, atol=1e-6)


def test_single_delta_comes_back():
    d = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(rda_merge([d], [1.0]), d, rtol=1e-6, atol=1e-6)


def test_zero_and_cancelling_deltas():
    z = torch.zeros(3)
    d = torch.tensor([1.0, 2.0, 2.0])
    # The zero delta adds nothing to u but keeps its weight in r: r = 0.5 * 3.
    torch.testing.assert_close(rda_merge([z, d], [0.5, 0.5]), d * 0.5)
    assert torch.equal(rda_merge([z, z], [0.5, 0.5]), z)
    assert torch.equal(rda_merge([d, -d], [0.5, 0.5]), z)


def test_rda_norm_does_not_shrink_with_more_islands_but_mean_does():
    gen = torch.Generator().manual_seed(2)
    dim = 4096  # random vectors in high dimension are near-orthogonal
    base = [torch.randn(dim, generator=gen) for _ in range(16)]
    base = [b / b.norm() for b in base]  # unit norm each
    rda_norms, mean_norms = [], []
    for m in (1, 4, 16):
        w = [1.0 / m] * m
        rda_norms.append(float(rda_merge(base[:m], w).norm()))
        mean_norms.append(float(mean_merge(base[:m], w).norm()))
    assert rda_norms == pytest.approx([1.0, 1.0, 1.0], rel=1e-5)
    # The mean of m near-orthogonal unit vectors has norm ~ 1/sqrt(m).
    assert mean_norms == pytest.approx([1.0, 0.5, 0.25], rel=0.05)


def test_permutation_invariance():
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(6, generator=gen) for _ in range(4)]
    weights = [0.1, 0.2, 0.3, 0.4]
    perm = [2, 0, 3, 1]
    for fn in (rda_merge, mean_merge):
        a = fn(deltas, weights)
        b = fn([deltas[i] for i in perm], [weights[i] for i in perm])
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_low_precision_inputs_give_float32():
    d = [torch.randn(8).to(torch.bfloat16) for _ in range(2)]
    assert rda_merge(d, [0.5, 0.5]).dtype == torch.float32
    assert mean_merge(d, [0.5, 0.5]).dtype == torch.float32


def test_merge_fragment_uses_mean_for_embeddings():
    gen = torch.Generator().manual_seed(4)
    subs = [[torch.randn(5, 2, generator=gen), torch.randn(3, generator=gen)] for _ in range(3)]
    w = [0.5, 0.3, 0.2]
    out = merge_fragment(subs, w, rule="rda", embedding_mask=[True, False])
    torch.testing.assert_close(out[0], mean_merge([s[0] for s in subs], w))
    torch.testing.assert_close(out[1], rda_merge([s[1] for s in subs], w))
    # The two rules really differ on this data, so the mask is what chose.
    assert not torch.allclose(out[1], mean_merge([s[1] for s in subs], w))
    out_mean = merge_fragment(subs, w, rule="mean", embedding_mask=[True, False])
    torch.testing.assert_close(out_mean[1], mean_merge([s[1] for s in subs], w))


def test_mean_rule_uniform_weights_is_plain_average():
    subs = [[torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]]
    assert merge_fragment(subs, [0.5, 0.5], rule="mean", embedding_mask=[False])[0].tolist() == [2.0, 4.0]


def test_merge_rules_constant():
    assert MERGE_RULES == ("rda", "mean")


@pytest.mark.parametrize(
    "subs, weights, kwargs, match",
    [
        ([[torch.zeros(2)]], [1.0], dict(rule="median", embedding_mask=[False]), "unknown merge rule 'median'"),
        ([], [], dict(rule="rda", embedding_mask=[]), "no submissions"),
        ([[torch.zeros(2)]], [0.5, 0.5], dict(rule="rda", embedding_mask=[False]), "1 submissions but 2 weights"),
        ([[torch.zeros(2)], []], [0.5, 0.5], dict(rule="rda", embedding_mask=[False]), "submission 1 has 0 tensors"),
        (
            [[torch.zeros(2)], [torch.zeros(3)]],
            [0.5, 0.5],
            dict(rule="rda", embedding_mask=[False]),
            r"tensor 0 of submission 1 has shape \(3,\)",
        ),
    ],
)
def test_merge_fragment_errors(subs, weights, kwargs, match):
    with pytest.raises(ValueError, match=match):
        merge_fragment(subs, weights, **kwargs)


def test_rda_errors():
    with pytest.raises(ValueError, match="no deltas"):
        rda_merge([], [])
    with pytest.raises(ValueError, match="shape"):
        rda_merge([torch.zeros(2), torch.zeros(2, 1)], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"weights\[1\] must be >= 0, got -0.5"):
        mean_merge([torch.zeros(2), torch.zeros(2)], [1.5, -0.5])


def test_join_segments_adds_one_islands_segments_and_passes_singles_through():
    a1, a2 = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [torch.tensor([0.5, -1.0]), torch.tensor([1.0])]
    b = [torch.tensor([7.0, 7.0]), torch.tensor([7.0])]
    groups, joined = join_segments([("a", 1), ("b", 1), ("a", 1)], [a1, b, a2])
    assert groups == [[0, 2], [1]]
    assert [t.tolist() for t in joined[0]] == [[1.5, 1.0], [4.0]]
    assert all(x is y for x, y in zip(joined[1], b)), "a group of one is passed through, bitwise"


def test_join_segments_keeps_incarnations_apart_and_checks_its_input():
    groups, _ = join_segments([("a", 1), ("a", 2)], [[torch.zeros(1)], [torch.zeros(1)]])
    assert groups == [[0], [1]], "a new incarnation starts from the global version: not a segment of the old"
    with pytest.raises(ValueError, match="one key per submission"):
        join_segments([("a", 1)], [])
    with pytest.raises(ValueError, match="hold 1 and 2 tensors"):
        join_segments([("a", 1), ("a", 1)], [[torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]])
