"""The outer optimizer's round, merged and stepped tensor by tensor in reused buffers (issue 44), is bitwise the
round as it was computed before: every submission decoded at receive, the fragment merged whole
(policies.merge.merge_fragment), lengthened (RdaAcrossRounds.update) and stepped through torch.optim.SGD on
private gradient copies. The reference below is that pipeline, written from the policies' whole-fragment
functions; the engine side is the real OuterOptimizer core. Same operations per element, so equality is exact."""

from __future__ import annotations

import copy

import pytest
import torch

from islands.messages import Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress, decompress
from policies.fragments import FragmentPlan
from policies.merge import RdaAcrossRounds, join_segments, merge_fragment
from policies.outer_optimizer import is_clock_rule, round_step_scale
from policies.weighting import merge_weights
from tests.from_config import outer_from_config

SHAPES = {"emb.weight": (6, 5), "w1": (7, 9), "b1": (9,), "w2": (9, 3), "bn.running_mean": (3,)}
EMB, BUF = {"emb.weight"}, {"bn.running_mean"}
ISLANDS = 4


class Reference:
    """The round as computed before issue 44 (whole-fragment merge, SGD on copies), for one fragment plan."""

    def __init__(self, initial, plan, settings):
        self.settings = settings
        self.params = [[initial[n].clone() for n in frag] for frag in plan.fragments]
        self.emb = [[n in EMB or n in BUF for n in frag] for frag in plan.fragments]
        self.buf = [[n in BUF for n in frag] for frag in plan.fragments]
        self.sgd = [torch.optim.SGD(ps, lr=settings.lr, momentum=settings.momentum, nesterov=True) for ps in self.params]
        tracked = [[settings.merge_rule == "rda" and not e for e in mask] for mask in self.emb]
        self.windows = [RdaAcrossRounds(len(t), t) for t in tracked]

    def round(self, p, subs, live, final=False):
        s = self.settings
        keys = [(x.island, x.incarnation) for x in subs]
        groups, deltas = join_segments(keys, [[decompress(c) for c in x.payload] for x in subs])
        tokens = [sum(subs[i].tokens for i in g) for g in groups]
        w = merge_weights(tokens=tokens, steps=[sum(subs[i].inner_steps for i in g) for g in groups],
                          scheme=s.weighting, staleness=[0] * len(groups), staleness_discount=s.staleness_discount)
        g = merge_fragment(deltas, w, rule="mean" if final else s.merge_rule, embedding_mask=self.emb[p])
        params = self.params[p]
        if final:
            for x, d in zip(params, g):
                x.sub_(d)
            return
        buffers = [d for d, b in zip(g, self.buf[p]) if b]
        g = [d.new_zeros(()).expand_as(d) if b else d for d, b in zip(g, self.buf[p])]
        scale = round_step_scale(s.step_scale, participants=len({x.island for x in subs}), live_islands=live)
        factors = self.windows[p].update(g, scale)
        g = [d.mul_(f) if f != 1.0 else d for d, f in zip(g, factors)]
        assert not (is_clock_rule(s.step_scale) and scale != 1.0), "the reference steps full rounds through torch"
        for x, d in zip(params, g):
            x.grad = d.detach().to(torch.float32, copy=True)
            if scale != 1.0:
                x.grad.mul_(scale)
        self.sgd[p].step()
        for x in params:
            x.grad = None
        for x, d in zip([x for x, b in zip(params, self.buf[p]) if b], buffers):
            x.sub_(d)


def _plan(*fragments: tuple[str, ...]) -> FragmentPlan:
    return FragmentPlan(tuple(fragments), tuple(sum(4 * torch.Size(SHAPES[n]).numel() for n in f) for f in fragments))


def _submission(island, seq, fragment, base, payload, tokens):
    return Submission(island=island, incarnation=1, seq=seq, fragment=fragment, base_version=base, tokens=tokens,
                      inner_steps=10, step_time_s=0.1, train_loss=2.0, payload=payload)


