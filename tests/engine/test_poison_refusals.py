"""The poison guard in the outer optimizer core: one of four islands poisoned from its first submission.

Islands send a shared descent direction plus noise of their own; island 0 sends the same made poisoned
(islands/faults.py). Its submissions are refused as counted refusals with a reason from the first round
on, the honest islands' never are, the ledger adds up, and the global parameters end where the three
honest islands alone take them. Without the guard the same stream moves them elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from islands.faults import POISON_KINDS, poisoned
from islands.messages import Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress
from policies.fragments import plan_fragments
from policies.poison_guard import FAR_OUT
from tests.from_config import outer_from_config

SHAPES = {"a": (64, 64), "b": (4096,)}
ISLANDS = 4


def _outer(guard: bool) -> OuterOptimizer:
    init = {n: torch.zeros(s) for n, s in SHAPES.items()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    outer = OuterOptimizer(init, plan, settings=outer_from_config(poison_guard=guard, grace_gamma=0.0))
    for island in range(ISLANDS):
        outer.register(island, 1)
    return outer


def _stream(outer: OuterOptimizer, kind: str | None, rounds: int = 12):
    """Each island submits every fragment each round; in the first, island 0 twice before the others (as a
    fast island does: a lone poisoned island merged first spoilt the momentum, and its two votes in the first
    round once spoilt the honest islands' recorded alignment)."""
    gen = torch.Generator().manual_seed(0)
    target = [[torch.randn(t.shape, generator=gen) for t in frag] for frag in outer.params]
    seq = [0] * ISLANDS
    refusals = []
    for r in range(rounds):
        order = [0, 0, 1, 2, 3] if r == 0 else [0, 1, 2, 3]
        for island in order:
            for p, frag in enumerate(outer.params):
                honest = [0.05 * (t - tgt) + 0.02 * torch.randn(t.shape, generator=gen)
                          for t, tgt in zip(frag, target[p])]
                deltas = honest
                if island == 0 and kind is not None:
                    deltas = poisoned(kind, honest, stale_base=[torch.zeros(t.shape) - 5.0 for t in frag],
                                      anchor=[t.clone() for t in frag], seed=seq[island])
                sub = Submission(island=island, incarnation=1, seq=seq[island], fragment=p,
                                 base_version=outer.versions[p], tokens=1000, inner_steps=40, step_time_s=0.1,
                                 train_loss=3.0, payload=[compress(d, "none") for d in deltas])
                seq[island] += 1
                _, refusal = outer.receive(sub, now=float(r))
                if refusal is not None:
                    refusals.append(refusal)
    outer.close_all(now=float(rounds))
    return refusals, target


@pytest.mark.parametrize("kind", POISON_KINDS)
def test_a_poisoned_island_is_refused_from_the_first_round_and_no_honest_one_is(kind):
    outer = _outer(guard=True)
    _stream(outer, kind)
    refused = outer.refusals
    assert refused, f"{kind}: nothing refused"
    assert {r.island for r in refused} == {0}, [(r.island, r.reason) for r in refused]
    assert all(r.reason.startswith("poisoned: ") for r in refused)
    # Every one of island 0's submissions but at most its first stale ones (a stale base starts near the
    # current one) is refused; in every fragment, from the first round on.
    ledger = outer.ledger()
    total_poisoned = 13 * 1000  # per fragment
    allowed = 2000 if kind == "stale_submission" else 0
    for p in range(2):
        assert ledger["refused"][p] >= total_poisoned - allowed, (kind, p, ledger)
        assert ledger["merged"][p] + ledger["refused"][p] == (ISLANDS * 12 + 1) * 1000
    assert all(r.participants[:1] != [0] or len(r.participants) > 1 for r in outer.rounds)


def test_a_clean_stream_refuses_nothing_and_the_guard_changes_no_clean_result():
    guarded, plain = _outer(guard=True), _outer(guard=False)
    _stream(guarded, None)
    _stream(plain, None)
    assert guarded.refusals == [] and plain.refusals == []
    assert guarded.ledger()["merged"] == plain.ledger()["merged"]


def _distance(outer: OuterOptimizer, target) -> float:
    return math.sqrt(sum(float((t - g).pow(2).sum()) for frag, tg in zip(outer.params, target) for t, g in zip(frag, tg)))


def test_guarded_every_poison_ends_at_the_same_parameters_and_unguarded_a_scaled_or_stale_one_does_not():
    ends, unguarded = {}, {}
    for kind in POISON_KINDS:
        guarded, plain = _outer(guard=True), _outer(guard=False)
        _, target = _stream(guarded, kind)
        _stream(plain, kind)
        ends[kind] = [t.clone() for frag in guarded.params for t in frag]
        unguarded[kind] = _distance(plain, target), _distance(guarded, target)
    first = ends[POISON_KINDS[0]]
    # Refused from the first round on, whatever it sent: island 0 leaves no trace in the model.
    assert all(torch.equal(a, b) for kind in POISON_KINDS for a, b in zip(first, ends[kind]))
    for kind in ("scaled_submission", "stale_submission"):
        plain_d, guarded_d = unguarded[kind]
        assert plain_d > 2 * guarded_d, (kind, plain_d, guarded_d)


def test_the_guard_windows_survive_a_checkpoint():
    outer = _outer(guard=True)
    _stream(outer, None, rounds=3)
    tensors, meta = outer.state_dict()
    again = _outer(guard=True)
    again.load_state_dict(tensors, meta)
    assert again.guard is not None and outer.guard is not None
    assert again.guard.state_dict() == outer.guard.state_dict() != [[], []]


def _one(outer: OuterOptimizer, target, kind: str, seq: int, started_at_version: int = 0):
    """Island 0 sends fragment 0's honest outer gradient (toward `target`, as `_stream`'s) poisoned as `kind`, from an
    incarnation that started at `started_at_version`; the refusal (or None)."""
    gen = torch.Generator().manual_seed(100 + seq)  # not the stream's seed: noise unlike its target
    honest = [0.05 * (t - tgt) + 0.02 * torch.randn(t.shape, generator=gen) for t, tgt in zip(outer.params[0], target[0])]
    deltas = honest if kind is None else poisoned(kind, honest, stale_base=None, anchor=[t.clone() for t in outer.params[0]],
                                                  seed=1000 + seq)
    sub = Submission(island=0, incarnation=1, seq=1000 + seq, fragment=0, base_version=outer.versions[0], tokens=1000,
                     inner_steps=40, step_time_s=0.1, train_loss=3.0, payload=[compress(d, "none") for d in deltas],
                     started_at_version=started_at_version)
    return outer.receive(sub, now=100.0 + seq)[1]


def test_an_island_refused_as_poisoned_three_times_in_a_row_is_handed_to_the_monitor_once():
    outer = _outer(guard=True)  # outer.poison_restart_after: 3, the default
    _, target = _stream(outer, None, rounds=4)  # a clean history to judge against
    # Noise points nowhere; from an incarnation that started mid-run a cosine near 0 is poisoned but not beyond doubt
    # (an honest restarted one can read so), so the streak decides.
    started = outer.versions[0]
    reasons = []
    for seq in range(3):
        reasons.append(_one(outer, target, "noise_submission", seq, started_at_version=started).reason)
        assert outer.take_poisoned() == (set() if seq < 2 else {(0, 1)}), (seq, reasons)
    assert all(r.startswith("poisoned: ") and not r.startswith(FAR_OUT) for r in reasons), reasons
    # Once, however many refusals follow (the monitor restarts the incarnation; a new one starts a new count).
    assert _one(outer, target, "noise_submission", 3, started_at_version=started) is not None
    assert outer.take_poisoned() == set()
    assert outer.take_diverged() == set(), "a poisoned island is not one that sent non-finite values"


@pytest.mark.parametrize("kind", ["scaled_submission", "flipped_submission", "noise_submission"])
def test_an_island_refused_far_out_of_line_is_handed_to_the_monitor_at_its_first_refusal(kind):
    outer = _outer(guard=True)
    _, target = _stream(outer, None, rounds=4)
    assert _one(outer, target, None, 0) is None, "the same outer gradient unpoisoned is accepted"
    refusal = _one(outer, target, kind, 1)
    assert refusal is not None and refusal.reason.startswith(FAR_OUT), refusal
    assert outer.take_poisoned() == {(0, 1)}, "not two refusals more of a quarter of the compute"


def test_a_flip_from_an_incarnation_that_started_mid_run_waits_for_the_streak():
    # An honest restarted incarnation's first cuts can point against the momentum (the guard-on soak): restarting it at
    # its first such refusal restarted the next incarnation the same way, 70 times in 10 minutes.
    outer = _outer(guard=True)
    _, target = _stream(outer, None, rounds=4)
    started = outer.versions[0]
    reasons = []
    for seq in range(3):
        reasons.append(_one(outer, target, "flipped_submission", seq, started_at_version=started).reason)
        assert outer.take_poisoned() == (set() if seq < 2 else {(0, 1)}), (seq, reasons)
    assert all(r.startswith("poisoned: ") and not r.startswith(FAR_OUT) for r in reasons), reasons
    assert "started mid-run" in reasons[0], reasons[0]


def test_a_clean_stream_hands_no_island_to_the_monitor_and_zero_restarts_none():
    clean = _outer(guard=True)
    _stream(clean, None, rounds=4)
    assert clean.take_poisoned() == set()
    never = OuterOptimizer({n: torch.zeros(s) for n, s in SHAPES.items()},
                           plan_fragments([(n, math.prod(s) * 4) for n, s in SHAPES.items()], 2),
                           settings=outer_from_config(poison_guard=True, poison_restart_after=0, grace_gamma=0.0))
    for island in range(ISLANDS):
        never.register(island, 1)
    _stream(never, "flipped_submission", rounds=4)
    assert [r for r in never.refusals if r.island == 0] and never.take_poisoned() == set()


def test_honest_islands_whose_direction_drifts_from_the_momentum_are_refused_for_a_while_not_for_ever():
    # Fragment 0 of 4 nano islands on real text drifts to a cosine of about 0 with its momentum (in process). The core
    # records every judged reading, so the reference follows the islands and the gate closes; it once kept only the
    # accepted ones and refused every island from then on (the hour soak's 3,453 honest refusals).
    outer = _outer(guard=True)
    _stream(outer, None, rounds=4)
    gen = torch.Generator().manual_seed(7)
    refused = []
    for r in range(12):
        for island in range(ISLANDS):
            deltas = [0.05 * torch.randn(t.shape, generator=gen) for t in outer.params[0]]  # no shared direction
            sub = Submission(island=island, incarnation=1, seq=100 + r, fragment=0, base_version=outer.versions[0],
                             tokens=1000, inner_steps=40, step_time_s=0.1, train_loss=3.0,
                             payload=[compress(d, "none") for d in deltas])
            refused.append(outer.receive(sub, now=50.0 + r)[1] is not None)
    assert any(refused[:8]), "at first they read out of line with the momentum"
    assert not any(refused[-16:]), refused
