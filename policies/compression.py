"""Outer gradients on the wire: lossless, bfloat16, blockwise int8/int4/int2/sign quantization, or top-k.

Int schemes quantize each block of ``block_size`` consecutive elements of the flattened tensor
with its own float32 scale ``absmax / qmax`` (``qmax`` 127 for int8, 7 for int4), so one outlier
only costs precision in its own block. The payload carries exactly the quantized values (no
padding): ``numel`` int8 values, or ``ceil(numel / 2)`` bytes holding two 4-bit values each.

Below four bits an absmax scale wastes the few levels there are (most of a Gaussian block would
round to zero), so the two smallest formats scale by the block's spread instead and clip what lies
beyond it; what they lose is meant to come back through error feedback (``FEEDBACK_SCHEMES``):

- ``int2``: four levels ``(c - 1.5) * step``, c in 0..3, with ``step`` the block's root mean square:
  the uniform 2-bit quantizer of least mean squared error for a Gaussian block (Max, "Quantizing
  for minimum distortion", IRE Trans. Inf. Theory 6(1), 1960: step 0.996 sigma, error 0.119
  sigma^2, 88% of the block's energy kept). Four values a byte, ``ceil(numel / 4)`` bytes.
- ``sign``: one bit, ``+scale`` or ``-scale`` with ``scale`` the block's mean magnitude (the scale
  of least squared error for a sign code; 64% of a Gaussian block's energy kept), as 1-bit SGD and
  EF-SignSGD send (Seide et al. 2014; Karimireddy et al. 2019). Eight a byte, ``ceil(numel / 8)``.

An all-zero block gets scale 0 and decodes to exact zeros under both.

``topk`` keeps, in every chunk of ``TOPK_CHUNK`` consecutive elements (or the whole tensor when it is
smaller), the ``keep`` largest magnitudes, ``keep = ceil(density * chunk)``, quantized to int4 against
the chunk's float32 scale ``absmax(kept) / 7``. Each kept entry is two bytes: its 12-bit index in the
chunk and its 4-bit value (the chunk size is 4096 so that an index fits 12 bits). Everything else
decodes to zero, so top-k is only usable with error feedback: the sender keeps what it did not send
and adds it to its next message (``policies/error_feedback.py`` for outer gradients; the downlink's
differences from each island's copy have it built in). Sparse aggregation with error feedback in
DiLoCo-style training: Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (2025,
arXiv:2508.15706), which reports 1-3% densities at no loss in quality on their models.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from policies.compressor import Compressed, Compressor, compressor_registry

__all__ = ["SCHEMES", "DENSE_SCHEMES", "FEEDBACK_SCHEMES", "WIRE_DTYPES", "TOPK_CHUNK", "DEFAULT_DENSITY", "Compressed",
           "Compressor", "compress", "decompress", "compressor", "error_bound", "topk_keep", "check_density",
           "FUSED_SCHEMES", "finite_without_decoding", "decode_into"]

# Elements per top-k chunk: an index within it fits the 12 bits next to a 4-bit value in two bytes.
TOPK_CHUNK = 4096
DEFAULT_DENSITY = 1 / 64

_QMAX = {"int8": 127, "int4": 7}
# int4 values q in [-7, 7] are stored as q + 8 in one nibble.
_INT4_OFFSET = 8


def compressor(scheme: str) -> Compressor:
    """The registered compressor `scheme` (a built-in's name, or the import path a user's was loaded under)."""
    return compressor_registry().get(scheme)


def _check(scheme: str, block_size: int) -> Compressor:
    """The compressor of `scheme`, after checking `block_size`."""
    comp = compressor(scheme)
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}; use e.g. 256")
    return comp


def check_density(density: float) -> None:
    """Raise a one-line ValueError unless ``density`` (the fraction of a chunk top-k keeps) is in (0, 1]."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"top-k density must be in (0, 1], got {density}; use e.g. {DEFAULT_DENSITY:.4f} (1/64)")


