"""The downlink as differences (policies/downlink.py): what travels, what the receiver ends up with.

The reference receiver here is independent of DownlinkCopies: it starts from the decoded whole
fragment and adds every decoded difference, in float64.
"""

import math

import pytest
import torch

from policies.compression import compress, decompress, error_bound
from policies.downlink import DELTA_SCHEMES, DownlinkCopies, apply_delta, decode_fragment


def _versions(n, shapes, seed=0, step=1e-3):
    """A sequence of global fragments: weights ~ 0.02, each version one small outer step from the last."""
    gen = torch.Generator().manual_seed(seed)
    cur = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    out = [cur]
    for _ in range(n - 1):
        cur = [t + torch.randn(t.shape, generator=gen) * step for t in cur]
        out.append(cur)
    return out


SHAPES = [(64, 33), (257,), (3,)]


@pytest.mark.parametrize("scheme", DELTA_SCHEMES)
def test_receiver_tracks_the_sender_copy_and_error_does_not_accumulate(scheme):
    copies = DownlinkCopies("none", scheme, block_size=64)
    versions = _versions(30, SHAPES)
    receiver = None
    for v, target in enumerate(versions):
        before = copies.copy_of(3, 0)
        enc = copies.encode(island=3, incarnation=1, fragment=0, version=v, tensors=target)
        decoded = [t.to(torch.float64) for t in decode_fragment(enc.payload)]
        if v == 0:
            assert before is None and enc.delta_from is None  # the first send is whole
            receiver = decoded
        else:
            assert enc.delta_from == v - 1
            receiver = [r + d for r, d in zip(receiver, decoded)]
        have, copy = copies.copy_of(3, 0)
        assert have == v
        for r, c in zip(receiver, copy):  # the sender knows what the receiver holds (to float32 rounding)
            assert torch.allclose(r, c.to(torch.float64), rtol=0, atol=1e-6)
    # After 29 differences the receiver is within ONE difference's quantization bound of the newest
    # version: the error of earlier sends was folded into later differences, not summed.
    diff = [t - c for t, c in zip(versions[-1], before[1])]
    for r, target, d in zip(receiver, versions[-1], diff):
        bound = error_bound(d, scheme, block_size=64).to(torch.float64) + 1e-6
        assert bool(((r - target.to(torch.float64)).abs() <= bound).all())
    # ... which is far below what 29 independent roundings would allow.
    single = max(float(error_bound(d, scheme, block_size=64).max()) for d in diff)
    worst = max(float((r - t.to(torch.float64)).abs().max()) for r, t in zip(receiver, versions[-1]))
    assert worst <= single + 1e-6


def test_int8_differences_beat_int8_weights_by_the_weight_to_step_ratio():
    # Weights ~0.02, one version to the next ~0.001: a difference's blocks are ~20x smaller, so at the
    # same bytes its rounding error is ~20x smaller (and not summed over sends).
    versions = _versions(20, SHAPES, seed=1)
    delta = DownlinkCopies("int8", "int8", block_size=256)
    whole = DownlinkCopies("int8", None, block_size=256)
    d_bytes = w_bytes = 0
    for v, target in enumerate(versions):
        d_bytes += delta.encode(0, 1, 0, v, target).nbytes
        w_bytes += whole.encode(0, 1, 0, v, target).nbytes
    final = versions[-1]
    got_delta = delta.copy_of(0, 0)[1]
    got_whole = decode_fragment(whole.encode(0, 1, 0, 99, final).payload)
    err_delta = max(float((g - t).abs().max()) for g, t in zip(got_delta, final))
    err_whole = max(float((g - t).abs().max()) for g, t in zip(got_whole, final))
    assert d_bytes == w_bytes  # same format, same shapes: the same bytes
    assert err_delta < err_whole / 8, (err_delta, err_whole)


def test_int4_differences_cost_about_half_the_bytes_of_int8_weights():
    versions = _versions(5, SHAPES, seed=2)
    delta = DownlinkCopies("int8", "int4", block_size=256)
    whole = DownlinkCopies("int8", None, block_size=256)
    d = [delta.encode(0, 1, 0, v, t).nbytes for v, t in enumerate(versions)]
    w = [whole.encode(0, 1, 0, v, t).nbytes for v, t in enumerate(versions)]
    assert d[0] == w[0]  # the first send is whole, in the full format
    n = sum(math.prod(s) for s in SHAPES)
    assert all(x < 0.55 * w[0] for x in d[1:]) and d[1] >= math.ceil(n / 2), (d, w)


def test_wire_bytes_are_the_payload_and_scales():
    copies = DownlinkCopies("bf16", "int4", block_size=64)
    v0, v1 = _versions(2, [(100,)])
    first = copies.encode(0, 1, 0, 0, v0)
    assert first.nbytes == 100 * 2  # bf16 whole, no scales
    second = copies.encode(0, 1, 0, 1, v1)
    assert second.nbytes == math.ceil(100 / 2) + math.ceil(100 / 64) * 4


