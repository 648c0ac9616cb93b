"""The downlink as differences: send each island a new fragment version as its change from the copy
that island already holds (``outer.downlink_delta``).

Published fragments are global *parameters*. Sent whole, a compressed format rounds the weights
themselves (int8 to about 1/254 of each block's largest weight; int4, 1/14, too coarse to train
from). Consecutive versions differ by one outer step. Where that step is r times smaller than the
weights, an int8 difference is about r times more precise than int8 weights at the same bytes, and an
int4 difference halves the bytes at 18/r times int8's rounding (the step's size relative to the
weights is a property of the run: measure before choosing).

The sender keeps, per island and fragment, exactly the tensors the island decoded last (its *copy*),
and encodes ``target - copy``. The island adds what it decodes to its copy. Because the next
difference is measured from what the island really holds, quantization error never accumulates: after
any number of sends the island is within one difference's quantization error of the newest version
(error feedback). The first send of a fragment to an island (incarnation) is whole, in the full
format (``outer.downlink``), since the sender does not know what the island started from.

A difference only makes sense on top of the copy it was computed from, so each carries
``delta_from``, the version of that copy. The sender must deliver one island's sends in order; the
actor shell awaits each island's adoption before it encodes the next.

Pure (torch only): the outer-optimizer actor holds one :class:`DownlinkCopies`; tests drive it
without Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from policies.compression import DEFAULT_DENSITY, DENSE_SCHEMES, Compressed, check_density, compress, compressor, decompress

__all__ = ["DELTA_SCHEMES", "Encoded", "DownlinkCopies", "decode_fragment", "apply_delta"]

# outer.downlink_delta's choices (a Literal in the config), each a registered compressor (policies/compression.py).
# A float32 difference would cost as much as the whole fragment: no reason to send one.
# int2 / sign: 2 bits or 1 an element, their rounding carried by the next difference like topk's remainder.
# topk: the largest few percent of each chunk of the difference; the rest stays in the next one's (error feedback).
DELTA_SCHEMES = ("bf16", "int8", "int4", "int2", "sign", "topk")


@dataclass(frozen=True)
class Encoded:
    """One fragment send: ``payload`` on the wire, ``delta_from`` None for a whole fragment."""

    payload: list  # Tensor (float32) or Compressed, one per tensor of the fragment
    delta_from: int | None  # version of the island's copy the difference is measured from
    nbytes: int  # bytes on the wire, payload and scales


def decode_fragment(payload: Sequence) -> list[Tensor]:
    """The float32 tensors a payload (float32 tensors or :class:`Compressed`) decodes to (float32
    tensors pass through uncopied)."""
    return [decompress(t) if isinstance(t, Compressed) else t.to(torch.float32) for t in payload]


def apply_delta(copy: Sequence[Tensor], delta: Sequence[Tensor]) -> list[Tensor]:
    """The receiver's new copy: ``copy + delta`` per tensor (new tensors; inputs untouched)."""
    if len(copy) != len(delta):
        raise ValueError(f"a downlink difference has {len(delta)} tensors but the copy it applies to has {len(copy)}")
    out = []
    for c, d in zip(copy, delta):
        if c.shape != d.shape:
            raise ValueError(f"a downlink difference of shape {tuple(d.shape)} cannot apply to a copy of shape {tuple(c.shape)}")
        out.append(c.to(torch.float32) + d.to(c.device, torch.float32))
    return out


def _is_dense(name: str) -> bool:
    """Whether `name` is a registered compressor precise enough to carry whole weights."""
    try:
        return compressor(name).dense
    except ValueError:
        return False