def topk_keep(numel: int, density: float) -> tuple[int, int]:
    """(chunk, keep) of a ``numel``-element tensor under ``topk``: chunks of ``TOPK_CHUNK`` elements (the
    whole tensor when smaller), ``keep = ceil(density * chunk)`` entries of each (at least one)."""
    check_density(density)
    chunk = max(1, min(TOPK_CHUNK, numel))
    return chunk, max(1, min(chunk, math.ceil(density * chunk - 1e-9)))


def _blocks(t: Tensor, block_size: int) -> Tensor:
    """Flattened float32 ``t`` zero-padded to whole blocks: shape (num_blocks, block_size)."""
    flat = t.detach().reshape(-1).to(torch.float32)
    num_blocks = math.ceil(flat.numel() / block_size)
    pad = num_blocks * block_size - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(num_blocks, block_size)


def _absmax_scales(blocks: Tensor, qmax: int) -> Tensor:
    """``absmax / qmax`` per block, shape (num_blocks,); 0 for all-zero blocks."""
    if blocks.numel() == 0:
        return blocks.new_zeros(blocks.shape[0])
    return blocks.abs().amax(dim=1) / qmax


def compress(t: Tensor, scheme: str, *, block_size: int = 256, density: float = DEFAULT_DENSITY) -> Compressed:
    """Compress ``t`` with the compressor registered as ``scheme``; the wire tensor carries that name.

    The built-ins:

    - none: float32 contiguous copy.
    - bf16: ``t.to(bfloat16)``.
    - int8 / int4: per block ``b``, ``scale_b = absmax_b / qmax`` (1 for an all-zero block, so
      its values quantize to exact zeros) and ``q = clamp(round(x / scale_b), -qmax, qmax)``.
    - int2: ``step_b = rms_b``, code ``c = clamp(floor(x / step_b) + 2, 0, 3)``, decoded
      ``(c - 1.5) * step_b``; sign: ``scale_b = mean_b |x|``, bit ``x >= 0``, decoded ``+-scale_b``
      (module docstring; lossy by design, meant for error feedback).
    - topk: per chunk (``topk_keep``; ``block_size`` is not used), the ``keep`` largest magnitudes,
      int4-quantized against ``absmax(kept) / 7``; the rest is dropped (see the module docstring).

    Raises:
        ValueError: on an unknown scheme, ``block_size <= 0``, a density outside (0, 1], or a
            non-finite value under an int or topk scheme (its scale would be meaningless).
    """
    c = _check(scheme, block_size).encode(t, block_size=block_size, density=density)
    return c if c.scheme == scheme else replace(c, scheme=scheme)


class _Lossless(Compressor):
    """``none``: the float32 values themselves."""

    wire_dtype = torch.float32
    dense = True

    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """A float32 contiguous copy."""
        return Compressed("none", tuple(t.shape), t.detach().to(torch.float32).contiguous().clone(), None, block_size)

    def decode(self, c: Compressed) -> Tensor:
        """The payload viewed in its shape (no copy: the merge reads it where it lies)."""
        return c.payload.to(torch.float32).reshape(c.shape)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """0."""
        return torch.zeros_like(t.detach().to(torch.float32))


class _Bf16(Compressor):
    """``bf16``: each value rounded to bfloat16."""

    wire_dtype = torch.bfloat16
    dense = True

    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """``t.to(bfloat16)``."""
        return Compressed("bf16", tuple(t.shape), t.detach().to(torch.bfloat16).contiguous().clone(), None, block_size)

    def decode(self, c: Compressed) -> Tensor:
        """The payload as float32 (exact)."""
        return c.payload.to(torch.float32).reshape(c.shape)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """``|x| * 2**-8`` (8 significant bits, round to nearest; normal range)."""
        return t.detach().to(torch.float32).abs() * 2.0**-8