def test_a_new_incarnation_or_forget_starts_whole_again():
    copies = DownlinkCopies("none", "int8")
    v = _versions(4, [(10,)])
    assert copies.encode(1, 1, 0, 0, v[0]).delta_from is None
    assert copies.encode(1, 1, 0, 1, v[1]).delta_from == 0
    assert copies.encode(1, 1, 1, 1, v[1]).delta_from is None  # another fragment: its own first send
    assert copies.encode(1, 2, 0, 2, v[2]).delta_from is None  # the island restarted
    copies.forget(1)
    assert copies.copy_of(1, 0) is None
    assert copies.encode(1, 2, 0, 3, v[3]).delta_from is None


def test_a_seeded_copy_makes_the_first_send_a_difference_from_what_the_island_holds():
    # An island that started from version 2 (decoded from an int8 whole, as latest() hands it out) and says so
    # at registration: the sender seeds its copy with that decoded whole, and version 3 goes as a difference.
    copies = DownlinkCopies("int8", "int4", block_size=64)
    v = _versions(5, SHAPES)
    held = decode_fragment(copies.whole(v[2]))
    assert copies.seed(island=0, incarnation=1, fragment=0, version=2, tensors=held)
    enc = copies.encode(0, 1, 0, 3, v[3])
    assert enc.delta_from == 2
    receiver = apply_delta([t.to(torch.float64) for t in held], [d.to(torch.float64) for d in decode_fragment(enc.payload)])
    for r, target, before in zip(receiver, v[3], held):
        bound = error_bound(target - before, "int4", block_size=64).to(torch.float64) + 1e-6
        assert bool(((r - target.to(torch.float64)).abs() <= bound).all())
    assert enc.nbytes < copies.encode(1, 1, 0, 3, v[3]).nbytes / 1.8  # island 1 (not seeded) gets the int8 whole


def test_seed_never_replaces_a_copy_and_needs_a_delta_format():
    copies = DownlinkCopies("none", "int8")
    v = _versions(3, [(10,)])
    copies.encode(0, 1, 0, 0, v[0])
    assert not copies.seed(0, 1, 0, 1, v[1])  # the sender already tracks what it sent
    assert copies.copy_of(0, 0)[0] == 0
    assert copies.seed(0, 2, 0, 1, v[1]) and copies.copy_of(0, 0)[0] == 1  # a new incarnation starts afresh
    assert not DownlinkCopies("none", None).seed(0, 1, 0, 0, v[0])


def test_no_delta_format_sends_every_version_whole_and_keeps_nothing():
    copies = DownlinkCopies("int8", None)
    v = _versions(2, [(10,)])
    for i, t in enumerate(v):
        enc = copies.encode(0, 1, 0, i, t)
        assert enc.delta_from is None and enc.payload[0].scheme == "int8"
    assert copies.copy_of(0, 0) is None


def test_a_version_the_island_holds_goes_as_bookkeeping_only_and_changes_nothing():
    # A refused island is resent the current version, which it may already hold.
    copies = DownlinkCopies("none", "int8")
    v = _versions(3, [(10,)])
    copies.encode(0, 1, 0, 0, v[0])
    copies.encode(0, 1, 0, 2, v[2])
    before = copies.copy_of(0, 0)[1][0].clone()
    for older in (2, 1):
        enc = copies.encode(0, 1, 0, older, v[older])
        assert enc.payload == [] and enc.nbytes == 0 and enc.delta_from == 2
    assert copies.copy_of(0, 0)[0] == 2 and torch.equal(copies.copy_of(0, 0)[1][0], before)


@pytest.mark.parametrize("full, delta, block_size, match", [
    ("int2", None, 256, "downlink format"),
    ("none", "none", 256, "downlink_delta"),  # a float32 difference costs as much as the whole fragment
    ("none", "int8", 0, "block_size"),
])
def test_bad_formats_fail_in_one_line(full, delta, block_size, match):
    with pytest.raises(ValueError, match=match) as err:
        DownlinkCopies(full, delta, block_size=block_size)
    assert "\n" not in str(err.value)


def test_apply_delta_checks_shapes_and_leaves_inputs_alone():
    copy = [torch.zeros(3)]
    out = apply_delta(copy, [torch.ones(3)])
    assert torch.equal(out[0], torch.ones(3)) and torch.equal(copy[0], torch.zeros(3))
    with pytest.raises(ValueError, match="shape"):
        apply_delta(copy, [torch.ones(4)])
    with pytest.raises(ValueError, match="tensors"):
        apply_delta(copy, [])


def test_decoded_difference_matches_compression_round_trip():
    copies = DownlinkCopies("none", "int4", block_size=8)
    v0, v1 = _versions(2, [(40,)])
    copies.encode(0, 1, 0, 0, v0)
    enc = copies.encode(0, 1, 0, 1, v1)
    expected = decompress(compress(v1[0] - v0[0], "int4", block_size=8))
    assert torch.equal(decode_fragment(enc.payload)[0], expected)
