"""Error feedback (policies/error_feedback.py): nothing a lossy submission leaves out is lost (decay 1), and
the accumulator follows its recursion (decay < 1). The reference sums are float64, kept here."""

import pytest
import torch

from policies.compression import FEEDBACK_SCHEMES, compress, decompress
from policies.error_feedback import ErrorFeedback

SHAPES = [(64, 80), (300,)]


def _deltas(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * 1e-2 for s in SHAPES] for _ in range(n)]


def _send(fb, fragment, delta, density=1 / 64, scheme="topk"):
    owed = fb.owed(fragment, delta)
    sent = [decompress(compress(o, scheme, density=density)) for o in owed]
    fb.settle(fragment, owed, sent)
    return owed, sent


@pytest.mark.parametrize("scheme", FEEDBACK_SCHEMES)
def test_with_decay_one_everything_sent_plus_the_residual_is_all_progress(scheme):
    fb = ErrorFeedback(num_fragments=2)
    total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    sent_sum = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for delta in _deltas(25):
        _, sent = _send(fb, 1, delta, scheme=scheme)
        total = [t + d.double() for t, d in zip(total, delta)]
        sent_sum = [a + s.double() for a, s in zip(sent_sum, sent)]
    residual = fb.residual(1)
    for t, s, e in zip(total, sent_sum, residual):
        assert torch.allclose(s + e.double(), t, rtol=0, atol=1e-5)
        assert float(s.abs().sum()) > 0.05 * float(t.abs().sum())  # and much of it went
    assert fb.residual(0) is None  # fragments are independent


def test_decayed_accumulator_follows_its_recursion():
    fb = ErrorFeedback(num_fragments=1, decay=0.5)
    e_ref = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for delta in _deltas(10, seed=3):
        owed, sent = _send(fb, 0, delta)
        a_ref = [0.5 * e + d.double() for e, d in zip(e_ref, delta)]
        for o, a in zip(owed, a_ref):
            assert torch.allclose(o.double(), a, rtol=0, atol=1e-6)
        e_ref = [a - s.double() for a, s in zip(a_ref, sent)]
    for e, r in zip(fb.residual(0), e_ref):
        assert torch.allclose(e.double(), r, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme", FEEDBACK_SCHEMES)
def test_a_constant_gradient_is_delivered_in_full_over_time(scheme):
    # Top-k alone would send 1/64 of a constant outer gradient forever, and sign would send every entry as
    # the block's mean; with feedback what is owed grows until it is sent, so the owed residual stays
    # bounded instead of growing with the rounds.
    fb = ErrorFeedback(num_fragments=1)
    g = [torch.linspace(0.1, 1.0, 4096)]
    norms = {}
    for r in range(1, 401):
        _send(fb, 0, g, scheme=scheme)
        if r in (200, 400):
            norms[r] = fb.norm()
    assert norms[400] <= 1.2 * norms[200]
    assert norms[400] < 0.2 * 400 * float(g[0].norm())  # far below what dropping would leave owed


def test_owed_changes_nothing_until_settled():
    fb = ErrorFeedback(num_fragments=1)
    delta = _deltas(1)[0]
    _send(fb, 0, delta)
    before = [e.clone() for e in fb.residual(0)]
    fb.owed(0, delta)  # a progress snapshot asks what is owed without settling it
    assert all(torch.equal(a, b) for a, b in zip(before, fb.residual(0)))


def test_bad_arguments_fail_in_one_line():
    with pytest.raises(ValueError, match=r"error-feedback decay must be in \[0, 1\], got 1.5"):
        ErrorFeedback(2, decay=1.5)
    with pytest.raises(ValueError, match="num_fragments must be >= 1"):
        ErrorFeedback(0)
    fb = ErrorFeedback(1)
    _send(fb, 0, _deltas(1)[0])
    with pytest.raises(ValueError, match="has 2 accumulated tensors but the new progress has 1"):
        fb.owed(0, [torch.zeros(3)])
    with pytest.raises(ValueError, match="1 sent tensors for 2 owed"):
        fb.settle(0, [torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
