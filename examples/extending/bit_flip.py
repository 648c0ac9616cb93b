"""A fault kind in one file: ``bit_flip``, silent data corruption of an island's outer gradients.

A chip or a memory that flips a bit now and then corrupts what passes through it without an error. This kind
models the worst single flip for a float32 outer gradient, the top exponent bit (bit 30): while the fault lasts,
each outer gradient the island sends has, in every tensor, one element (picked by the cut's seed) with that bit
flipped. An element ``x`` with ``|x| < 1`` becomes ``x * 2**128`` (0 becomes 2.0), one with ``1 <= |x| < 2``
becomes infinite or NaN, a larger one nearly 0 (``x * 2**-128`` from 4 on). Outer gradients are almost all below 1
in magnitude, so the submission usually stays finite and well shaped and carries one element per tensor 2**128
(about 3.4e38) times too large.

What the engine does with it: its values are finite, but its norm overflows float32, and the submission check
refuses a tensor whose norm does (orchestrator/core/submission_check.py), whatever the guard and the merge rule.
Until 2026-12-03 it did not: at the defaults (float32 uplink, ``rda``, ``outer.poison_guard`` off) the submission
joined its round and RDA's merge of that tensor was infinite; this kind is how that was found. A flip the check
lets through (a smaller value) is refused by the poison guard (``outer.poison_guard: true``) by its size, and
dropped per coordinate by the trimmed mean (examples/extending/trimmed_mean.py).

``duration_s``: seconds the island corrupts every submission it cuts (0: until its incarnation ends), as every
poison kind. ``factor`` means nothing here and must stay 1.0.

A kind registers itself when its class is defined, so importing this module is what makes ``bit_flip`` a valid
kind for ``policies.chaos.Fault``, tapes, ``--chaos ...kinds=...`` and ``LearnerIsland.inject``, in that process.
"""

from __future__ import annotations

import torch

from policies import fault_kinds

__all__ = ["BIT", "BitFlip", "flip_bit", "flipped_index"]

BIT = 30  # float32's top exponent bit: the sign is bit 31, the exponent bits 30 to 23


def flipped_index(numel: int, seed: int) -> int:
    """The flat index of the element a cut with `seed` flips in a tensor of `numel` elements (any number works:
    the seed is the cut's own, so a run flips the same elements again)."""
    return int(torch.randint(numel, (1,), generator=torch.Generator().manual_seed(seed)).item())


def flip_bit(t: torch.Tensor, index: int, bit: int = BIT) -> torch.Tensor:
    """A float32 copy of `t` with `bit` of its flat element `index` flipped (`t` is not changed)."""
    out = t.detach().to(torch.float32).contiguous().clone()
    bits = out.view(-1).view(torch.int32)  # the same memory, read as integers
    bits[index] ^= 1 << bit  # 1 << 30 fits an int32; bit 31 (the sign) would not, nor is it asked for
    return out


class BitFlip(fault_kinds.PoisonKind):
    """``bit_flip``: every outer gradient sent in ``[at, at + duration_s)`` (0: the rest of the incarnation) has
    bit 30 of one element per tensor flipped (module docstring). ``factor`` must stay 1.0."""

    name = "bit_flip"

    def check(self, fault: fault_kinds.FaultFields) -> None:
        """A bit flip has no size: refuse a ``factor`` in this kind's own words, one line."""
        if fault.factor != 1.0:
            raise ValueError(f"Fault.factor of a bit_flip fault must be 1.0 (it flips bit {BIT} of one element per "
                             f"tensor, it has no size), got {fault.factor}; leave factor out")
        super().check(fault)

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        """`owed` (one fragment's honest outer gradient) with one element of each tensor bit-flipped, the element
        picked by `seed` and the tensor's place, each tensor back in its own dtype."""
        out = []
        for i, o in enumerate(owed):
            if o.numel() == 0:
                out.append(o)
                continue
            out.append(flip_bit(o, flipped_index(o.numel(), seed * 1_000 + i)).to(o.dtype))
        return out
