"""Outer gradients on the wire: lossless, bfloat16, blockwise int8/int4 quantization, or top-k.

Int schemes quantize each block of ``block_size`` consecutive elements of the flattened tensor
with its own float32 scale ``absmax / qmax`` (``qmax`` 127 for int8, 7 for int4), so one outlier
only costs precision in its own block. The payload carries exactly the quantized values (no
padding): ``numel`` int8 values, or ``ceil(numel / 2)`` bytes holding two 4-bit values each.

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
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SCHEMES", "DENSE_SCHEMES", "TOPK_CHUNK", "DEFAULT_DENSITY", "Compressed", "compress", "decompress",
           "error_bound", "topk_keep", "check_density"]

SCHEMES = ("none", "bf16", "int8", "int4", "topk")
# Formats that carry every element: the only ones that can carry whole weights (the downlink's full format).
DENSE_SCHEMES = ("none", "bf16", "int8", "int4")
# Elements per top-k chunk: an index within it fits the 12 bits next to a 4-bit value in two bytes.
TOPK_CHUNK = 4096
DEFAULT_DENSITY = 1 / 64

_QMAX = {"int8": 127, "int4": 7}
# int4 values q in [-7, 7] are stored as q + 8 in one nibble.
_INT4_OFFSET = 8


@dataclass(frozen=True)
class Compressed:
    """One compressed tensor, as sent over the wire; plain fields so it pickles cleanly.

    Attributes:
        scheme: one of ``SCHEMES``.
        shape: shape of the original tensor.
        payload: float32 (none), bfloat16 (bf16), int8 with ``numel`` values (int8) or uint8
            with ``ceil(numel / 2)`` packed bytes, low nibble first (int4).
        scales: float32 per-block scales, ``ceil(numel / block_size)`` of them, or ``None``.
        block_size: elements per quantization block (topk: per chunk).
        keep: topk only: entries kept per chunk (0 for the other schemes).
    """

    scheme: str
    shape: tuple[int, ...]
    payload: Tensor
    scales: Tensor | None
    block_size: int
    keep: int = 0

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: ``payload.numel() * payload.element_size()`` plus the scales'."""
        total = self.payload.numel() * self.payload.element_size()
        if self.scales is not None:
            total += self.scales.numel() * self.scales.element_size()
        return total


def _check(scheme: str, block_size: int) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown compression scheme {scheme!r}; use one of {SCHEMES}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}; use e.g. 256")


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
    """Compress ``t`` with ``scheme``.

    - none: float32 contiguous copy.
    - bf16: ``t.to(bfloat16)``.
    - int8 / int4: per block ``b``, ``scale_b = absmax_b / qmax`` (1 for an all-zero block, so
      its values quantize to exact zeros) and ``q = clamp(round(x / scale_b), -qmax, qmax)``.
    - topk: per chunk (``topk_keep``; ``block_size`` is not used), the ``keep`` largest magnitudes,
      int4-quantized against ``absmax(kept) / 7``; the rest is dropped (see the module docstring).

    Raises:
        ValueError: on an unknown scheme, ``block_size <= 0``, a density outside (0, 1], or a
            non-finite value under an int or topk scheme (its scale would be meaningless).
    """
    _check(scheme, block_size)
    shape = tuple(t.shape)
    if scheme == "topk":
        return _compress_topk(t, density)
    if scheme == "none":
        payload = t.detach().to(torch.float32).contiguous().clone()
        return Compressed(scheme, shape, payload, None, block_size)
    if scheme == "bf16":
        payload = t.detach().to(torch.bfloat16).contiguous().clone()
        return Compressed(scheme, shape, payload, None, block_size)

    qmax = _QMAX[scheme]
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
    """The float32 tensor of shape ``c.shape`` that ``c`` encodes (``q * scale_b`` for int schemes; zeros
    but at the kept entries for topk).

    Raises:
        ValueError: on a topk payload whose sizes or indices do not fit its shape (malformed).
    """
    _check(c.scheme, c.block_size)
    if c.scheme == "topk":
        return _decompress_topk(c)
    if c.scheme in ("none", "bf16"):
        return c.payload.to(torch.float32).reshape(c.shape)
    assert c.scales is not None, "int schemes always carry scales"
    n = c.numel
    if c.scheme == "int8":
        q = c.payload.to(torch.float32)
    else:
        low = (c.payload & 0x0F).to(torch.float32)
        high = (c.payload >> 4).to(torch.float32)
        q = torch.stack([low, high], dim=1).reshape(-1)[:n] - _INT4_OFFSET
    num_blocks = c.scales.numel()
    pad = num_blocks * c.block_size - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad)])
    out = q.view(num_blocks, c.block_size) * c.scales[:, None].to(torch.float32)
    return out.reshape(-1)[:n].reshape(c.shape).contiguous()


def error_bound(t: Tensor, scheme: str, *, block_size: int = 256, density: float = DEFAULT_DENSITY) -> Tensor:
    """Per-element bound on ``|decompress(compress(t)) - t|``, float32, shape of ``t``.

    - none: 0.
    - bf16: ``|x| * 2**-8`` (8 significant bits, round to nearest; normal range).
    - int8 / int4: ``scale_b / 2 + (|x| + scale_b) * 2**-21`` with ``scale_b = absmax_b / qmax``;
      the second term covers float32 rounding of ``x / scale`` and ``q * scale`` (and 0 for
      all-zero blocks, which are exact).
    - topk: per chunk, the larger of int4's bound for a kept entry (``scale_c = absmax_c / 7``: the
      kept entries include the chunk's absmax) and the ``keep``-th largest magnitude of the chunk,
      which no dropped entry exceeds.
    """
    _check(scheme, block_size)
    x = t.detach().to(torch.float32)
    if scheme == "topk":
        chunk, keep = topk_keep(t.numel(), density)
        mags = _blocks(t, chunk).abs()
        absmax = mags.amax(dim=1)
        scale = absmax / 7  # the kept entries include the chunk's absmax
        kth = mags.topk(keep, dim=1).values[:, -1]
        per_chunk = torch.maximum(scale / 2 + (absmax + scale) * 2.0**-21, kth)
        return per_chunk.repeat_interleave(chunk)[: t.numel()].reshape(x.shape)
    if scheme == "none":
        return torch.zeros_like(x)
    if scheme == "bf16":
        return x.abs() * 2.0**-8
    n = t.numel()
    scales = _absmax_scales(_blocks(t, block_size), _QMAX[scheme])  # (num_blocks,)
    per_elem = scales.repeat_interleave(block_size)[:n].reshape(x.shape)
    return per_elem / 2 + (x.abs() + per_elem) * 2.0**-21
