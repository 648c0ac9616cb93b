"""A compressed downlink (outer.downlink): islands decode published fragments and train from them.

A real LearnerIsland stepped in process (no Ray); the published fragments are built the way the
outer-optimizer shell builds them, with policies.compression.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from islands.island import IslandSpec, LearnerIsland
from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from islands.trainer import InnerSettings
from orchestrator.config import ConfigError, build_config
from policies.compression import compress
from policies.fragments import plan_fragments


def _island(initial_scheme: str):
    cfg = model_config("nano")
    model = build_model(cfg, seed=2)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in named.items()], 2)
    frags = [[named[n] for n in frag] for frag in plan.fragments]

    def wire(tensors, scheme):
        return tensors if scheme == "none" else [compress(t, scheme, block_size=64) for t in tensors]

    spec = IslandSpec(island=0, incarnation=1, pool="p", num_islands=1, model_config=cfg, plan=plan,
                      inner=InnerSettings(lr=1e-3, warmup_steps=0, batch_size=2), sync_every_steps=8, seed=2)
    data = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint8)
    island = LearnerIsland(spec, data, [FragmentUpdate(p, 0, [wire(f, initial_scheme)]) for p, f in enumerate(frags)])
    return island, frags, wire


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_an_island_starts_from_and_adopts_the_decoded_global(scheme):
    island, frags, wire = _island(scheme)
    # Independent reference for the decoded values: bf16 is torch's cast; int8 is round(x / s) * s
    # per block of 64 with s = absmax / 127.
    def reference(t):
        if scheme == "bf16":
            return t.to(torch.bfloat16).to(torch.float32)
        flat = t.reshape(-1)
        out = torch.empty_like(flat)
        for b in range(0, flat.numel(), 64):
            block = flat[b:b + 64]
            s = block.abs().max() / 127
            out[b:b + 64] = torch.round(block / s) * s if s > 0 else block
        return out.reshape(t.shape)

    for p, frag in enumerate(frags):
        for t, g in zip(island._theta[p], frag):
            assert torch.allclose(t.detach(), reference(g), rtol=0, atol=1e-7)
    for _ in range(3):
        island.step()
    newer = [[g + 0.01 for g in frag] for frag in frags]
    island.adopt(FragmentUpdate(1, 1, [wire(newer[1], scheme)]))
    island.apply_updates()
    assert island._version == [0, 1]
    for t, g in zip(island._theta[1], newer[1]):  # overwrite adoption: exactly the decoded fragment
        assert torch.allclose(t.detach(), reference(g), rtol=0, atol=1e-7)
    assert island.step(), "it trains on from the decoded parameters"


def test_downlink_rejects_an_unknown_format_in_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"outer": {"downlink": "int4"}})
    msg = str(err.value)
    assert "downlink" in msg and "\n" not in msg.strip()
