"""Merge rules: how the outer gradients of one round become one (DESIGN.md section 3, step 5).

Radial-directional averaging (RDA) averages the norms and the unit directions separately, so
near-orthogonal island updates keep their typical size instead of shrinking like ``1/sqrt(M)``
under a plain mean. Embedding tensors use the plain weighted mean, as the design specifies
(DESIGN.md section 3, outer step 5); the plain mean for every tensor is the other policy.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["MERGE_RULES", "rda_merge", "mean_merge", "merge_fragment", "join_segments"]

MERGE_RULES = ("rda", "mean")


def _check_inputs(deltas: Sequence[Tensor], weights: Sequence[float]) -> None:
    if len(deltas) == 0:
        raise ValueError("merge got no deltas; a round merges at least one submission")
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(deltas)} deltas but {len(weights)} weights; give one weight per delta")
    shape = deltas[0].shape
    for m, d in enumerate(deltas):
        if d.shape != shape:
            raise ValueError(
                f"delta {m} has shape {tuple(d.shape)} but delta 0 has {tuple(shape)}; "
                "merge the same tensor from every submission"
            )
    for m, w in enumerate(weights):
        if math.isnan(w) or w < 0:
            raise ValueError(f"weights[{m}] must be >= 0, got {w}; use merge_weights()")


def mean_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Weighted mean ``sum_m w_m * d_m``, in float32.

    Weights are used as given (normalize them first, e.g. with ``merge_weights``).
    """
    _check_inputs(deltas, weights)
    out = torch.zeros(deltas[0].shape, dtype=torch.float32, device=deltas[0].device)
    for d, w in zip(deltas, weights):
        out.add_(d.to(torch.float32), alpha=float(w))
    return out


def rda_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Radial-directional average of same-shape tensors, in float32.

    With Frobenius norms over the whole tensor:

    - ``r = sum_m w_m * ||d_m||`` (weighted mean norm),
    - ``u = sum_m w_m * d_m / ||d_m||`` (weighted mean direction; ``d_m = 0`` adds nothing),
    - result ``= r * u / ||u||``, or zeros if ``||u|| == 0``.

    A single delta with weight 1 comes back unchanged (up to float error).
    """
    _check_inputs(deltas, weights)
    u = torch.zeros(deltas[0].shape, dtype=torch.float32, device=deltas[0].device)
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


def merge_fragment(
    submissions: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    *,
    rule: str,
    embedding_mask: Sequence[bool],
) -> list[Tensor]:
    """Merge one fragment tensor by tensor.

    ``out[t] = rda_merge([s[t] for s in submissions], weights)`` for rule ``"rda"``, except
    ``mean_merge`` where ``embedding_mask[t]`` is True; rule ``"mean"`` uses ``mean_merge`` for
    every tensor.

    Args:
        submissions: ``submissions[m][t]`` is tensor ``t`` of submission ``m``.
        weights: one normalized weight per submission.
        rule: one of ``MERGE_RULES``.
        embedding_mask: ``embedding_mask[t]`` is True for embedding tensors.

    Returns:
        One float32 tensor per tensor of the fragment.
    """
    if rule not in MERGE_RULES:
        raise ValueError(f"unknown merge rule {rule!r}; use one of {MERGE_RULES}")
    if len(submissions) == 0:
        raise ValueError("merge_fragment got no submissions; a round merges at least one")
    if len(weights) != len(submissions):
        raise ValueError(
            f"got {len(submissions)} submissions but {len(weights)} weights; give one weight per submission"
        )
    num_tensors = len(embedding_mask)
    for m, sub in enumerate(submissions):
        if len(sub) != num_tensors:
            raise ValueError(
                f"submission {m} has {len(sub)} tensors but embedding_mask has {num_tensors}; "
                "every submission must carry every tensor of the fragment"
            )
    out = []
    for t in range(num_tensors):
        column = [sub[t] for sub in submissions]
        for m, d in enumerate(column):
            if d.shape != column[0].shape:
                raise ValueError(
                    f"tensor {t} of submission {m} has shape {tuple(d.shape)} but submission 0 has "
                    f"{tuple(column[0].shape)}; submissions must come from the same fragment plan"
                )
        if rule == "rda" and not embedding_mask[t]:
            out.append(rda_merge(column, weights))
        else:
            out.append(mean_merge(column, weights))
    return out


def join_segments(
    keys: Sequence[Hashable], submissions: Sequence[Sequence[Tensor]]
) -> tuple[list[list[int]], list[list[Tensor]]]:
    """Group one round's submissions by ``keys`` (an island incarnation) and add up each group's tensors.

    One island's submissions of a fragment are consecutive segments of its trajectory: while a cut is in
    flight the island measures later progress from it (islands/island.py, ``_anchor``), and a salvaged
    snapshot is measured the same way. Two segments in one round are therefore one outer gradient, their
    sum; averaging them with the other islands' as if they were two islands would count the island's
    steps at about half their length.

    Returns ``(groups, joined)``: ``groups[g]`` lists the input indexes of group ``g`` in order of first
    appearance, ``joined[g][t]`` is the sum of tensor ``t`` over the group. A group of one passes its
    tensors through untouched, so a round of one submission per island is bitwise what it was.
    """
    if len(keys) != len(submissions):
        raise ValueError(f"got {len(keys)} keys for {len(submissions)} submissions; give one key per submission")
    index: dict[Hashable, int] = {}
    groups: list[list[int]] = []
    for i, key in enumerate(keys):
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        groups[index[key]].append(i)
    joined: list[list[Tensor]] = []
    for members in groups:
        if len(members) == 1:
            joined.append(list(submissions[members[0]]))
            continue
        first = submissions[members[0]]
        for m in members[1:]:
            if len(submissions[m]) != len(first):
                raise ValueError(f"submissions {members[0]} and {m} of one island hold {len(first)} and "
                                 f"{len(submissions[m])} tensors; segments of one fragment hold the same tensors")
        joined.append([torch.stack([submissions[m][t].to(torch.float32) for m in members]).sum(0)
                       for t in range(len(first))])
    return groups, joined
