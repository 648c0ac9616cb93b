"""Compression: round trips within the documented bound, exact wire sizes, and pickling."""

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch

from policies.compression import SCHEMES, WIRE_DTYPES, Compressed, compress, decompress, error_bound


def _reference_int_roundtrip(x, qmax, block_size):
    """Independent numpy blockwise absmax quantize/dequantize (float64)."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    for start in range(0, flat.size, block_size):
        block = flat[start : start + block_size]
        scale = np.abs(block).max() / qmax
        out[start : start + block_size] = 0.0 if scale == 0 else np.clip(np.round(block / scale), -qmax, qmax) * scale
    return out.reshape(np.shape(x))


SHAPES = [(1,), (7,), (1001,), (3, 257), (2, 3, 5)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [1, 5, 256])
def test_round_trip_within_bound(scheme, shape, block_size):
    gen = torch.Generator().manual_seed(hash((scheme, shape, block_size)) % 2**31)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, math.prod(shape)).reshape(shape)
    c = compress(x, scheme, block_size=block_size)
    y = decompress(c)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert bool(((y - x).abs() <= error_bound(x, scheme, block_size=block_size)).all())


@pytest.mark.parametrize("scheme, qmax", [("int8", 127), ("int4", 7)])
def test_int_matches_numpy_reference(scheme, qmax):
    x = torch.randn(1003, generator=torch.Generator().manual_seed(7))
    y = decompress(compress(x, scheme, block_size=64))
    np.testing.assert_allclose(y.numpy(), _reference_int_roundtrip(x.numpy(), qmax, 64), rtol=1e-6, atol=1e-7)


def test_int4_hand_example():
    # block of 4, absmax 7 -> scale 1: values round to themselves; 2.4 -> 2, -3.6 -> -4
    x = torch.tensor([7.0, 2.4, -3.6, 0.0, 1.0])  # second block: absmax 1 -> scale 1/7, 1.0 -> 7
    c = compress(x, "int4", block_size=4)
    assert c.scales.tolist() == pytest.approx([1.0, 1 / 7])
    # q + 8 = [15, 10, 4, 8, 15] (+ pad 8), packed low nibble first
    assert c.payload.tolist() == [15 | 10 << 4, 4 | 8 << 4, 15 | 8 << 4]
    assert decompress(c).tolist() == pytest.approx([7.0, 2.0, -4.0, 0.0, 1.0])


def test_int8_hand_example():
    x = torch.tensor([[127.0, -63.4], [0.5, 1.0]])
    c = compress(x, "int8", block_size=4)
    assert c.scales.tolist() == [1.0]
    assert c.payload.dtype == torch.int8
    assert c.payload.tolist() == [127, -63, 0, 1]  # round half to even: 0.5 -> 0
    assert decompress(c).tolist() == [[127.0, -63.0], [0.0, 1.0]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zeros_are_exact(scheme):
    x = torch.zeros(3, 5)
    c = compress(x, scheme, block_size=4)
    assert torch.equal(decompress(c), x)
    assert torch.equal(error_bound(x, scheme, block_size=4), x)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_single_element_and_large_values(scheme):
    for value in (3.0, -1e30, 1e-30):
        x = torch.tensor([value])
        y = decompress(compress(x, scheme))
        assert bool(((y - x).abs() <= error_bound(x, scheme)).all()), (scheme, value)
    if scheme in ("int8", "int4"):
        # A lone element is its own absmax: it comes back exactly (up to float rounding).
        assert decompress(compress(torch.tensor([-1e30]), scheme)).item() == pytest.approx(-1e30, rel=1e-6)


def test_none_is_lossless_copy():
    x = torch.randn(4, 4)[:, ::2]  # non-contiguous
    c = compress(x, "none")
    assert c.payload.is_contiguous() and c.payload.dtype == torch.float32
    assert torch.equal(decompress(c), x)
    c.payload.add_(1.0)
    assert not torch.equal(decompress(c), x)  # the payload is a copy, x is untouched


@pytest.mark.parametrize(
    "scheme, numel, block_size, expected",
    [
        ("int4", 1000, 256, 500 + 4 * 4),
        ("int4", 1001, 256, 501 + 4 * 4),
        ("int8", 1000, 256, 1000 + 4 * 4),
        ("int8", 257, 256, 257 + 2 * 4),
        ("bf16", 1000, 256, 2000),
        ("none", 1000, 256, 4000),
        ("int4", 1, 256, 1 + 4),
        ("int2", 1000, 256, 250 + 4 * 4),
        ("int2", 1001, 256, 251 + 4 * 4),
        ("sign", 1000, 256, 125 + 4 * 4),
        ("sign", 1001, 256, 126 + 4 * 4),
        ("sign", 7, 256, 1 + 4),
    ],
)
def test_nbytes_exact(scheme, numel, block_size, expected):
    c = compress(torch.randn(numel), scheme, block_size=block_size)
    assert c.nbytes == expected


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pickle_round_trip_without_padding(scheme):
    x = torch.randn(3, 333)
    c = compress(x, scheme, block_size=256)
    c2 = pickle.loads(pickle.dumps(c))
    assert isinstance(c2, Compressed) and c2.shape == (3, 333) and c2.nbytes == c.nbytes
    assert torch.equal(decompress(c2), decompress(c))
    # The pickled storage is exactly the payload: no padded blocks travel.
    assert c2.payload.untyped_storage().nbytes() == c2.payload.numel() * c2.payload.element_size()


def test_wire_dtypes_name_every_format_as_compress_writes_it():
    # The outer optimizer refuses a submission whose payload dtype is not WIRE_DTYPES[scheme].
    assert set(WIRE_DTYPES) == set(SCHEMES)
    for scheme in SCHEMES:
        assert compress(torch.randn(300), scheme).payload.dtype == WIRE_DTYPES[scheme], scheme


def test_int_schemes_beat_bf16_on_wire_size():
    x = torch.randn(4096)
    sizes = {s: compress(x, s).nbytes for s in SCHEMES}
    assert sizes["sign"] < sizes["int2"] < sizes["int4"] < sizes["int8"] < sizes["bf16"] < sizes["none"]


def test_errors():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="unknown compression scheme 'fp8'"):
        compress(x, "fp8")
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        compress(x, "int8", block_size=0)
    with pytest.raises(ValueError, match="unknown compression scheme"):
        error_bound(x, "int3")
    with pytest.raises(ValueError, match="inf or NaN"):
        compress(torch.tensor([1.0, float("nan")]), "int8")
    with pytest.raises(ValueError, match="inf or NaN"):
        compress(torch.tensor([float("inf")]), "int4")


# ---------------------------------------------------------------- int2 and sign


def _reference_low_bits_roundtrip(x, scheme, block_size):
    """Independent numpy int2 (step = block rms, levels +-0.5 and +-1.5 steps) and sign (+-mean |x|) round
    trips, float64, one block at a time."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    out = np.empty_like(flat)
    for start in range(0, flat.size, block_size):
        block = flat[start : start + block_size]
        if scheme == "int2":
            step = np.sqrt(np.mean(block**2))
            levels = np.array([-1.5, -0.5, 0.5, 1.5]) * step
            # nearest level; a tie (x exactly 0 or +-step) goes up, as floor(x / step) does
            out[start : start + block_size] = [levels[np.searchsorted([-step, 0.0, step], v, side="right")] for v in block]
        else:
            scale = np.mean(np.abs(block))
            out[start : start + block_size] = np.where(block >= 0, scale, -scale)
    return out.reshape(np.shape(x))