class _AbsmaxInt(Compressor):
    """``int8`` / ``int4``: blockwise absmax scales, levels ``-qmax..qmax``; decodes in place (module docstring)."""

    dense = True
    blocked = True
    decodes_in_place = True

    def __init__(self, scheme: str) -> None:
        self.scheme, self.qmax = scheme, _QMAX[scheme]
        self.wire_dtype = torch.int8 if scheme == "int8" else torch.uint8

    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """``q = clamp(round(x / scale_b), -qmax, qmax)``, ``scale_b = absmax_b / qmax`` (1 for an all-zero block)."""
        scheme, qmax, shape = self.scheme, self.qmax, tuple(t.shape)
        n = t.numel()
        blocks = _blocks(t, block_size)  # (num_blocks, block_size)
        scales = _absmax_scales(blocks, qmax)  # (num_blocks,)
        if not bool(torch.isfinite(scales).all()):
            raise _non_finite(scheme, shape)
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        q = torch.round(blocks / scales[:, None]).clamp_(-qmax, qmax).reshape(-1)[:n]
        if scheme == "int8":
            # clone() so the pickled storage holds exactly n values, not the padded blocks.
            payload = q.to(torch.int8).clone()
        else:
            nibbles = (q + _INT4_OFFSET).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, nibbles.new_full((1,), _INT4_OFFSET)])
            payload = (nibbles[0::2] | (nibbles[1::2] << 4)).contiguous()  # (ceil(n/2),)
        return Compressed(scheme, shape, payload, scales.contiguous(), block_size)

    def decode(self, c: Compressed) -> Tensor:
        """``q * scale_b``."""
        assert c.scales is not None, "int schemes always carry scales"
        if self.scheme == "int8":
            q = c.payload.to(torch.float32)
        else:
            low = (c.payload & 0x0F).to(torch.float32)
            high = (c.payload >> 4).to(torch.float32)
            q = torch.stack([low, high], dim=1).reshape(-1)[: c.numel] - _INT4_OFFSET
        return _scaled(q, c)

    def decode_into(self, c: Compressed, out: Tensor) -> Tensor:
        """:func:`decode_into`'s arithmetic for this format."""
        return _decode_int_into(c, out)

    def finite_without_decoding(self, c: Compressed) -> bool:
        """:func:`finite_without_decoding` for this format."""
        return _int_finite(c)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """``scale_b / 2 + (|x| + scale_b) * 2**-21``: half a level, plus float32 rounding of ``x / scale``
        and ``q * scale`` (0 for all-zero blocks, which are exact)."""
        x, n = t.detach().to(torch.float32), t.numel()
        scales = _absmax_scales(_blocks(t, block_size), self.qmax)  # (num_blocks,)
        per_elem = scales.repeat_interleave(block_size)[:n].reshape(x.shape)
        return per_elem / 2 + (x.abs() + per_elem) * 2.0**-21


# Bits per element of the spread-scaled formats.
_LOW_BITS = {"int2": 2, "sign": 1}


def _spread_scales(blocks: Tensor, n: int, scheme: str) -> Tensor:
    """int2's step (root mean square) or sign's scale (mean magnitude) of each block of ``n`` real
    elements: the last block's zero padding is not counted, so it does not shrink that block's scale."""
    counts = torch.full((blocks.shape[0],), float(blocks.shape[1]))
    if blocks.shape[0] and n % blocks.shape[1]:
        counts[-1] = n % blocks.shape[1]
    # Relative to the block's absmax, so squares (or sums) of values near float32's limit do not overflow.
    absmax = blocks.abs().amax(dim=1)
    rel = blocks / torch.where(absmax == 0, torch.ones_like(absmax), absmax)[:, None]
    if scheme == "int2":
        return absmax * (rel.pow(2).sum(dim=1) / counts).sqrt()
    return absmax * rel.abs().sum(dim=1) / counts


