"""The served model under run.average_window: the outer optimizer's moving average of its global model.

Real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray). The expected average is
recomputed here from each round's published tensors and token count.
"""

from __future__ import annotations

import torch

from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from orchestrator.core.outer_optimizer import OuterSettings
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=3e-3, warmup_steps=0, batch_size=2)
WINDOW = 0.2


def train_rounds(settings: OuterSettings, rounds: int = 12):
    """Two islands, K = 1: every cut closes a round; each new version is adopted. Returns (outer, results)."""
    w = nano_world(settings)
    islands = []
    for i in range(2):
        spec = spec_from_config(island=i, incarnation=1, pool="p", num_islands=2, model_config=w.cfg, plan=w.plan, inner=INNER,
                                sync_every_steps=4, seed=1, adoption="overwrite")  # P = 2: a cut every 2 steps
        islands.append(LearnerIsland(spec, w.data, w.latest))
        w.outer.register(i, 1)
    results = []
    while len(results) < rounds:
        for island in islands:
            island.step()
            while (sub := island.next_submission(0)) is not None:
                got, refusal = w.outer.receive(sub, now=0.0)
                assert refusal is None
                results += got
                for r in got:
                    for other in islands:
                        other.adopt(FragmentUpdate(r.fragment, r.version, [r.tensors], merged=r.merged))
    return w, results


def settings(window):
    return outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, average_window=window)


def test_the_served_model_is_the_token_weighted_moving_average_of_the_versions():
    w, results = train_rounds(settings(WINDOW))
    expected = [[t.clone() for t in u.tensors[0]] for u in w.latest]  # version 0 of each fragment
    merged = [0, 0]
    for r in results:
        merged[r.fragment] += r.record.tokens
        a = min(1.0, r.record.tokens / (WINDOW * merged[r.fragment]))
        expected[r.fragment] = [e + a * (t - e) for e, t in zip(expected[r.fragment], r.tensors)]
    assert merged == w.outer.tokens_merged
    served, raw = w.outer.served_parameters(), w.outer.global_parameters()
    names = w.outer.plan.fragments
    moved = 0.0
    for p, frag in enumerate(names):
        for n, e in zip(frag, expected[p]):
            torch.testing.assert_close(served[n], e, rtol=0, atol=1e-6)
            moved = max(moved, float((served[n] - raw[n]).abs().max()))
    assert moved > 1e-4, "the average lags the global model: they must differ for the comparison to mean anything"


def test_without_a_window_the_served_model_is_the_global_model():
    w, _ = train_rounds(settings(None))
    served, raw = w.outer.served_parameters(), w.outer.global_parameters()
    assert w.outer.average is None
    assert all(torch.equal(served[n], raw[n]) for n in raw)


def test_a_checkpoint_keeps_the_average_and_an_older_one_starts_it_at_the_global_model():
    w, _ = train_rounds(settings(WINDOW))
    tensors, meta = w.outer.state_dict()
    assert {n for n in tensors if n.startswith("average/")} == {f"average/{n}" for n in w.outer.global_parameters()}

    fresh = nano_world(settings(WINDOW)).outer
    fresh.load_state_dict(tensors, meta)
    assert all(torch.equal(fresh.served_parameters()[n], t) for n, t in w.outer.served_parameters().items())
    assert all(torch.equal(fresh.global_parameters()[n], t) for n, t in w.outer.global_parameters().items())

    # A checkpoint of a run without averaging (no average/ tensors), resumed with a window.
    plain = {n: t for n, t in tensors.items() if not n.startswith("average/")}
    resumed = nano_world(settings(WINDOW)).outer
    resumed.load_state_dict(plain, meta)
    assert all(torch.equal(resumed.served_parameters()[n], t) for n, t in w.outer.global_parameters().items())


def test_islands_train_from_the_global_model_not_the_average():
    """What each round publishes is the raw global fragment, whatever the window."""
    w, results = train_rounds(settings(WINDOW), rounds=4)
    last = {}
    for r in results:
        last[r.fragment] = r.tensors
    raw = w.outer.global_parameters()
    for p, frag in enumerate(w.outer.plan.fragments):
        for n, t in zip(frag, last[p]):
            assert torch.equal(raw[n], t)
