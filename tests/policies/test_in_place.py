"""The outer optimizer's in-place kernels (issue 44) against the functions they replace on the hot path:
decode_into against decompress, merge_into against the rules written out in tests/policies/merge_reference.py, the outer step against
torch.optim.SGD. Same operations per element, so every comparison is bitwise (torch.equal and the bits)."""

from __future__ import annotations

import math

import pytest
import torch

from policies.compression import Compressed, compress, decode_into, decompress, finite_without_decoding
from policies.merge import merge_into
from policies.outer_optimizer import FragmentOuterOptimizer
from tests.policies.merge_reference import mean_reference, rda_reference


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.int32),
                                                                     b.contiguous().view(-1).view(torch.int32))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(1,), (7,), (256,), (257,), (3, 100), (0,)])
@pytest.mark.parametrize("block_size", [1, 5, 256])
def test_decode_into_is_decompress(scheme, shape, block_size):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3
    c = compress(t, scheme, block_size=block_size)
    out = torch.full((t.numel(),), float("nan"))
    got = decode_into(c, out)
    assert _same_bits(got, decompress(c))
    assert got.data_ptr() == out.data_ptr() or t.numel() == 0  # written where it was asked to be
    assert finite_without_decoding(c)


def test_decode_into_refuses_what_it_cannot_decode():
    c = compress(torch.ones(10), "int8")
    with pytest.raises(ValueError, match="contiguous float32 buffer of 10 elements"):
        decode_into(c, torch.empty(9))
    with pytest.raises(ValueError, match="use decompress"):
        decode_into(compress(torch.ones(10), "bf16"), torch.empty(10))


def test_finite_without_decoding_only_vouches_for_safe_scales():
    c = compress(torch.randn(600), "int8")
    assert finite_without_decoding(c)
    for bad in (float("nan"), float("inf"), 1e37):  # 1e37 * 127 overflows float32
        scales = c.scales.clone()
        scales[1] = bad
        assert not finite_without_decoding(Compressed(c.scheme, c.shape, c.payload, scales, c.block_size))
    short = Compressed(c.scheme, c.shape, c.payload[:-1], c.scales, c.block_size)  # malformed: decode to know
    assert not finite_without_decoding(short)
    assert not finite_without_decoding(compress(torch.randn(600), "none"))
    assert not finite_without_decoding(compress(torch.randn(600), "int2"))


@pytest.mark.parametrize("rda", [True, False])
@pytest.mark.parametrize("form", ["tensor", "none", "int8", "int4", "bf16", "mixed"])
def test_merge_into_is_the_whole_tensor_merge(rda, form):
    gen = torch.Generator().manual_seed(4)
    shape = (33, 17)
    deltas = [torch.randn(shape, generator=gen) * (m + 1) for m in range(4)]
    deltas[2] = torch.zeros(shape)  # a zero outer gradient adds nothing to the direction
    schemes = ["none", "int8", "int4", "bf16"] if form == "mixed" else [form] * 4
    column = [d if s == "tensor" else compress(d, s) for d, s in zip(deltas, schemes)]
    decoded = [c if isinstance(c, torch.Tensor) else decompress(c) for c in column]
    weights = [0.1, 0.2, 0.3, 0.4]
    want = (rda_reference if rda else mean_reference)(decoded, weights)
    for norms in (None, [float(torch.linalg.vector_norm(d)) for d in decoded]):
        out = torch.full(shape, float("nan"))
        got = merge_into(out, column, weights, rule="rda" if rda else "mean", norms=norms, scratch=torch.empty(1000))
        assert got.data_ptr() == out.data_ptr() and _same_bits(got, want)


def test_merge_into_cancelling_and_all_zero_columns():
    d = torch.tensor([1.0, -2.0, 2.0])
    out = torch.empty(3)
    assert _same_bits(merge_into(out, [d, -d], [0.5, 0.5], rule="rda"), rda_reference([d, -d], [0.5, 0.5]))
    assert torch.equal(merge_into(out, [torch.zeros(3)] * 2, [0.5, 0.5], rule="rda"), torch.zeros(3))


