"""Outer gradients on the wire: lossless, bfloat16, or blockwise int8/int4 quantization.

Int schemes quantize each block of ``block_size`` consecutive elements of the flattened tensor
with its own float32 scale ``absmax / qmax`` (``qmax`` 127 for int8, 7 for int4), so one outlier
only costs precision in its own block. The payload carries exactly the quantized values (no
padding): ``numel`` int8 values, or ``ceil(numel / 2)`` bytes holding two 4-bit values each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SCHEMES", "Compressed", "compress", "decompress", "error_bound"]

SCHEMES = ("none", "bf16", "int8", "int4")

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
        block_size: elements per quantization block.
    """

    scheme: str
    shape: tuple[int, ...]
    payload: Tensor
    scales: Tensor | None
    block_size: int

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


def compress(t: Tensor, scheme: str, *, block_size: int = 256) -> Compressed:
    """Compress ``t`` with ``scheme``.

    - none: float32 contiguous copy.
    - bf16: ``t.to(bfloat16)``.
    - int8 / int4: per block ``b``, ``scale_b = absmax_b / qmax`` (1 for an all-zero block, so
      its values quantize to exact zeros) and ``q = clamp(round(x / scale_b), -qmax, qmax)``.

    Raises:
        ValueError: on an unknown scheme, ``block_size <= 0``, or a non-finite value under an
            int scheme (its block scale would be meaningless).
    """
    _check(scheme, block_size)
    shape = tuple(t.shape)
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
        raise ValueError(
            f"cannot {scheme}-quantize a tensor with inf or NaN values (shape {shape}); "
            "fix the outer gradient upstream or use scheme='none'"
        )
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


def decompress(c: Compressed) -> Tensor:
    """The float32 tensor of shape ``c.shape`` that ``c`` encodes (``q * scale_b`` for int schemes)."""
    _check(c.scheme, c.block_size)
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


def error_bound(t: Tensor, scheme: str, *, block_size: int = 256) -> Tensor:
    """Per-element bound on ``|decompress(compress(t)) - t|``, float32, shape of ``t``.

    - none: 0.
    - bf16: ``|x| * 2**-8`` (8 significant bits, round to nearest; normal range).
    - int8 / int4: ``scale_b / 2 + (|x| + scale_b) * 2**-21`` with ``scale_b = absmax_b / qmax``;
      the second term covers float32 rounding of ``x / scale`` and ``q * scale`` (and 0 for
      all-zero blocks, which are exact).
    """
    _check(scheme, block_size)
    x = t.detach().to(torch.float32)
    if scheme == "none":
        return torch.zeros_like(x)
    if scheme == "bf16":
        return x.abs() * 2.0**-8
    n = t.numel()
    scales = _absmax_scales(_blocks(t, block_size), _QMAX[scheme])  # (num_blocks,)
    per_elem = scales.repeat_interleave(block_size)[:n].reshape(x.shape)
    return per_elem / 2 + (x.abs() + per_elem) * 2.0**-21
