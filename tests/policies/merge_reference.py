"""Independent whole-tensor references of the built-in merge rules, written out here so the package's one
implementation of each (policies/merge_rules.py, in place) is checked against code that does not share it.

The same operations in the same order as the rules promise, so the in-place rules must match bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def mean_reference(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``sum_m w_m * d_m`` in float32: zeros, then one ``add_`` per delta."""
    out = torch.zeros(deltas[0].shape, dtype=torch.float32)
    for d, w in zip(deltas, weights):
        out.add_(d.to(torch.float32), alpha=float(w))
    return out


def rda_reference(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """``r * u / ||u||`` with ``r = sum w ||d||`` and ``u = sum w d / ||d||`` (zero deltas add nothing)."""
    u = torch.zeros(deltas[0].shape, dtype=torch.float32)
    r = 0.0
    for d, w in zip(deltas, weights):
        d32 = d.to(torch.float32)
        norm = float(torch.linalg.vector_norm(d32))
        if norm == 0.0:
            continue
        r += float(w) * norm
        u.add_(d32, alpha=float(w) / norm)
    u_norm = float(torch.linalg.vector_norm(u))
    if u_norm == 0.0:
        return torch.zeros_like(u)
    return u.mul_(r / u_norm)
