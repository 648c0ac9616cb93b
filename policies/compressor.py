"""Compressors as plug-ins: the wire tensor (:class:`Compressed`) and the interface of a wire format
(:class:`Compressor`), registered by name.

``outer.compression`` names a registered compressor: one of the built-ins (policies/compression.py registers
none, bf16, int8, int4, int2, sign and topk exactly as a user's is registered) or a user's by import path
``package.module:Name`` (islands/plugins.py resolves it and registers it under that path). The name a
compressor is registered under is the ``scheme`` its wire tensors carry, so whichever process receives one
decodes it with the same plug-in. docs/outer.md, Writing a compressor.

Pure (torch only).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.plugin_registry import Registry

__all__ = ["Compressed", "Compressor", "compressor_registry"]


@dataclass(frozen=True)
class Compressed:
    """One compressed tensor, as sent over the wire; plain fields so it pickles cleanly.

    Attributes:
        scheme: the name its compressor is registered under (``outer.compression``).
        shape: shape of the original tensor.
        payload: float32 (none), bfloat16 (bf16), int8 with ``numel`` values (int8) or uint8
            with ``ceil(numel / 2)`` packed bytes, low nibble first (int4), ``ceil(numel / 4)`` bytes
            of 2-bit codes, lowest bits first (int2), or ``ceil(numel / 8)`` bytes of sign bits, 1 for
            ``+scale``, lowest bit first (sign); topk's two bytes per kept entry; a plug-in's own.
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


class Compressor(ABC):
    """One wire format of outer gradients (and of the downlink): subclass it, define :meth:`encode` and
    :meth:`decode`, and set the attributes that describe it.

    Attributes (class attributes; the engine reads them instead of lists of names):

    - ``wire_dtype``: the payload's dtype; the outer optimizer refuses a submission whose payload has another.
      Its bytes on the wire are :attr:`Compressed.nbytes` (payload and scales).
    - ``needs_feedback``: it drops enough of each message that an island keeps what a submission did not carry
      and owes it to the next (policies/error_feedback.py; ``outer.feedback_decay``).
    - ``dense``: every element at 4 bits or more, precise enough to carry whole weights (``outer.downlink``).
    - ``blocked``: it uses ``outer.compression_block_size``; ``uses_density``: it uses ``outer.topk_density``.
    - ``decodes_in_place``: :meth:`decode_into` writes into the caller's buffer without a float32 temporary
      (the outer optimizer's merge decodes each island's tensor into one reused buffer).

    A compressor holds no state between calls and must be deterministic.
    """

    wire_dtype: torch.dtype = torch.uint8
    needs_feedback: bool = False
    dense: bool = False
    blocked: bool = False
    uses_density: bool = False
    decodes_in_place: bool = False

    @abstractmethod
    def encode(self, t: Tensor, *, block_size: int, density: float) -> Compressed:
        """The wire form of float `t` (its ``scheme`` is set by the engine to the registered name).

        Raises:
            ValueError: one line, for a value it cannot encode (inf or NaN where a scale would be meaningless).
        """

    @abstractmethod
    def decode(self, c: Compressed) -> Tensor:
        """The float32 tensor of shape ``c.shape`` that `c` encodes; a one-line ValueError if malformed."""

    def decode_into(self, c: Compressed, out: Tensor) -> Tensor:
        """``decode(c)`` written into `out` (contiguous float32, ``c.numel`` elements), returned viewed as
        ``c.shape``. This default decodes and copies; a format with ``decodes_in_place`` writes directly."""
        out.view(-1).copy_(self.decode(c).reshape(-1))
        return out.view(c.shape)

    def error_bound(self, t: Tensor, *, block_size: int, density: float) -> Tensor:
        """Per-element bound on ``|decode(encode(t)) - t|``, float32, shape of `t` (its tests check against it)."""
        raise NotImplementedError(f"{type(self).__name__} states no error bound; define error_bound()")

    def finite_without_decoding(self, c: Compressed) -> bool:
        """True when decoding `c` is sure to give finite values, known without a pass over the payload; False means
        only that decoding is needed to know (the default)."""
        return False


_COMPRESSORS: Registry[Compressor] = Registry("compression scheme", Compressor,
                                              "'package.module:Name' (a Compressor subclass)")


def compressor_registry() -> Registry[Compressor]:
    """The registry of compressors (policies/compression.py registers the built-ins; islands/plugins.py a user's)."""
    return _COMPRESSORS
