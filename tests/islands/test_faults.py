"""islands.faults: what an injected fault does to an island's next cuts, by kind and window (no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from islands.faults import POISON_KINDS, POISON_SCALE, InjectedFaults, poisoned


def test_drop_and_corrupt_without_a_duration_take_only_the_next_cut():
    f = InjectedFaults(0)
    f.inject("drop_submission", now=0.0)
    f.inject("corrupt_submission", now=0.0)
    assert f.take_drop(now=1.0) and not f.take_drop(now=1.0)
    assert f.take_corrupt(now=1.0) and not f.take_corrupt(now=1.0)


def test_drop_and_corrupt_with_a_duration_take_every_cut_in_the_window():
    # The tape's meaning (policies/chaos.py): every submission in [at, at + duration_s); it used to take one.
    f = InjectedFaults(0)
    f.inject("drop_submission", now=10.0, duration_s=5.0)
    f.inject("corrupt_submission", now=10.0, duration_s=2.0)
    assert all(f.take_drop(now=t) for t in (10.0, 12.0, 14.9)) and not f.take_drop(now=15.0)
    assert f.take_corrupt(now=11.9) and not f.take_corrupt(now=12.0)


@pytest.mark.parametrize("kind", POISON_KINDS)
def test_poison_lasts_its_window_or_the_incarnation(kind):
    f = InjectedFaults(0)
    assert f.poison(0.0) is None
    f.inject(kind, now=1.0, duration_s=3.0)
    assert f.poison(2.0) == kind and f.poison(4.0) is None
    f.inject(kind, now=5.0)  # duration 0: until the incarnation ends
    assert f.poison(1e9) == kind


def test_each_poison_is_finite_well_shaped_and_wrong():
    gen = torch.Generator().manual_seed(0)
    owed = [torch.randn(8, 4, generator=gen), torch.randn(5, generator=gen)]
    anchor = [torch.zeros(8, 4), torch.zeros(5)]
    stale = [torch.ones(8, 4), torch.ones(5)]
    for kind in POISON_KINDS:
        out = poisoned(kind, owed, stale_base=stale, anchor=anchor, seed=1)
        assert [t.shape for t in out] == [t.shape for t in owed]
        assert all(torch.isfinite(t).all() for t in out)
    scaled = poisoned("scaled_submission", owed, stale_base=None, anchor=anchor, seed=1)
    assert torch.equal(scaled[0], owed[0] * POISON_SCALE)
    assert torch.equal(poisoned("flipped_submission", owed, stale_base=None, anchor=anchor, seed=1)[1], -owed[1])
    assert torch.equal(poisoned("stale_submission", owed, stale_base=stale, anchor=anchor, seed=1)[0], owed[0] + 1)
    noise = poisoned("noise_submission", owed, stale_base=None, anchor=anchor, seed=1)
    assert math.isclose(float(noise[0].norm()), float(owed[0].norm()), rel_tol=1e-5)
    assert abs(float(torch.nn.functional.cosine_similarity(noise[0].flatten(), owed[0].flatten(), dim=0))) < 0.6
    assert torch.equal(noise[0], poisoned("noise_submission", owed, stale_base=None, anchor=anchor, seed=1)[0])
    with pytest.raises(ValueError, match="unknown poison kind"):
        poisoned("nope", owed, stale_base=None, anchor=anchor, seed=1)


def test_noise_of_a_cut_is_not_what_the_same_seed_draws_for_the_model():
    # Island 0's first cut has seed 0, as a run has by default: randn from seed 0 was the model's initial token
    # embedding, which honest outer gradients share through weight decay, so the "noise" was aligned with them.
    from islands.model import build_model, model_config

    emb = dict(build_model(model_config("nano"), seed=0).named_parameters())["tok_emb.weight"].detach()
    [noise] = poisoned("noise_submission", [torch.ones_like(emb)], stale_base=None, anchor=[torch.zeros_like(emb)], seed=0)
    cos = float(torch.nn.functional.cosine_similarity(noise.flatten(), emb.flatten(), dim=0))
    assert abs(cos) < 5 / math.sqrt(emb.numel()), cos  # a random direction's, not 1.0
