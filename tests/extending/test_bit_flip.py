"""The worked fault kind examples/extending/bit_flip.py: importing it registers ``bit_flip``, faults of the kind are
validated by its rule (one line), tapes draw it, and injected into a real in-process island it flips bit 30 of
exactly one element per tensor of what the island sends, checked against the same island's twin without the fault
and against the bits worked out with struct. The submission check refuses such a submission (its norm overflows);
a smaller flip is refused by the poison guard and dropped by the trimmed mean.
No Ray."""

from __future__ import annotations

import importlib
import math
import struct

import pytest
import torch

from islands.faults import InjectedFaults
from islands.island import LearnerIsland
from islands.messages import Submission
from orchestrator.core.outer_optimizer import OuterOptimizer
from policies import fault_kinds
from policies.chaos import POISON_KINDS, Fault, fixed_tape
from policies.compression import compress, decompress
from policies.fragments import plan_fragments
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

MODULE = "examples.extending.bit_flip"


@pytest.fixture
def bit_flip():
    """The example module with its kind registered, taken off the registry after the test: other tests count the
    registered kinds. Importing registers it; once unregistered, only running the module again does."""
    module = importlib.import_module(MODULE)
    if "bit_flip" not in fault_kinds.names():
        module = importlib.reload(module)
    yield module
    fault_kinds.unregister("bit_flip")


def _flipped_by_hand(x: float) -> float:
    """`x` as float32 with bit 30 flipped, through its bytes."""
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    (out,) = struct.unpack("<f", struct.pack("<I", bits ^ (1 << 30)))
    return out


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_importing_it_registers_a_poison_kind(bit_flip):
    assert fault_kinds.names()[-1] == "bit_flip" and "bit_flip" not in POISON_KINDS  # the built-in view is unchanged
    assert isinstance(fault_kinds.poison_kind("bit_flip"), bit_flip.BitFlip)
    tape = fixed_tape(islands=2, failures_per_island=1, horizon_s=10.0, kind="bit_flip")
    assert [f.kind for f in tape] == ["bit_flip", "bit_flip"] and {f.duration_s for f in tape} == {0.0}


def test_faults_of_the_kind_are_validated_by_its_rule(bit_flip):
    assert Fault(island=1, kind="bit_flip", at_s=2.0, duration_s=5.0).duration_s == 5.0
    assert ("Fault.factor of a bit_flip fault must be 1.0 (it flips bit 30 of one element per tensor, it has no "
            "size), got 4.0" in one_line_error(Fault, island=1, kind="bit_flip", at_s=2.0, factor=4.0))
    assert "at_s must be a finite number" in one_line_error(Fault, island=0, kind="bit_flip", at_s=-1.0)


def test_the_bits_are_flipped_as_worked_out_by_hand(bit_flip):
    values = [0.375, -0.01, 0.0, 1.5, 6.0]
    by_hand = [_flipped_by_hand(v) for v in values]
    assert by_hand[0] == 0.375 * 2.0**128 and by_hand[1] == pytest.approx(-0.01 * 2.0**128, rel=1e-6)
    assert by_hand[2] == 2.0 and math.isnan(by_hand[3]) and by_hand[4] == 6.0 * 2.0**-128
    t = torch.tensor(values)
    for i, expected in enumerate(by_hand):
        out = bit_flip.flip_bit(t, i)
        assert torch.equal(t, torch.tensor(values)), "the input is not changed"
        got = out[i].item()
        assert (math.isnan(got) and math.isnan(expected)) or got == expected
        assert torch.equal(torch.cat([out[:i], out[i + 1:]]), torch.cat([t[:i], t[i + 1:]]))
    owed = [torch.full((3, 4), 0.25), torch.full((5,), -0.5)]
    poisoned = fault_kinds.poison_kind("bit_flip").poisoned(owed, stale_base=None, anchor=owed, seed=17)
    for o, p in zip(owed, poisoned):  # every element of `o` is the same: the flipped one is flipped(o[0])
        diff = (o != p).view(-1)
        assert int(diff.sum()) == 1 and p.dtype == o.dtype and p.shape == o.shape
        assert p.view(-1)[diff].item() == _flipped_by_hand(o.view(-1)[0].item())
    again = fault_kinds.poison_kind("bit_flip").poisoned(owed, stale_base=None, anchor=owed, seed=17)
    assert all(torch.equal(a, b) for a, b in zip(poisoned, again)), "the cut's seed picks the same elements again"


def test_the_island_faults_take_it_for_its_duration(bit_flip):
    f = InjectedFaults(0)
    f.inject("bit_flip", now=10.0, duration_s=5.0)
    assert f.count == 1 and f.poison(12.0) == "bit_flip" and f.poison(15.0) is None
    f.inject("bit_flip", now=20.0)  # duration 0: the rest of the incarnation
    assert f.poison(1e9) == "bit_flip"