@pytest.mark.parametrize("scheme", ["int2", "sign"])
@pytest.mark.parametrize("numel, block_size", [(1003, 64), (257, 256), (5, 2)])
def test_low_bits_match_numpy_reference(scheme, numel, block_size):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    y = decompress(compress(x, scheme, block_size=block_size))
    np.testing.assert_allclose(y.numpy(), _reference_low_bits_roundtrip(x.numpy(), scheme, block_size), rtol=1e-5, atol=1e-6)


def test_int2_hand_example():
    # one block of 4: rms = sqrt((4 + 0.25 + 1 + 36) / 4) = sqrt(10.3125); step s = 3.2113...
    x = torch.tensor([2.0, -0.5, 1.0, -6.0])
    c = compress(x, "int2", block_size=4)
    s = 10.3125**0.5
    assert c.scales.tolist() == pytest.approx([s])
    # codes floor(x / s) + 2 clamped to 0..3: 2 -> 2, -0.5 -> 1, 1 -> 2, -6 -> -1.87 -> 0; packed 2 bits each, lowest first
    assert c.payload.tolist() == [2 | 1 << 2 | 2 << 4 | 0 << 6]
    assert decompress(c).tolist() == pytest.approx([0.5 * s, -0.5 * s, 0.5 * s, -1.5 * s])


def test_sign_hand_example_and_the_last_block_counts_only_its_real_elements():
    # blocks of 3: [1, -2, 0] -> mean |x| 1; [-4] alone -> 4, not 4/3 (the padding does not count)
    x = torch.tensor([1.0, -2.0, 0.0, -4.0])
    c = compress(x, "sign", block_size=3)
    assert c.scales.tolist() == [1.0, 4.0]
    assert c.payload.tolist() == [0b0101]  # bits x >= 0, lowest first: 1, 0, 1, 0
    assert decompress(c).tolist() == [1.0, -1.0, 1.0, -4.0]


