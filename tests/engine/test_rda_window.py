"""outer.rda_across_rounds in the outer optimizer: partial rounds are lengthened by the window's factor,
full rounds and the embedding fragment are not, and a checkpoint carries the window."""

from __future__ import annotations

import math

import torch

from islands.messages import Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress
from policies.merge import RdaAcrossRounds
from policies.outer_optimizer import FragmentOuterOptimizer
from tests.engine.test_outer_refusals import make_outer as _refusals_outer


def make_outer(**kw) -> OuterOptimizer:
    """The refusal tests' outer optimizer (SHAPES: fragments ('emb.weight',) and ('w', 'b')), four islands."""
    return _refusals_outer(islands=4, **{"max_staleness": 4, **kw})


def deltas(k: int) -> list[torch.Tensor]:
    """Round k's outer gradient for fragment ('w', 'b'): a different unit direction each round."""
    w, b = torch.zeros(4, 4), torch.zeros(4)
    w.view(-1)[k] = 0.1
    b[k % 4] = 0.05 * (k + 1)
    return [w, b]


def submit(outer: OuterOptimizer, island: int, k: int, fragment: int = 1):
    sub = Submission(island=island, incarnation=1, seq=k, fragment=fragment, base_version=outer.versions[fragment],
                     tokens=100, inner_steps=10, step_time_s=0.1, train_loss=3.0,
                     payload=[compress(d, "none") for d in (deltas(k) if fragment == 1 else [torch.full((8, 4), 0.01)])])
    closed, refusal = outer.receive(sub, now=float(k))
    assert refusal is None and len(closed) == 1
    return closed[0]


def test_partial_rounds_follow_the_window_and_an_independent_step():
    outer = make_outer(rda_across_rounds=True)
    plain = make_outer(rda_across_rounds=False)
    ref_params = [t.clone() for t in outer.params[1]]
    ref_opt = FragmentOuterOptimizer(ref_params, lr=0.7, momentum=0.9, partial_momentum=0.7)
    window = RdaAcrossRounds(2, [True, True])
    records = []
    for k in range(6):
        rec = submit(outer, k % 4, k).record
        submit(plain, k % 4, k)
        factors = window.update(deltas(k), 0.25)
        ref_opt.step([d * f for d, f in zip(deltas(k), factors)], scale=0.25, clock=True)
        records.append(rec)
    for got, want in zip(outer.params[1], ref_params):
        assert torch.allclose(got, want, atol=1e-7)
    assert records[0].rda_factor == 1.0 and records[-1].rda_factor > 1.2  # orthogonal rounds are lengthened
    assert all(r.step_scale == 0.25 for r in records)
    # ... and the plain run's steps are shorter: its parameters moved less.
    start = make_outer().params[1]
    moved = lambda o: sum(float((a - b).norm()) for a, b in zip(o.params[1], start))  # noqa: E731
    assert moved(outer) > 1.1 * moved(plain)


def test_full_rounds_and_embeddings_are_untouched():
    outer = make_outer(rda_across_rounds=True, min_quorum=4)
    plain = make_outer(rda_across_rounds=False, min_quorum=4)
    for o in (outer, plain):
        for k in range(4):
            sub = Submission(island=k, incarnation=1, seq=k, fragment=1, base_version=0, tokens=100, inner_steps=10,
                             step_time_s=0.1, train_loss=3.0, payload=[compress(d, "none") for d in deltas(k)])
            closed, _ = o.receive(sub, now=0.0)
        assert closed and closed[0].record.rda_factor == 1.0
    assert all(torch.equal(a, b) for a, b in zip(outer.params[1], plain.params[1]))
    assert not outer._rda_windows[1].active  # K = all holds no window
    emb_outer, emb_plain = make_outer(rda_across_rounds=True), make_outer(rda_across_rounds=False)
    for k in range(3):
        assert submit(emb_outer, k, k, fragment=0).record.rda_factor == 1.0
        submit(emb_plain, k, k, fragment=0)
    assert torch.equal(emb_outer.params[0][0], emb_plain.params[0][0])


def test_checkpoint_carries_the_window():
    whole = make_outer(rda_across_rounds=True)
    for k in range(3):
        submit(whole, k % 4, k)
    tensors, meta = whole.state_dict()
    assert "rda_window/w" in tensors and meta["rda_window_norms"][1] is not None
    resumed = make_outer(rda_across_rounds=True)
    resumed.load_state_dict(tensors, meta)
    fresh = make_outer(rda_across_rounds=True)  # same parameters and momentum, but an empty window
    fresh.load_state_dict(tensors, {**meta, "rda_window_norms": None})
    a, b, c = (submit(o, 3, 3).record.rda_factor for o in (whole, resumed, fresh))
    assert a == b and not math.isclose(a, c)
    assert all(torch.equal(x, y) for x, y in zip(whole.params[1], resumed.params[1]))