@pytest.mark.parametrize("scheme", ["none", "int8", "int4", "bf16"])
@pytest.mark.parametrize("merge_rule", ["rda", "mean"])
@pytest.mark.parametrize("quorum", ["all", 1])
def test_rounds_in_place_are_bitwise_the_whole_fragment_rounds(scheme, merge_rule, quorum):
    gen = torch.Generator().manual_seed(44)
    initial = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    plan = _plan(("emb.weight", "w1", "bn.running_mean"), ("b1", "w2"))
    # The participation step scale, so that the reference can step through torch's SGD itself (scaled
    # gradients); the clock rule's partial rounds are pinned to their formula in tests/policies. K = 1 rounds
    # are partial (share 1/4) and fold into RDA's window across rounds; K = all rounds join two segments.
    full = quorum == "all"
    settings = outer_from_config(min_quorum=ISLANDS if full else 1, grace_gamma=float("inf") if full else 0.5,
                                 grace_cap_s=float("inf") if full else 0.0, merge_rule=merge_rule,
                                 compression=scheme, step_scale="participation", poison_guard=False)
    core = OuterOptimizer(initial, plan, settings=settings, embedding_names=EMB, buffer_names=BUF,
                          copy_results=False)
    ref = Reference(initial, plan, settings)
    for i in range(ISLANDS):
        core.register(i, 1)
    seq = 0
    for rnd in range(4):
        for p, names in enumerate(plan.fragments):
            # Island 0 sends two segments in round 1 (joined as one); island 3 sends a zero outer gradient once.
            senders = [0, 0, 1, 2, 3] if rnd == 1 and full else list(range(ISLANDS))
            subs = []
            for k, island in enumerate(senders):
                seq += 1
                zero = rnd == 2 and island == 3
                payload = [compress(torch.zeros(SHAPES[n]) if zero else torch.randn(SHAPES[n], generator=gen) * 0.01,
                                    scheme) for n in names]
                subs.append(_submission(island, seq, p, core.versions[p], payload, tokens=100 + 37 * k))
            batches = [subs] if full else [[x] for x in subs]
            for batch in batches:
                results = []
                for sub in batch:
                    got, refusal = core.receive(sub, now=float(rnd))
                    assert refusal is None
                    results += got
                assert len(results) == 1
                ref.round(p, batch, live=ISLANDS)
                for x, y in zip(results[0].tensors, ref.params[p]):
                    assert torch.equal(x, y)
    if not full and merge_rule == "rda":
        assert any(w.active for w in core._rda_windows), "K = 1 rounds must have folded into the window"
    # Momentum too (a buffer's stays at zero, or is never made).
    for p in range(len(plan.fragments)):
        for name, got, x in zip(plan.fragments[p], core._opts[p].momentum_buffers(), ref.params[p]):
            want = ref.sgd[p].state[x].get("momentum_buffer")
            if name in BUF:
                assert got is None and float(want.abs().max()) == 0.0
            else:
                assert torch.equal(got, want)


def test_final_flush_in_place_is_bitwise_the_mean_step():
    gen = torch.Generator().manual_seed(45)
    initial = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    plan = _plan(tuple(SHAPES))
    settings = outer_from_config(compression="int8")
    core = OuterOptimizer(initial, plan, settings=settings, embedding_names=EMB, buffer_names=BUF)
    ref = Reference(initial, plan, settings)
    core.register(0, 1)
    core.register(1, 1)
    core.hold()
    subs = [_submission(i, i, 0, 0, [compress(torch.randn(s, generator=gen), "int8") for s in SHAPES.values()], 50 * (i + 1))
            for i in range(2)]
    for sub in subs:
        assert core.receive(sub, now=0.0) == ([], None)
    (result,) = core.close_all(now=1.0)
    ref.round(0, subs, live=2, final=True)
    for x, y in zip(result.tensors, ref.params[0]):
        assert torch.equal(x, y)


def test_results_are_copies_unless_asked_for_the_live_tensors():
    initial = {n: torch.zeros(s) for n, s in SHAPES.items()}
    plan = _plan(tuple(SHAPES))
    for copies in (True, False):
        core = OuterOptimizer(copy.deepcopy(initial), plan, settings=outer_from_config(), copy_results=copies)
        core.register(0, 1)
        sub = _submission(0, 0, 0, 0, [compress(torch.full(s, 0.1), "none") for s in SHAPES.values()], 100)
        (result,), _ = core.receive(sub, now=0.0)
        live = core.params[0]
        assert all((x is y) != copies for x, y in zip(result.tensors, live))