class DownlinkCopies:
    """What every island holds of every fragment, so that each send can be a difference.

    Args:
        full: format of a whole fragment (``outer.downlink``): a compressor that is ``dense`` (the built-ins:
            ``policies.compression.DENSE_SCHEMES``).
        delta: format of a difference (``outer.downlink_delta``): one of ``DELTA_SCHEMES``, or None
            to send every version whole (then nothing is kept).
        block_size: elements per quantization block, both formats.
        density: fraction of each chunk a ``topk`` difference keeps.

    Memory: one float32 copy of the model per island while ``delta`` is set.
    """

    def __init__(self, full: str = "none", delta: str | None = None, *, block_size: int = 256,
                 density: float = DEFAULT_DENSITY) -> None:
        if not _is_dense(full):
            raise ValueError(f"unknown downlink format {full!r} for whole fragments; use one of {DENSE_SCHEMES}")
        if delta is not None and delta not in DELTA_SCHEMES:
            raise ValueError(f"unknown downlink_delta format {delta!r}; use one of {DELTA_SCHEMES} or null (send whole fragments)")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}; use e.g. 256")
        check_density(density)
        self.full, self.delta, self.block_size, self.density = full, delta, block_size, density
        # island -> (incarnation, {fragment: (version, copy tensors)})
        self._copies: dict[int, tuple[int, dict[int, tuple[int, list[Tensor]]]]] = {}

    def whole(self, tensors: Sequence[Tensor]) -> list:
        """A whole fragment in the full format (float32 tensors are passed through, not copied)."""
        if self.full == "none":
            return list(tensors)
        return [compress(t, self.full, block_size=self.block_size) for t in tensors]

    def encode(self, island: int, incarnation: int, fragment: int, version: int, tensors: Sequence[Tensor]) -> Encoded:
        """Encode version ``version`` of ``fragment`` (float32 ``tensors``) for ``island``'s ``incarnation``.

        Whole when there is no delta format, or the island (incarnation) has no copy of the fragment
        yet; else the difference from its copy. The copy is updated to what the island will decode,
        so the caller must deliver this send, or call :meth:`forget`. If the island already holds
        ``version`` or newer (a refused island is resent the version it has), the send carries no
        tensors: it only delivers the update's bookkeeping (merged and refused keys).
        """
        if self.delta is None:
            payload = self.whole(tensors)
            return Encoded(payload, None, sum(t.nbytes for t in payload))
        held = self._copies.get(island)
        if held is None or held[0] != incarnation:
            held = (incarnation, {})
            self._copies[island] = held
        copy = held[1].get(fragment)
        if copy is None:
            payload = self.whole(tensors)
            decoded = [t.detach().to(torch.float32).clone() for t in decode_fragment(payload)]
            held[1][fragment] = (version, decoded)
            return Encoded(payload, None, sum(t.nbytes for t in payload))
        have, current = copy
        if version <= have:
            return Encoded([], have, 0)
        diff = [t.detach().to(torch.float32) - c for t, c in zip(tensors, current)]
        payload = [compress(d, self.delta, block_size=self.block_size, density=self.density) for d in diff]
        held[1][fragment] = (version, apply_delta(current, decode_fragment(payload)))
        return Encoded(payload, have, sum(t.nbytes for t in payload))

    def seed(self, island: int, incarnation: int, fragment: int, version: int, tensors: Sequence[Tensor]) -> bool:
        """Record that ``island``'s ``incarnation`` holds ``version`` of ``fragment`` as exactly ``tensors`` (what it
        decoded from a whole fragment it started from), so that the next send can be a difference. Does nothing and
        returns False without a delta format or when a copy of the fragment is already recorded for that incarnation.
        The caller must know the island holds exactly these tensors: a difference applied to anything else is wrong."""
        if self.delta is None:
            return False
        held = self._copies.get(island)
        if held is None or held[0] != incarnation:
            held = (incarnation, {})
            self._copies[island] = held
        if fragment in held[1]:
            return False
        held[1][fragment] = (version, [t.detach().to(torch.float32).clone() for t in tensors])
        return True

    def forget(self, island: int) -> None:
        """Drop an island's copies: its next send of every fragment goes whole (it died, rejoined,
        or a send to it may not have arrived)."""
        self._copies.pop(island, None)

    def copy_of(self, island: int, fragment: int) -> tuple[int, list[Tensor]] | None:
        """(version, tensors) the sender believes ``island`` holds of ``fragment``, or None."""
        held = self._copies.get(island)
        return None if held is None else held[1].get(fragment)
