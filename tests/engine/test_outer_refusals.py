"""Bad submissions are refused, counted and logged, and the global parameters do not change."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from islands.messages import Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress
from policies.fragments import plan_fragments
from tests.from_config import outer_from_config

SHAPES = {"emb.weight": (8, 4), "w": (4, 4), "b": (4,)}


def make_outer(islands: int = 2, **kw) -> OuterOptimizer:
    """An outer optimizer over SHAPES in two fragments, K = 1 without grace, islands 0..islands-1 registered;
    `kw` overrides OuterSettings."""
    torch.manual_seed(0)
    init = {n: torch.randn(s) for n, s in SHAPES.items()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    settings = outer_from_config(**{"min_quorum": 1, "grace_gamma": 0.0, "max_staleness": 1, "poison_guard": False, **kw})
    outer = OuterOptimizer(init, plan, settings=settings,
                           embedding_names={"emb.weight"})
    for island in range(islands):
        outer.register(island, 1)
    return outer


def good(outer: OuterOptimizer, *, island=0, fragment=0, seq=0, base_version=0, scheme="none") -> Submission:
    payload = [compress(torch.full(t.shape, 0.01), scheme) for t in outer.params[fragment]]
    return Submission(island=island, incarnation=1, seq=seq, fragment=fragment, base_version=base_version,
                      tokens=100, inner_steps=10, step_time_s=0.1, train_loss=3.0, payload=payload)


def _nan(outer):
    sub = good(outer)
    sub.payload[0] = compress(torch.full(outer.params[0][0].shape, math.nan), "none")
    return sub


def _inf(outer):
    sub = good(outer)
    sub.payload[-1] = compress(torch.full(outer.params[0][-1].shape, math.inf), "none")
    return sub


def _norm_overflow(outer):
    # Every element finite (3e37 < float32's 3.4e38), the norm over 8x4 of them is not: RDA would divide by it.
    sub = good(outer)
    sub.payload[0] = compress(torch.full(outer.params[0][0].shape, 3e37), "none")
    return sub


def _shape(outer):
    sub = good(outer)
    sub.payload[0] = compress(torch.zeros(3, 3), "none")
    return sub


def _dtype(outer):
    sub = good(outer)
    c = sub.payload[0]
    sub.payload[0] = dataclasses.replace(c, payload=c.payload.to(torch.float64))
    return sub


def _wire(outer):
    sub = good(outer)
    sub.payload[0] = compress(torch.zeros(outer.params[0][0].shape), "int8")
    return sub


def _too_few(outer):
    sub = good(outer)
    sub.payload = sub.payload[:-1]
    return sub


BAD = {
    "NaN values": (_nan, "non-finite"),
    "Inf values": (_inf, "non-finite"),
    "norm overflows float32": (_norm_overflow, "norm overflows"),
    "wrong shape": (_shape, "shape"),
    "wrong dtype": (_dtype, "dtype"),
    "wrong wire format": (_wire, "wire format"),
    "missing tensor": (_too_few, "tensors"),
    "fragment out of range": (lambda o: dataclasses.replace(good(o), fragment=7), "fragment 7 out of range"),
    "unknown island": (lambda o: dataclasses.replace(good(o), island=9), "unknown or dead island 9"),
    "stale incarnation": (lambda o: dataclasses.replace(good(o), incarnation=0), "stale incarnation 0"),
    "base from the future": (lambda o: dataclasses.replace(good(o), base_version=5), "future"),
    "zero inner steps": (lambda o: dataclasses.replace(good(o), inner_steps=0), "inner_steps=0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_submission_is_refused_counted_logged_and_changes_nothing(case, caplog):
    outer = make_outer()
    before = outer.global_parameters()
    make, expected = BAD[case]
    with caplog.at_level(logging.WARNING):
        results, refusal = outer.receive(make(outer), now=1.0)
    assert results == [] and refusal is not None
    assert expected in refusal.reason
    assert len(outer.refusals) == 1 and outer.rounds == []
    assert any("refused" in r.message and expected in r.message for r in caplog.records)
    after = outer.global_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert outer.versions == [0, 0]
    assert outer.ledger()["pending"] == [0, 0]
    # The engine still works after a refusal: a good submission merges.
    results, refusal = outer.receive(good(outer, seq=1), now=2.0)
    assert refusal is None and [r.version for r in results] == [1]


def test_stale_submission_refused_beyond_max_staleness_and_tokens_counted():
    outer = make_outer()
    for seq in range(2):  # two rounds of fragment 0 from island 1: version 2
        outer.receive(good(outer, island=1, seq=seq, base_version=seq), now=float(seq))
    assert outer.versions[0] == 2
    before = outer.global_parameters()
    _, refusal = outer.receive(good(outer, island=0, base_version=0), now=3.0)  # staleness 2 > max 1
    assert refusal is not None and "staleness" in refusal.reason
    assert outer.ledger()["refused"] == [100, 0]
    assert all(torch.equal(before[n], outer.global_parameters()[n]) for n in before)
    # staleness 1 is accepted and merged
    results, refusal = outer.receive(good(outer, island=0, seq=1, base_version=1), now=4.0)
    assert refusal is None and results[0].record.staleness == [1]


def test_compressed_submissions_merge_within_their_error_bound():
    exact, quant = make_outer(), make_outer(compression="int8")
    delta = [torch.linspace(-0.05, 0.05, t.numel()).reshape(t.shape) for t in exact.params[0]]
    for outer, scheme in ((exact, "none"), (quant, "int8")):
        sub = good(outer, scheme=scheme)
        sub.payload = [compress(d, scheme) for d in delta]
        outer.receive(sub, now=1.0)
    for a, b in zip(exact.params[0], quant.params[0]):
        assert not torch.equal(a, b)
        assert float((a - b).abs().max()) < 0.7 * 0.05 / 127  # lr * int8 half-step bound
    assert quant.rounds[0].bytes < exact.rounds[0].bytes


def test_token_weights_and_rda_in_a_round():
    outer = make_outer(weighting="tokens")
    a = good(outer, island=0)
    b = dataclasses.replace(good(outer, island=1), tokens=300, inner_steps=10)
    outer.register(2, 1)  # three live islands, K=1, grace 0: rounds close on first arrival
    results, _ = outer.receive(a, now=0.0)
    assert len(results) == 1 and results[0].record.weights == [1.0]
    outer2 = make_outer(weighting="tokens", grace_gamma=math.inf, grace_cap_s=math.inf)
    outer2.receive(a, now=0.0)
    results, _ = outer2.receive(b, now=0.1)  # both live islands in: closes
    w = results[0].record.weights
    # w = tokens * tokens/steps: 100*10 and 300*30 -> 1000 : 9000
    assert w == pytest.approx([0.1, 0.9])
    assert results[0].record.participants == [0, 1]


def test_checkpoint_round_trip_continues_bitwise():
    a = make_outer(momentum=0.9)
    for seq in range(3):
        a.receive(good(a, island=seq % 2, seq=seq, base_version=seq), now=float(seq))
    b = make_outer(momentum=0.9)
    b.load_state_dict(*a.state_dict())
    assert b.versions == a.versions == [3, 0] and b.ledger() == a.ledger()
    # Same state -> the same next outer step, bitwise (the Nesterov momentum came along).
    for o in (a, b):
        o.receive(good(o, island=1, seq=10, base_version=3), now=9.0)
    assert all(torch.equal(a.global_parameters()[n], b.global_parameters()[n]) for n in SHAPES)
    assert not all(torch.equal(a.global_parameters()[n], make_outer().global_parameters()[n]) for n in SHAPES)


def test_checkpoint_forgets_pending_submissions_as_never_received():
    a = make_outer(min_quorum=2, grace_gamma=0.0)
    a.receive(good(a, island=0, fragment=1, seq=1), now=1.0)  # waits for a second island
    assert a.ledger()["pending"] == [0, 100] and a.received[(0, 1)] == [0, 100]
    b = make_outer(min_quorum=2)
    b.load_state_dict(*a.state_dict())
    assert b.ledger()["pending"] == [0, 0]
    assert b.received[(0, 1)] == [0, 0], "lost with the restart: the island sees it as taken, never received"


def test_checkpoint_of_another_model_is_refused():
    a = make_outer()
    tensors, meta = a.state_dict()
    meta = {**meta, "fragments": [["w"], ["emb.weight", "b"]]}
    with pytest.raises(ValueError, match="another model or fragment plan"):
        make_outer().load_state_dict(tensors, meta)


def test_hold_queues_and_closes_nothing_until_close_all():
    outer = make_outer()  # K = 1, grace 0: a submission alone would close its round at once
    outer.hold()
    results, refusal = outer.receive(good(outer, island=0, fragment=0), now=0.0)
    assert results == [] and refusal is None and outer.poll(now=10.0) == [] and outer.next_wakeup_s(10.0) == math.inf
    assert outer.pending_tokens() == [100, 0]
    assert [r.record.reason for r in outer.close_all(now=11.0)] == ["final flush"]
    assert not outer.holding and outer.versions == [1, 0]


def test_close_all_merges_what_waits_for_a_quorum_and_nothing_else():
    # K = 2 of 2 live islands: one submission alone never closes its round...
    outer = make_outer(min_quorum=2, grace_gamma=math.inf, grace_cap_s=math.inf)
    before = [t.clone() for t in outer.params[0]]
    results, refusal = outer.receive(good(outer, island=0, fragment=0), now=0.0)
    assert results == [] and refusal is None and outer.poll(now=100.0) == []
    # ...until the final flush closes it anyway; the untouched fragment 1 gets no round.
    results = outer.close_all(now=101.0)
    assert [(r.fragment, r.version, r.record.reason, r.record.participants) for r in results] == [(0, 1, "final flush", [0])]
    assert outer.versions == [1, 0]
    # The final step is the merged position, no lr and no momentum: before - delta (delta = 0.01 here).
    for a, b in zip(before, outer.params[0]):
        assert torch.allclose(b, a - 0.01, atol=1e-7, rtol=0)
    assert outer.tokens_merged == [100, 0] and outer.pending_tokens() == [0, 0]
    assert outer.close_all(now=102.0) == []  # nothing pending: a second flush is a no-op