def _compress_low_bits(t: Tensor, scheme: str, block_size: int) -> Compressed:
    shape = tuple(t.shape)
    n = t.numel()
    bits = _LOW_BITS[scheme]
    blocks = _blocks(t, block_size)
    scales = _spread_scales(blocks, n, scheme)
    if not bool(torch.isfinite(scales).all()):  # an inf or NaN element makes its block's scale NaN
        raise _non_finite(scheme, shape)
    if scheme == "int2":
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        codes = (torch.floor(blocks / safe[:, None]) + 2).clamp_(0, 3)
    else:
        codes = (blocks >= 0).to(torch.float32)
    codes = codes.reshape(-1)[:n].to(torch.uint8)
    per_byte = 8 // bits
    pad = -n % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    codes = codes.view(-1, per_byte)
    payload = torch.zeros(codes.shape[0], dtype=torch.uint8)
    for i in range(per_byte):
        payload |= codes[:, i] << (bits * i)
    return Compressed(scheme, shape, payload.contiguous(), scales.contiguous(), block_size)


def _decompress_low_bits(c: Compressed) -> Tensor:
    assert c.scales is not None, "int2 and sign always carry scales"
    n, bits = c.numel, _LOW_BITS[c.scheme]
    per_byte = 8 // bits
    num_blocks = math.ceil(n / c.block_size) if n else 0
    if c.payload.numel() != math.ceil(n / per_byte) or c.scales.numel() != num_blocks:
        raise ValueError(f"malformed {c.scheme} payload: {c.payload.numel()} bytes and {c.scales.numel()} scales "
                         f"for {n} elements in blocks of {c.block_size}")
    mask = (1 << bits) - 1
    codes = torch.stack([(c.payload >> (bits * i)) & mask for i in range(per_byte)], dim=1).reshape(-1)[:n]
    levels = codes.to(torch.float32) - 1.5 if c.scheme == "int2" else codes.to(torch.float32) * 2 - 1
    return _scaled(levels, c)


def _non_finite(scheme: str, shape: tuple[int, ...]) -> ValueError:
    return ValueError(f"cannot {scheme}-quantize a tensor with inf or NaN values (shape {shape}); "
                      "fix the outer gradient upstream or use scheme='none'")


def _compress_topk(t: Tensor, density: float) -> Compressed:
    shape = tuple(t.shape)
    chunk, keep = topk_keep(t.numel(), density)
    chunks = _blocks(t, chunk)  # (num_chunks, chunk), zero-padded: a padded zero kept is decoded and cut off
    idx = chunks.abs().topk(keep, dim=1, sorted=False).indices  # (num_chunks, keep)
    kept = chunks.gather(1, idx)
    scales = _absmax_scales(kept, 7)
    if not bool(torch.isfinite(scales).all()):
        raise _non_finite("topk", shape)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    nib = torch.round(kept / scales[:, None]).clamp_(-7, 7).to(torch.int32) + _INT4_OFFSET
    idx = idx.to(torch.int32)
    # Two bytes per entry: the index's low 8 bits, then its high 4 bits under the value's nibble.
    packed = torch.stack([idx & 0xFF, (idx >> 8) | (nib << 4)], dim=-1).to(torch.uint8).reshape(-1)
    return Compressed("topk", shape, packed.contiguous(), scales.contiguous(), chunk, keep)


def _decompress_topk(c: Compressed) -> Tensor:
    assert c.scales is not None, "topk always carries scales"
    n, chunk, keep = c.numel, c.block_size, c.keep
    num_chunks = math.ceil(n / chunk) if n else 0
    if not 1 <= keep <= chunk or chunk > TOPK_CHUNK or c.scales.numel() != num_chunks or c.payload.numel() != 2 * num_chunks * keep:
        raise ValueError(f"malformed topk payload: {c.payload.numel()} bytes and {c.scales.numel()} scales for "
                         f"{n} elements in chunks of {chunk} keeping {keep}")
    pairs = c.payload.view(num_chunks, keep, 2).to(torch.int64)
    idx = pairs[..., 0] | ((pairs[..., 1] & 0x0F) << 8)
    if num_chunks and int(idx.max()) >= chunk:
        raise ValueError(f"malformed topk payload: an index {int(idx.max())} outside its chunk of {chunk}")
    q = (pairs[..., 1] >> 4).to(torch.float32) - _INT4_OFFSET
    out = torch.zeros(num_chunks, chunk, dtype=torch.float32)
    out.scatter_(1, idx, q * c.scales[:, None].to(torch.float32))
    return out.reshape(-1)[:n].reshape(c.shape).contiguous()


