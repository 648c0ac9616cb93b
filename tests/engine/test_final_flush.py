"""The final flush: at the end of a run every island's unsubmitted progress is cut and merged.

Real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray).
"""

from __future__ import annotations

import math

from islands.island import LearnerIsland
from orchestrator.core.outer_optimizer import OuterSettings
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=2)


def setup(m: int = 2, settings: OuterSettings | None = None):
    # K = all: a round waits for both islands, so a lone submission would wait forever without the flush.
    w = nano_world(settings or outer_from_config(min_quorum=m, grace_gamma=math.inf, grace_cap_s=math.inf, poison_guard=False))
    islands = []
    for i in range(m):
        spec = spec_from_config(island=i, incarnation=1, pool="p", num_islands=m, model_config=w.cfg, plan=w.plan, inner=INNER,
                                sync_every_steps=8, seed=1, adoption="overwrite")  # P = 2: a cut every 4 steps
        islands.append(LearnerIsland(spec, w.data, w.latest))
        w.outer.register(i, 1)
    return w.outer, islands


def drain(outer, island) -> list:
    results = []
    while (sub := island.next_submission(0)) is not None:
        got, refusal = outer.receive(sub, now=1.0)
        assert refusal is None
        results += got
    return results


def test_flush_merges_every_token_processed():
    outer, (a, b, idle) = setup(3)  # the third island never steps: K = 3 is never reached
    for _ in range(6):
        a.step()  # a cut of fragment 0 at step 4, then 2 more steps on both fragments
    for _ in range(3):
        b.step()  # no cut yet
    assert drain(outer, a) == [] and outer.versions == [0, 0], "alone, island 0 cannot make a quorum"
    for island in (a, b, idle):
        island.stop(flush=True)
    assert idle.next_submission(0) is None, "no progress, nothing to flush"
    assert a.status().unsubmitted_tokens == [0, 0] and b.status().unsubmitted_tokens == [0, 0]
    drain(outer, a)
    drain(outer, b)
    assert a.next_submission(0) is None, "stopped and empty: the poller ends"
    assert outer.versions == [0, 0], "2 of K = 3: still no quorum"
    results = outer.close_all(now=2.0)
    assert [(r.fragment, r.record.reason, sorted(set(r.record.participants))) for r in results] == [
        (0, "final flush", [0, 1]), (1, "final flush", [0, 1])]
    assert outer.versions == [1, 1] and outer.pending_tokens() == [0, 0]
    total = a.total_tokens + b.total_tokens
    assert outer.tokens_merged == [total, total], "every token of both islands reached the global parameters"


def test_stop_without_flush_freezes_the_outbox():
    outer, (a, _) = setup(2)
    for _ in range(6):
        a.step()
    a.stop()
    assert a.next_submission(0) is None, "frozen: the cut submission is not handed out any more"
    assert a.status().unsubmitted_tokens[1] == 6 * a.total_tokens // 6 and outer.tokens_merged == [0, 0]


def test_a_lone_island_round_takes_its_share_of_a_full_step():
    """K = 1 with 3 live islands: one island's round moves the fragment by 1/3 of an unscaled step."""
    import torch

    moved = {}
    for rule in ("participation", "clock", "none"):
        outer, (a, _, _) = setup(3)
        outer.settings = outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, step_scale=rule, poison_guard=False)
        before = outer.fragment(0)
        for _ in range(4):
            a.step()  # the cut of fragment 0 at step 4
        sub = a.next_submission(0)
        (result,), refusal = outer.receive(sub, now=1.0)
        assert refusal is None and result.record.participants == [0]
        assert result.record.step_scale == (1.0 if rule == "none" else 1 / 3)
        moved[rule] = [(b - t).double() for b, t in zip(before, outer.fragment(0))]
    # Same island, same data, same seed: the first Nesterov step is linear in the gradient.
    assert any(m.abs().max() > 0 for m in moved["none"])
    for small, full in zip(moved["participation"], moved["none"]):
        torch.testing.assert_close(small * 3, full, rtol=1e-5, atol=1e-7)
    # clock: a third of a round in time, with the partial rounds' momentum mu_p. From a zero buffer the step
    # is (1/3) lr (g + mu_p * gain * g) with gain = (1 - mu_p^(1/3)) / (1 - mu_p), against the unscaled
    # lr (g + mu * g).
    mu, mu_p = outer.settings.momentum, outer.settings.partial_momentum
    gain = (1 - mu_p ** (1 / 3)) / (1 - mu_p)
    for clocked, full in zip(moved["clock"], moved["none"]):
        torch.testing.assert_close(clocked, full * (1 + mu_p * gain) / (3 * (1 + mu)), rtol=1e-5, atol=1e-7)


def test_a_lone_island_round_under_the_clock_takes_the_partial_momentum():
    """The engine builds its fragment optimizers with the settings' partial momentum (K = 1 rounds)."""
    import torch

    moved = {}
    for partial in (None, 0.5):  # None: the full rounds' 0.9 (the default is 0.7)
        outer, (a, _, _) = setup(3, outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, partial_momentum=partial,
                                                           poison_guard=False))
        before = outer.fragment(0)
        for _ in range(4):
            a.step()
        (result,), refusal = outer.receive(a.next_submission(0), now=1.0)
        assert refusal is None and result.record.step_scale == 1 / 3
        moved[partial] = [(b - t).double() for b, t in zip(before, outer.fragment(0))]
    # From a zero buffer a share-s round moves s lr (1 + mu gain(mu)) g, gain(mu) = (1 - mu^s) / (1 - mu).
    factor = {mu: 1 + mu * (1 - mu ** (1 / 3)) / (1 - mu) for mu in (0.9, 0.5)}
    assert any(m.abs().max() > 0 for m in moved[None])
    for half, full in zip(moved[0.5], moved[None]):
        torch.testing.assert_close(half, full * factor[0.5] / factor[0.9], rtol=1e-5, atol=1e-7)


def test_the_flush_moves_to_the_islands_weighted_mean_not_an_rda_step():
    """Golden: global after the flush = global before - sum_m w_m * delta_m (w by tokens, equal batches), even
    under merge_rule rda, whose radial-directional step would be longer (measured to raise the final loss)."""
    import torch

    from policies.downlink import decode_fragment

    outer, (a, b) = setup(2, outer_from_config(min_quorum=2, grace_gamma=math.inf, grace_cap_s=math.inf, merge_rule="rda"))
    for _ in range(3):
        a.step()
    b.step()  # different progress, different token counts: unequal weights
    outer.hold()  # as the driver does before the islands' last cuts: no regular round closes on them
    for island in (a, b):
        island.stop(flush=True)
    subs = {0: [], 1: []}
    for island in (a, b):
        while (sub := island.next_submission(0)) is not None:
            subs[sub.fragment].append(sub)
            assert outer.receive(sub, now=1.0)[1] is None
    before = [outer.fragment(p) for p in (0, 1)]
    outer.close_all(now=2.0)
    for p in (0, 1):
        tokens = [s.tokens for s in subs[p]]
        assert len(tokens) == 2 and tokens[0] != tokens[1]
        deltas = [decode_fragment(s.payload) for s in subs[p]]
        for t, (old, new) in enumerate(zip(before[p], outer.fragment(p))):
            mean = sum(w / sum(tokens) * d[t] for w, d in zip(tokens, deltas))
            torch.testing.assert_close(new, old - mean, rtol=0, atol=1e-6)