def test_a_real_island_sends_one_flipped_element_per_tensor(bit_flip):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=math.inf, grace_cap_s=math.inf, poison_guard=False))
    inner = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=2)
    hit, twin = (LearnerIsland(spec_from_config(island=0, incarnation=1, pool="p", num_islands=2, model_config=w.cfg,
                                                plan=w.plan, inner=inner, sync_every_steps=8, seed=1), w.data, w.latest)
                 for _ in range(2))  # the same slot twice: the same data and steps, so the same honest cut
    hit.inject("bit_flip", duration_s=600.0)
    for island in (hit, twin):
        for _ in range(4):  # P = 2, H = 8: a cut every 4 steps
            island.step()
    bad, good = hit.next_submission(0), twin.next_submission(0)
    assert bad is not None and good is not None and bad.fragment == good.fragment
    for b, g in zip(bad.payload, good.payload):
        b, g = decompress(b).view(-1), decompress(g).view(-1)
        changed = (b != g).nonzero().view(-1)
        assert len(changed) == 1, "one element per tensor"
        i = int(changed[0])
        assert b[i].item() == _flipped_by_hand(g[i].item())


TRIMMED = {"merge_rule": "examples.extending.trimmed_mean:TrimmedMean", "lr": 1.0, "momentum": 0.0,
           "partial_momentum": 0.0}
HONEST = [[torch.tensor([0.10, 0.20, 0.30, 0.40])], [torch.tensor([0.15, 0.25, 0.25, 0.45])],
          [torch.tensor([0.12, 0.22, 0.28, 0.41])]]


def round_of(outer: dict, sent: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[str]]:
    """The fragment after islands 0.. sent `sent` under `outer`, all in one round, and the refusals' reasons."""
    core = OuterOptimizer({"w": torch.zeros(4)}, plan_fragments([("w", 16)], 1), settings=outer_from_config(
        {"outer": outer}, min_quorum=4, grace_gamma=0.0, grace_cap_s=0.0))  # the four in one round
    for island in range(4):
        core.register(island, 1)
    for island, ds in enumerate(sent):
        sub = Submission(island=island, incarnation=1, seq=0, fragment=0, base_version=0, tokens=1000,
                         inner_steps=40, step_time_s=0.1, train_loss=3.0, payload=[compress(d, "none") for d in ds])
        core.receive(sub, now=0.0)
    core.close_all(now=1.0)  # a round short of four closes here; the guard judges as it closes
    return core.fragment(0), [r.reason for r in core.refusals]


@pytest.mark.parametrize("outer", [{}, {"poison_guard": True}, TRIMMED], ids=["defaults", "guard", "trimmed"])
def test_the_submission_check_refuses_it_and_the_round_is_the_honest_islands(bit_flip, outer):
    """Bit 30 of an element below 1 multiplies it by 2**128: finite, but the tensor's norm overflows float32, which
    the submission check refuses whatever the guard and the merge rule (before 2026-12-03 it joined its round and
    RDA wrote -inf). The round is then exactly the three honest islands' round."""
    bad = fault_kinds.poison_kind("bit_flip").poisoned(HONEST[0], stale_base=None, anchor=HONEST[0], seed=3)
    assert torch.isfinite(bad[0]).all() and bad[0].abs().max() > 1e30
    got, refused = round_of(outer, [*HONEST, bad])
    assert len(refused) == 1 and "norm overflows float32" in refused[0]
    honest_only, none = round_of(outer, HONEST)
    assert none == [] and torch.equal(got[0], honest_only[0]) and torch.isfinite(got[0]).all()


def test_a_flipped_element_the_check_lets_through_is_refused_by_the_guard_and_dropped_by_the_trimmed_mean(bit_flip):
    """The same flipped element scaled down by 2**100 (x * 2**28, finite norm) passes the submission check: the
    poison guard refuses it by its size, the trimmed mean drops it per coordinate."""
    bad = fault_kinds.poison_kind("bit_flip").poisoned(HONEST[0], stale_base=None, anchor=HONEST[0], seed=3)
    bad = [torch.where(b.abs() > 1e30, b * 2.0**-100, b) for b in bad]
    assert bad[0].abs().max() > 1e6 and math.isfinite(float(torch.linalg.vector_norm(bad[0])))
    guarded, refused = round_of({"poison_guard": True}, [*HONEST, bad])
    assert len(refused) == 1 and "poisoned" in refused[0] and torch.isfinite(guarded[0]).all()
    trimmed, refused = round_of(TRIMMED, [*HONEST, bad])
    assert refused == [] and torch.isfinite(trimmed[0]).all() and trimmed[0].abs().max() < 1.0