def decompress(c: Compressed) -> Tensor:
    """The float32 tensor of shape ``c.shape`` that ``c`` encodes, by the compressor its scheme names
    (``q * scale_b`` for int schemes; zeros but at the kept entries for topk).

    Raises:
        ValueError: on an unknown scheme, or a payload whose sizes or indices do not fit its shape (malformed).
    """
    return _check(c.scheme, c.block_size).decode(c)


def _scaled(levels: Tensor, c: Compressed) -> Tensor:
    """``c``'s tensor from its ``numel`` decoded levels (float32, flat): each times its block's scale."""
    assert c.scales is not None, "only scaled schemes reach here"
    num_blocks = c.scales.numel()
    pad = num_blocks * c.block_size - c.numel
    if pad:
        levels = torch.cat([levels, levels.new_zeros(pad)])
    out = levels.view(num_blocks, c.block_size) * c.scales[:, None].to(torch.float32)
    return out.reshape(-1)[: c.numel].reshape(c.shape).contiguous()


# Largest level magnitude a well-formed int8 or int4 payload can decode to (int8 -128; an int4 nibble 0 is -8).
_MAX_LEVEL = 128.0
# A scale below this cannot overflow float32 at any level: 128 * 1e36 < 3.4e38.
_SAFE_SCALE = 1e36


def _fused_sizes_ok(c: Compressed) -> bool:
    """Whether an int8 or int4 `c` holds exactly the payload bytes and float32 scales its shape needs."""
    if c.scheme not in _QMAX or c.scales is None or c.scales.dtype != torch.float32 or c.block_size <= 0:
        return False
    n = c.numel
    payload = n if c.scheme == "int8" else math.ceil(n / 2)
    return c.payload.numel() == payload and c.scales.dim() == 1 and c.scales.numel() == math.ceil(n / c.block_size)


def finite_without_decoding(c: Compressed) -> bool:
    """True when ``decompress(c)`` is sure to decode without error to finite values, known from its sizes and
    scales alone (no pass over the payload): its compressor vouches for it (int8 and int4 do, from their scales).
    False means only that decoding is needed to know."""
    registry = compressor_registry()
    return c.scheme in registry and registry.get(c.scheme).finite_without_decoding(c)


def decode_into(c: Compressed, out: Tensor) -> Tensor:
    """``decompress(c)`` for a format that decodes in place (int8, int4: ``FUSED_SCHEMES``), written into `out`
    (float32, contiguous, ``c.numel`` elements) and returned viewed as ``c.shape``: bitwise the same values,
    without allocating a float32 tensor.

    Raises:
        ValueError: when `c`'s format does not decode in place or `c` is malformed, or `out` does not fit it.
    """
    registry = compressor_registry()
    comp = registry.get(c.scheme) if c.scheme in registry else None
    if comp is None or not comp.decodes_in_place:
        raise ValueError(f"decode_into takes a well-formed {' or '.join(FUSED_SCHEMES)} tensor, got {c.scheme!r} "
                         f"with {c.payload.numel()} payload values; use decompress()")
    return comp.decode_into(c, out)


def _int_finite(c: Compressed) -> bool:
    """True when ``decompress(c)`` is sure to decode without error to finite values, known from its sizes and
    scales alone (no pass over the payload): an int8 or int4 tensor, well formed, every scale finite and small
    enough that no level times it overflows. False means only that decoding is needed to know."""
    if not _fused_sizes_ok(c):
        return False
    assert c.scales is not None, "checked by _fused_sizes_ok"
    if c.scales.numel() == 0:
        return True
    # max of a tensor holding NaN is NaN, and NaN < x is False: one reduction covers NaN, inf and overflow.
    return float(c.scales.abs().max()) < _SAFE_SCALE


