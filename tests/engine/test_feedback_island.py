"""Lossy outer gradients (top-k, int2, sign) on a real island: what its cuts leave out is owed to its next cuts,
snapshots carry all of it, and the outer optimizer merges what arrives.

Real LearnerIslands and the real OuterOptimizer core, stepped in process (no Ray). The reference is the island's
own parameters, recorded step by step, against the sum of what its cuts decoded to.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from islands.island import LearnerIsland
from policies.compression import FEEDBACK_SCHEMES, compress, decompress
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

INNER = inner_from_config(lr=1e-2, warmup_steps=0, batch_size=2)
DENSITY = 0.05


def setup(every: int = 0, scheme: str = "topk"):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, compression=scheme, topk_density=DENSITY))
    shelved: list[bytes] = []
    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=1, model_config=w.cfg, plan=w.plan, inner=INNER,
                            sync_every_steps=4, seed=1, compression=scheme, topk_density=DENSITY, salvage_every_steps=every, adoption="overwrite")
    island = LearnerIsland(spec, w.data, w.latest, shelve=lambda step, blob: shelved.append(blob))
    w.outer.register(0, 1)
    return w, island, shelved


def frag0(island: LearnerIsland, w) -> list[torch.Tensor]:
    params = island.parameters()
    return [params[n].float() for n in w.plan.fragments[0]]


def decoded(sub) -> list[torch.Tensor]:
    return [decompress(c) for c in sub.payload]


@pytest.mark.parametrize("scheme", FEEDBACK_SCHEMES)
def test_a_snapshot_carries_what_the_cuts_still_owe_plus_the_steps_since(scheme):
    w, island, shelved = setup(every=3, scheme=scheme)
    theta = {}
    for step in range(1, 13):
        island.step()  # a cut every 2 steps, fragments alternating: fragment 0 at steps 2, 6, 10; snapshots every 3
        theta[step] = frag0(island, w)
        while island.next_submission(0) is not None:
            pass
    island.wait_shelved()
    snap = {s.fragment: s for s in pickle.loads(shelved[-1]).submissions}[0]  # taken at step 12
    assert all(c.scheme == scheme for c in snap.payload)
    owed = island.outbox.feedback.residual(0)  # what the cuts up to step 10 left out (nothing cut fragment 0 since)
    expected = [decompress(compress(e + a - b, scheme, density=DENSITY)) for e, a, b in zip(owed, theta[10], theta[12])]
    for got, want in zip(decoded(snap), expected):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert float(sum(e.abs().sum() for e in owed)) > 0  # so the snapshot carried more than steps 11-12


@pytest.mark.parametrize("scheme", FEEDBACK_SCHEMES)
def test_nothing_is_lost_sent_plus_owed_equals_progress_exactly(scheme):
    w, island, _ = setup(scheme=scheme)
    start = frag0(island, w)
    cuts = []
    for _ in range(10):
        island.step()
        sub = island.next_submission(0)
        if sub is not None and sub.fragment == 0:
            cuts.append(sub)
            at_cut = frag0(island, w)
    assert len(cuts) == 3
    sent = [sum(ts) for ts in zip(*[decoded(c) for c in cuts])]
    for s, e, a, b in zip(sent, island.outbox.feedback.residual(0), start, at_cut):
        assert torch.allclose(s + e, a - b, atol=1e-6, rtol=1e-5)  # no adoption happened: theta moved only by steps
        assert float(e.abs().sum()) > 0  # and the format really left something out


@pytest.mark.parametrize("scheme", FEEDBACK_SCHEMES)
def test_the_outer_optimizer_merges_lossy_submissions(scheme):
    w, island, _ = setup(scheme=scheme)
    for _ in range(2):
        island.step()
    sub = island.next_submission(0)
    assert sub.fragment == 0
    results, refusal = w.outer.receive(sub, now=1.0)
    assert refusal is None and [r.version for r in results] == [1]
    assert results[0].record.bytes == sum(c.nbytes for c in sub.payload)
    before = [t.float() for t in w.latest[0].tensors[0]]
    moved = [(a - b).abs() for a, b in zip(results[0].tensors, before)]
    assert any(float(m.max()) > 0 for m in moved)
