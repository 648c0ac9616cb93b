"""A compressed downlink (outer.downlink): islands decode published fragments and train from them.

A real LearnerIsland stepped in process (no Ray); the published fragments are built the way the
outer-optimizer shell builds them, with policies.compression.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from islands.island import LearnerIsland
from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from orchestrator.config import ConfigError, build_config
from policies.compression import compress
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config, spec_from_config


def _island(initial_scheme: str):
    cfg = model_config("nano")
    model = build_model(cfg, seed=2)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in named.items()], 2)
    frags = [[named[n] for n in frag] for frag in plan.fragments]

    def wire(tensors, scheme):
        return tensors if scheme == "none" else [compress(t, scheme, block_size=64) for t in tensors]

    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=1, model_config=cfg, plan=plan,
                            inner=inner_from_config(lr=1e-3, warmup_steps=0, batch_size=2), sync_every_steps=8, seed=2, adoption="overwrite")
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
        for t, g in zip(island.fragments.theta[p], frag):
            assert torch.allclose(t.detach(), reference(g), rtol=0, atol=1e-7)
    for _ in range(3):
        island.step()
    newer = [[g + 0.01 for g in frag] for frag in frags]
    island.adopt(FragmentUpdate(1, 1, [wire(newer[1], scheme)]))
    island.apply_updates()
    assert island.fragments.version == [0, 1]
    for t, g in zip(island.fragments.theta[1], newer[1]):  # overwrite adoption: exactly the decoded fragment
        assert torch.allclose(t.detach(), reference(g), rtol=0, atol=1e-7)
    assert island.step(), "it trains on from the decoded parameters"


def test_downlink_rejects_an_unknown_format_in_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"outer": {"downlink": "int4"}})
    msg = str(err.value)
    assert "downlink" in msg and "\n" not in msg.strip()


# ---------------------------------------------------------------- differences (outer.downlink_delta)


def _delta_island(scheme="int8"):
    """An island started from whole fragments (epoch 0), and the sender's copies after that start."""
    from policies.downlink import DownlinkCopies

    island, frags, _ = _island("none")
    copies = DownlinkCopies("none", scheme, block_size=64)
    for p, f in enumerate(frags):  # the sender's first send of each fragment is whole
        enc = copies.encode(0, 1, p, 0, f)
        assert enc.delta_from is None
    return island, frags, copies


def _send(island, copies, p, version, tensors, epoch=0, **kw):
    enc = copies.encode(0, 1, p, version, tensors)
    island.adopt(FragmentUpdate(p, version, [enc.payload], epoch=epoch, delta_from=enc.delta_from, **kw))


def test_an_island_adopts_a_chain_of_differences_to_the_sender_copy():
    island, frags, copies = _delta_island("int4")
    for _ in range(2):
        island.step()
    target = frags[1]
    for v in (1, 2, 3):  # several links arrive before one step boundary: applied in version order
        target = [g + 0.003 * (v + 1) for g in target]
        _send(island, copies, 1, v, target)
    island.apply_updates()
    assert island.fragments.version == [0, 3]
    held = copies.copy_of(0, 1)[1]
    for t, b, c in zip(island.fragments.theta[1], island.fragments.base[1], held):  # overwrite: theta = the copy the sender tracks
        assert torch.allclose(t.detach(), c, rtol=0, atol=1e-6) and torch.allclose(b, c, rtol=0, atol=1e-6)
    assert island.step()


def test_a_difference_from_a_restarted_outer_or_already_overtaken_is_bookkeeping_only():
    island, frags, copies = _delta_island()
    before = [t.detach().clone() for t in island.fragments.theta[0]]
    # epoch 1 resync (the outer optimizer restarted): whole fragments; then a late epoch-0 difference.
    island.resync([FragmentUpdate(p, 5, [f], epoch=1) for p, f in enumerate(frags)])
    island.apply_updates()
    _send(island, copies, 0, 7, [g + 1.0 for g in frags[0]], epoch=0)
    assert island.apply_updates() == set()
    assert island.fragments.version[0] == 5 and island.fragments.epoch[0] == 1
    for t, b in zip(island.fragments.theta[0], before):  # still the resynced (equal) parameters, not +1
        assert torch.allclose(t.detach(), b)
    # A whole version from the old epoch is not adopted either, even with a higher number.
    island.adopt(FragmentUpdate(0, 9, [[g + 1.0 for g in frags[0]]], epoch=0))
    assert island.apply_updates() == set() and island.fragments.version[0] == 5


def test_a_resend_of_the_version_held_only_clears_bookkeeping():
    from islands.messages import SubmissionKey
    from islands.outbox import InFlight

    island, frags, copies = _delta_island()
    key = SubmissionKey(0, 1, 7)
    island.outbox.inflight[key] = InFlight(0, None)  # a submission the outer optimizer refused
    _send(island, copies, 0, 0, frags[0], refused=(key,))  # the island already holds version 0
    assert island.apply_updates() == set() and key not in island.outbox.inflight and island.fragments.version == [0, 0]


def test_a_gap_in_the_chain_fails_the_island_loudly():
    island, frags, copies = _delta_island()
    copies.encode(0, 1, 0, 1, [g + 0.01 for g in frags[0]])  # sent, never delivered
    _send(island, copies, 0, 2, [g + 0.02 for g in frags[0]])
    with pytest.raises(RuntimeError, match="from version 1, but this island holds version 0"):
        island.apply_updates()


def test_resync_refuses_a_difference_and_changes_nothing():
    island, frags, copies = _delta_island()
    island.step()
    tokens = list(island.fragments.tokens)
    enc = copies.encode(0, 1, 0, 1, [g + 0.01 for g in frags[0]])
    with pytest.raises(ValueError, match="whole fragments"):
        island.resync([FragmentUpdate(0, 1, [enc.payload], delta_from=0)])
    assert island.fragments.tokens == tokens and island.apply_updates() == set() and island.fragments.version == [0, 0]


def test_downlink_delta_config_accepts_formats_and_rejects_others_in_one_line():
    assert build_config({"outer": {"downlink_delta": "int4"}}).outer.downlink_delta == "int4"
    assert build_config({}).outer.downlink_delta is None
    with pytest.raises(ConfigError) as err:
        build_config({"outer": {"downlink_delta": "none"}})
    assert "downlink_delta" in str(err.value) and "\n" not in str(err.value).strip()