def _decode_int_into(c: Compressed, out: Tensor) -> Tensor:
    """``decompress(c)`` for an int8 or int4 `c`, written into `out` (float32, contiguous, ``c.numel``
    elements) and returned viewed as ``c.shape``: bitwise the same values, without allocating a float32 tensor.

    Same arithmetic as :func:`decompress`: each level converted to float32 exactly (int4: nibble minus 8),
    then multiplied by its block's scale; the blocks are views, so nothing is padded.

    Raises:
        ValueError: when `c` is not a well-formed int8 or int4 tensor, or `out` does not fit it.
    """
    if not _fused_sizes_ok(c):
        raise ValueError(f"decode_into takes a well-formed {' or '.join(FUSED_SCHEMES)} tensor, got {c.scheme!r} "
                         f"with {c.payload.numel()} payload values; use decompress()")
    n = c.numel
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n:
        raise ValueError(f"decode_into needs a contiguous float32 buffer of {n} elements, got {out.dtype} "
                         f"with {out.numel()}; pass scratch[:numel]")
    assert c.scales is not None, "checked by _fused_sizes_ok"
    flat = out.view(-1)
    payload = c.payload.reshape(-1)
    if c.scheme == "int8":
        flat.copy_(payload)  # int8 -> float32, exact
    else:
        pairs = n // 2  # low nibble first, as decompress interleaves them; an odd n's last byte has only a low one
        if pairs:
            flat[: 2 * pairs].view(pairs, 2)[:, 0].copy_(payload[:pairs] & 0x0F)
            flat[: 2 * pairs].view(pairs, 2)[:, 1].copy_(payload[:pairs] >> 4)
        if n % 2:
            flat[n - 1:].copy_(payload[pairs:] & 0x0F)
        flat.sub_(_INT4_OFFSET)  # exact in float32, as decompress subtracts after converting
    full = n // c.block_size
    if full:
        flat[: full * c.block_size].view(full, c.block_size).mul_(c.scales[:full, None])
    if full * c.block_size < n:
        flat[full * c.block_size:].mul_(c.scales[full:full + 1])
    return out.view(c.shape)


def error_bound(t: Tensor, scheme: str, *, block_size: int = 256, density: float = DEFAULT_DENSITY) -> Tensor:
    """Per-element bound on ``|decompress(compress(t)) - t|``, float32, shape of ``t``.

    - none: 0.
    - bf16: ``|x| * 2**-8`` (8 significant bits, round to nearest; normal range).
    - int8 / int4: ``scale_b / 2 + (|x| + scale_b) * 2**-21`` with ``scale_b = absmax_b / qmax``;
      the second term covers float32 rounding of ``x / scale`` and ``q * scale`` (and 0 for
      all-zero blocks, which are exact).
    - int2: ``max(step_b / 2, |x| - 1.5 step_b)`` (beyond the outer levels the value is clipped)
      plus ``(|x| + step_b) * 2**-21``, ``step_b = rms_b``.
    - sign: ``| |x| - scale_b |`` (0 decodes to ``+scale_b``) plus ``(|x| + scale_b) * 2**-21``,
      ``scale_b = mean_b |x|``.
    - topk: per chunk, the larger of int4's bound for a kept entry (``scale_c = absmax_c / 7``: the
      kept entries include the chunk's absmax) and the ``keep``-th largest magnitude of the chunk,
      which no dropped entry exceeds.
    """
    return _check(scheme, block_size).error_bound(t, block_size=block_size, density=density)


