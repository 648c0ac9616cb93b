"""A user's compressor and plug-ins that must be refused, written outside the package as a user would, named by
import path in tests/plugins/test_user_plugins.py (``outer.compression=tests.plugins.user_plugins:Half``). The
merge rule those tests train with is the worked example examples/extending/trimmed_mean.py, imported here too so
that a misspelt name in this module gets its "did you mean" line."""

from __future__ import annotations

import torch

from examples.extending.trimmed_mean import TrimmedMean
from policies.compressor import Compressed, Compressor
from policies.merge_rules import MergeRule

__all__ = ["NOT_CALLABLE", "Half", "NeedsArguments", "NotARule", "TrimmedMean", "Unfinished"]


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