def test_merge_into_errors():
    with pytest.raises(ValueError, match="at least one submission"):
        merge_into(torch.empty(2), [], [], rule="rda")
    with pytest.raises(ValueError, match="one weight"):
        merge_into(torch.empty(2), [torch.ones(2)], [0.5, 0.5], rule="rda")
    with pytest.raises(ValueError, match="delta 0 has shape"):
        merge_into(torch.empty(2), [torch.ones(3)], [1.0], rule="rda")
    with pytest.raises(ValueError, match="weights\\[0\\] must be >= 0"):
        merge_into(torch.empty(2), [torch.ones(2)], [-1.0], rule="mean")


def _torch_sgd_run(params, grads, *, lr, momentum, nesterov, scales):
    """torch.optim.SGD on copies of `params`, each step's gradients scaled as FragmentOuterOptimizer scales them."""
    params = [p.clone() for p in params]
    sgd = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
    for g, s in zip(grads, scales):
        for p, gi in zip(params, g):
            p.grad = gi.clone()
            if s != 1.0:
                p.grad.mul_(s)
        sgd.step()
    return params


@pytest.mark.parametrize("lr,momentum,nesterov", [(0.7, 0.9, True), (0.7, 0.9, False), (1.0, 0.0, True), (0.3, 0.5, True)])
def test_step_is_torchs_sgd_bitwise(lr, momentum, nesterov):
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(65, 3, generator=gen), torch.randn(1001, generator=gen)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(5)]
    scales = [1.0, 0.25, 1.0, 0.5, 1.0]  # participation-scaled rounds are torch's step on a scaled gradient
    want = _torch_sgd_run(params, grads, lr=lr, momentum=momentum, nesterov=nesterov, scales=scales)
    whole = [p.clone() for p in params]
    by_tensor = [p.clone() for p in params]
    a = FragmentOuterOptimizer(whole, lr=lr, momentum=momentum, nesterov=nesterov)
    b = FragmentOuterOptimizer(by_tensor, lr=lr, momentum=momentum, nesterov=nesterov)
    for g, s in zip(grads, scales):
        a.step(g, scale=s)
        for i in reversed(range(len(g))):  # any order of tensors
            b.step_tensor(i, g[i].clone(), scale=s)
    for x, y, z in zip(whole, by_tensor, want):
        assert _same_bits(x, z) and _same_bits(y, z)
    assert all(g_ is not None for g_ in grads)  # step() never wrote to the caller's gradients
    for x, y in zip(a.momentum_buffers(), b.momentum_buffers()):
        assert (x is None and y is None) or _same_bits(x, y)


def test_step_leaves_the_callers_gradients_and_step_tensor_uses_its_own():
    p = torch.zeros(4)
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    opt = FragmentOuterOptimizer([p], lr=0.5, momentum=0.9)
    opt.step([g])
    opt.step([g])
    assert g.tolist() == [1.0, 2.0, 3.0, 4.0]
    work = g.clone()
    opt.step_tensor(0, work)
    assert not torch.equal(work, g)  # the workspace was written: that is the point
    with pytest.raises(ValueError, match="use step\\(\\) for other gradients"):
        opt.step_tensor(0, g.to(torch.bfloat16))
    with pytest.raises(ValueError, match="scale=0.0 must be in"):
        opt.step_tensor(0, g.clone(), scale=0.0)


def test_clock_step_by_tensor_is_the_whole_fragment_clock_step():
    gen = torch.Generator().manual_seed(6)
    params = [torch.randn(40, generator=gen), torch.randn(3, 3, generator=gen)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    whole, by_tensor = [p.clone() for p in params], [p.clone() for p in params]
    a = FragmentOuterOptimizer(whole, partial_momentum=0.7)
    b = FragmentOuterOptimizer(by_tensor, partial_momentum=0.7)
    for g, s in zip(grads, [0.25, 1.0, 0.5, 0.25]):
        a.step(g, scale=s, clock=True)
        for i, gi in enumerate(g):
            b.step_tensor(i, gi.clone(), scale=s, clock=True)
    for x, y in zip(whole, by_tensor):
        assert _same_bits(x, y)
    assert math.isfinite(float(whole[0].sum()))