@pytest.mark.parametrize("scheme, kept", [("int4", None), ("int2", 0.8812), ("sign", 2 / math.pi)])
def test_share_of_a_gaussian_blocks_energy_kept(scheme, kept):
    # Independent references: Max (1960) tabulates the optimal uniform 2-bit quantizer of a unit Gaussian
    # (step 0.9957, mean squared error 0.1188); the best sign code keeps E|x|^2 / E x^2 = 2 / pi.
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(11))
    y = decompress(compress(x, scheme))
    share = 1 - float(((y - x) ** 2).sum() / (x**2).sum())
    if kept is None:
        assert share > 0.98  # int4 loses little: the reason it goes without error feedback
    else:
        assert share == pytest.approx(kept, abs=0.005)


@pytest.mark.parametrize("scheme", ["int2", "sign"])
def test_low_bits_reject_malformed_payloads(scheme):
    c = compress(torch.randn(100), scheme, block_size=32)
    with pytest.raises(ValueError, match=f"malformed {scheme} payload"):
        decompress(dataclasses.replace(c, payload=c.payload[:-1]))
    with pytest.raises(ValueError, match=f"malformed {scheme} payload"):
        decompress(dataclasses.replace(c, scales=c.scales[:-1]))
    with pytest.raises(ValueError, match="inf or NaN"):
        compress(torch.tensor([1.0, float("inf")]), scheme)


# ---------------------------------------------------------------- topk


def _reference_topk(x, density, chunk=4096):
    """Independent numpy top-k per chunk (float64): the kept positions and their int4 round trip."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    size = max(1, min(chunk, flat.size))
    keep = max(1, min(size, math.ceil(density * size - 1e-9)))
    out = np.zeros_like(flat)
    for start in range(0, flat.size, size):
        block = flat[start : start + size]
        pos = np.argsort(-np.abs(block), kind="stable")[:keep]
        scale = np.abs(block[pos]).max() / 7
        out[start + pos] = 0.0 if scale == 0 else np.clip(np.round(block[pos] / scale), -7, 7) * scale
    return out.reshape(np.shape(x))


@pytest.mark.parametrize("shape, density", [((10000,), 1 / 64), ((3, 5000), 0.03), ((100,), 1 / 64), ((7, 7), 0.5), ((4096,), 1.0)])
def test_topk_keeps_the_largest_magnitudes_of_each_chunk(shape, density):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(11))  # no ties: the kept set is unique
    y = decompress(compress(x, "topk", density=density))
    np.testing.assert_allclose(y.numpy(), _reference_topk(x.numpy(), density), rtol=1e-6, atol=1e-7)


def test_topk_hand_example():
    # One chunk of 4 keeping 2: -7 and 2.6 survive; scale 7/7 = 1, so 2.6 rounds to 3.
    c = compress(torch.tensor([0.1, -7.0, 2.6, 0.5]), "topk", density=0.5)
    assert (c.block_size, c.keep) == (4, 2) and c.payload.dtype == torch.uint8
    assert c.nbytes == 2 * 2 + 4  # two bytes an entry, one float32 scale
    assert decompress(c).tolist() == [0.0, -7.0, 3.0, 0.0]


@pytest.mark.parametrize("numel, density, expected", [
    (10000, 1 / 64, 2 * 3 * 64 + 3 * 4),  # chunks of 4096 (the last padded), 64 kept of each
    (4096, 1 / 64, 2 * 64 + 4),
    (100, 1 / 64, 2 * 2 + 4),  # a small tensor is one chunk: ceil(100 / 64) = 2 kept
    (1, 0.01, 2 + 4),
])
def test_topk_nbytes_exact(numel, density, expected):
    assert compress(torch.randn(numel), "topk", density=density).nbytes == expected


def test_topk_costs_about_two_bytes_per_kept_entry():
    x = torch.randn(64 * 4096)
    per_param = compress(x, "topk", density=1 / 64).nbytes / x.numel()
    assert per_param == pytest.approx(2 / 64 + 4 / 4096)
    assert per_param < compress(x, "int4").nbytes / x.numel() / 15  # int4: 0.516 bytes per parameter


def test_topk_rejects_bad_density_and_malformed_payloads():
    x = torch.randn(300)
    for density in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"top-k density must be in \(0, 1\]"):
            compress(x, "topk", density=density)
    with pytest.raises(ValueError, match="inf or NaN"):
        compress(torch.tensor([1.0, float("inf")]), "topk")
    c = compress(x, "topk", density=0.1)
    with pytest.raises(ValueError, match="malformed topk payload: 58 bytes"):
        decompress(dataclasses.replace(c, payload=c.payload[:-2]))
    bad = c.payload.clone()
    bad[1] = 0x0F  # high index bits of the first entry: index >= 3840, outside the chunk of 300
    with pytest.raises(ValueError, match="outside its chunk of 300"):
        decompress(dataclasses.replace(c, payload=bad))
