"""A user's merge rule and compressor, written outside the package as a user would, named by import path in
tests/plugins/test_user_plugins.py (``outer.merge_rule=tests.plugins.user_plugins:TrimmedMean``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.compressor import Compressed, Compressor
from policies.merge_rules import Column, MergeRule


class TrimmedMean(MergeRule):
    """Per coordinate, the unweighted mean of the islands' values without the largest and the smallest (all of
    them under three islands): one island's outlier cannot move the merge. Embeddings too."""

    mean_for_embeddings = False

    def merge_into(self, out: torch.Tensor, column: Column, weights: Sequence[float]) -> torch.Tensor:
        """Sorted per coordinate, the ends dropped, the rest averaged into `out`."""
        values = torch.stack([column.value(m).clone() for m in range(len(column))])  # value() may be reused: clone
        if len(column) >= 3:
            values = values.sort(dim=0).values[1:-1]
        return out.copy_(values.mean(dim=0))


class Half(Compressor):
    """float16 on the wire: half of float32's bytes, 11 significant bits."""

    wire_dtype = torch.float16
    dense = True

    def encode(self, t: torch.Tensor, *, block_size: int, density: float) -> Compressed:
        """``t`` rounded to float16."""
        return Compressed("half", tuple(t.shape), t.detach().to(torch.float16).contiguous().clone(), None, block_size)

    def decode(self, c: Compressed) -> torch.Tensor:
        """The float16 values as float32 (exact)."""
        return c.payload.to(torch.float32).reshape(c.shape)

    def error_bound(self, t: torch.Tensor, *, block_size: int, density: float) -> torch.Tensor:
        """Half a unit in the last of 11 significant bits (normal range)."""
        return t.detach().to(torch.float32).abs() * 2.0**-11


class NotARule:
    """Has the method but not the interface: refused."""

    def merge_into(self, out, column, weights):
        return out


class Unfinished(MergeRule):
    """Subclasses the interface without its method: refused."""


class NeedsArguments(Compressor):
    """Cannot be built with no arguments: refused."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def encode(self, t, *, block_size, density):  # pragma: no cover - never built
        raise NotImplementedError

    def decode(self, c):  # pragma: no cover - never built
        raise NotImplementedError


NOT_CALLABLE = 3