class _SpreadScaled(Compressor):
    """``int2`` / ``sign``: blockwise spread scales, 2 bits or 1 an element; lossy, so owed by error feedback."""

    needs_feedback = True
    blocked = True

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme

    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """int2: codes ``clamp(floor(x / rms_b) + 2, 0, 3)``; sign: bits ``x >= 0`` (module docstring)."""
        return _compress_low_bits(t, self.scheme, block_size)

    def decode(self, c: Compressed) -> Tensor:
        """int2: ``(c - 1.5) * step_b``; sign: ``+-scale_b``."""
        return _decompress_low_bits(c)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """int2: ``max(step_b / 2, |x| - 1.5 step_b)`` (clipped beyond the outer levels); sign: ``| |x| - scale_b |``
        (0 decodes to ``+scale_b``); each plus ``(|x| + scale_b) * 2**-21``."""
        x, n = t.detach().to(torch.float32), t.numel()
        s = _spread_scales(_blocks(t, block_size), n, self.scheme).repeat_interleave(block_size)[:n].reshape(x.shape)
        rounding = (x.abs() + s) * 2.0**-21
        if self.scheme == "int2":
            return torch.maximum(s / 2, x.abs() - 1.5 * s) + rounding
        return (x.abs() - s).abs() + rounding


class _TopK(Compressor):
    """``topk``: each chunk's largest magnitudes at int4 with their indices; the rest owed by error feedback."""

    needs_feedback = True
    uses_density = True

    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """Per chunk (``topk_keep``; ``block_size`` is not used), the ``keep`` largest magnitudes, int4-quantized
        against ``absmax(kept) / 7``."""
        return _compress_topk(t, density)

    def decode(self, c: Compressed) -> Tensor:
        """Zeros but at the kept entries."""
        return _decompress_topk(c)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """Per chunk, the larger of int4's bound for a kept entry (``scale_c = absmax_c / 7``: the kept entries
        include the chunk's absmax) and the ``keep``-th largest magnitude, which no dropped entry exceeds."""
        x = t.detach().to(torch.float32)
        chunk, keep = topk_keep(t.numel(), density)
        mags = _blocks(t, chunk).abs()
        absmax = mags.amax(dim=1)
        scale = absmax / 7  # the kept entries include the chunk's absmax
        kth = mags.topk(keep, dim=1).values[:, -1]
        per_chunk = torch.maximum(scale / 2 + (absmax + scale) * 2.0**-21, kth)
        return per_chunk.repeat_interleave(chunk)[: t.numel()].reshape(x.shape)


# The built-ins, registered as a user's compressor is (policies/compressor.py).
for _name, _comp in (("none", _Lossless()), ("bf16", _Bf16()), ("int8", _AbsmaxInt("int8")), ("int4", _AbsmaxInt("int4")),
                     ("int2", _SpreadScaled("int2")), ("sign", _SpreadScaled("sign")), ("topk", _TopK())):
    compressor_registry().register(_name, _comp)

# The built-ins' names by what their plug-ins say of themselves (a user's registers later, under its import path).
SCHEMES = compressor_registry().names()
# Formats precise enough to carry whole weights (the downlink's full format): every element, >= 4 bits.
DENSE_SCHEMES = tuple(n for n in SCHEMES if compressor(n).dense)
# Formats that drop too much of each message to lose it: an island's uplink under them keeps what a
# submission did not carry and owes it to the next (policies/error_feedback.py); the downlink's
# differences have that built in. int8/int4 lose a percent or less of a block's energy and go without.
FEEDBACK_SCHEMES = tuple(n for n in SCHEMES if compressor(n).needs_feedback)
# Formats whose decode writes straight into a caller's float32 buffer (decode_into), and whose finiteness
# shows in their scales alone (finite_without_decoding): the outer optimizer's hot path.
FUSED_SCHEMES = tuple(n for n in SCHEMES if compressor(n).decodes_in_place)
# The payload dtype of each format, for receivers that check what arrives.
WIRE_DTYPES = {n: compressor(n).wire_dtype for n in SCHEMES}
