"""The outer optimizer's resident memory under the default settings does not grow with the number of islands or
with max_staleness (issue 44, part 2), and is what docs/outer.md's formula says: the parameters, their momentum,
RDA's window across rounds (the RDA-merged tensors) and one merge buffer of the largest tensor (two with int8/int4
submissions, which are decoded into the second). Measured by walking everything the core refers to
(orchestrator.core.memory.retained_tensor_bytes), so a copy kept anywhere inside it counts."""

from __future__ import annotations

import pytest
import torch

from islands.messages import Submission
from orchestrator.core.memory import retained_tensor_bytes
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies.compression import compress
from policies.fragments import FragmentPlan
from tests.from_config import outer_from_config

SHAPES = {"emb.weight": (16, 8), "w1": (8, 32), "b1": (32,), "w2": (32, 8), "b2": (8,)}
EMB = {"emb.weight"}
PLAN = FragmentPlan((("emb.weight", "w1"), ("b1", "w2", "b2")),
                    (4 * (16 * 8 + 8 * 32), 4 * (32 + 32 * 8 + 8)))
F32 = 4


def _core_after_rounds(islands: int, *, compression: str = "none", **settings) -> OuterOptimizer:
    """A default core (K = 1: every submission closes a partial round) after every island sent every fragment twice."""
    gen = torch.Generator().manual_seed(islands)
    initial = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    core = OuterOptimizer(initial, PLAN, settings=outer_from_config(compression=compression, grace_cap_s=0.0, poison_guard=False, **settings),
                          embedding_names=EMB, copy_results=False)
    for i in range(islands):
        core.register(i, 1)
    seq = 0
    for _ in range(2):
        for p, names in enumerate(PLAN.fragments):
            for i in range(islands):
                seq += 1
                payload = [compress(torch.randn(SHAPES[n], generator=gen) * 0.01, compression) for n in names]
                sub = Submission(island=i, incarnation=1, seq=seq, fragment=p, base_version=core.versions[p],
                                 tokens=100, inner_steps=10, step_time_s=0.1, train_loss=2.0, payload=payload)
                closed, refusal = core.receive(sub, now=float(seq))
                assert refusal is None and len(closed) == 1
    assert core.pending_tokens() == [0, 0]
    return core


def _formula(compression: str) -> int:
    """docs/outer.md's resident bytes of the default core after partial rounds: M + M + M_rda + T (+ T to decode)."""
    model = sum(F32 * torch.Size(s).numel() for s in SHAPES.values())
    rda = sum(F32 * torch.Size(s).numel() for n, s in SHAPES.items() if n not in EMB)
    largest = max(F32 * torch.Size(s).numel() for s in SHAPES.values())
    return 2 * model + rda + largest * (2 if compression in ("int8", "int4") else 1)


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_default_footprint_does_not_grow_with_islands_or_staleness(compression):
    few = retained_tensor_bytes(_core_after_rounds(2, compression=compression))
    many = retained_tensor_bytes(_core_after_rounds(8, compression=compression))
    stale = retained_tensor_bytes(_core_after_rounds(8, compression=compression, max_staleness=16))
    assert few == many == stale == _formula(compression)


def test_opt_in_copies_are_counted_too():
    # The served moving average adds one model copy; a core of full rounds (K = all) never builds RDA's window.
    model = sum(F32 * torch.Size(s).numel() for s in SHAPES.values())
    averaged = retained_tensor_bytes(_core_after_rounds(2, average_window=0.5))
    assert averaged == _formula("none") + model
    rda = sum(F32 * torch.Size(s).numel() for n, s in SHAPES.items() if n not in EMB)
    no_window = retained_tensor_bytes(_core_after_rounds(4, rda_across_rounds=False))
    assert no_window == _formula("none") - rda
