"""Merge rules: how the outer gradients of one round become one (docs/architecture.md section 3, step 5).

Radial-directional averaging (RDA) averages the norms and the unit directions separately, so
near-orthogonal island updates keep their typical size instead of shrinking like ``1/sqrt(M)``
under a plain mean. Embedding tensors use the plain weighted mean, as the design specifies
(docs/architecture.md section 3, outer step 5); the plain mean for every tensor is the other policy.
:class:`RdaAcrossRounds` carries RDA's norm rule across the rounds that merge fewer than every island.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from policies.compression import FUSED_SCHEMES, Compressed, decode_into, decompress

__all__ = ["MERGE_RULES", "RdaAcrossRounds", "rda_merge", "mean_merge", "merge_fragment", "merge_into", "join_segments", "segment_groups"]

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


def merge_into(
    out: Tensor,
    column: Sequence[Tensor | Compressed],
    weights: Sequence[float],
    *,
    rda: bool,
    norms: Sequence[float | None] | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """``rda_merge(column, weights)`` (``rda``) or ``mean_merge(column, weights)`` written into `out`: the
    same operations in the same order, so bitwise the same values, without allocating a tensor of the
    merged size. The outer optimizer's hot path (orchestrator/core/round_merge.py) calls it per tensor.

    Args:
        out: contiguous float32, the column's shape; overwritten.
        column: one outer gradient per submission, float32 tensors (read where they lie) or wire tensors
            (``Compressed``: ``none`` read in place, int8/int4 decoded into `scratch`, others decompressed).
        weights: one normalized weight per entry.
        rda: radial-directional average; False: the weighted mean.
        norms: ``norms[m]`` is ``float(torch.linalg.vector_norm(value of column[m]))`` when the caller
            already has it (the outer optimizer's finite check computes it), or None to compute it here.
        scratch: contiguous float32 with at least ``out.numel()`` elements, for decoding; allocated when
            needed and not given.
    """
    if len(column) == 0:
        raise ValueError("merge got no deltas; a round merges at least one submission")
    if len(weights) != len(column) or (norms is not None and len(norms) != len(column)):
        raise ValueError(f"got {len(column)} deltas, {len(weights)} weights and "
                         f"{'no' if norms is None else len(norms)} norms; give one weight (and norm) per delta")
    shape = tuple(out.shape)
    for m, d in enumerate(column):
        if tuple(d.shape) != shape:
            raise ValueError(f"delta {m} has shape {tuple(d.shape)} but the output has {shape}; "
                             "merge the same tensor from every submission")
    for m, w in enumerate(weights):
        if math.isnan(w) or w < 0:
            raise ValueError(f"weights[{m}] must be >= 0, got {w}; use merge_weights()")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32, got {out.dtype}; pass a view of the merge buffer")
    # Zeros, then += w * d per entry, exactly as mean_merge and rda_merge accumulate (signed zeros included).
    out.zero_()
    if not rda:
        for m, w in enumerate(weights):
            out.add_(_value(column[m], out, scratch), alpha=float(w))
        return out
    r = 0.0
    for m, w in enumerate(weights):
        d = _value(column[m], out, scratch)
        known = None if norms is None else norms[m]
        norm = float(torch.linalg.vector_norm(d)) if known is None else known
        if norm == 0.0:
            continue
        r += float(w) * norm
        out.add_(d, alpha=float(w) / norm)
    u_norm = float(torch.linalg.vector_norm(out))
    if u_norm == 0.0:
        return out.zero_()
    return out.mul_(r / u_norm)


def _value(d: Tensor | Compressed, out: Tensor, scratch: Tensor | None) -> Tensor:
    """The float32 values of one column entry: in place where they already are float32, else decoded."""
    if isinstance(d, Tensor):
        return d.to(torch.float32)
    if d.scheme == "none":
        return d.payload.to(torch.float32).reshape(d.shape)  # decompress's view, no copy
    if d.scheme in FUSED_SCHEMES:
        if scratch is None:
            scratch = torch.empty(out.numel(), dtype=torch.float32)
        return decode_into(d, scratch.view(-1)[: out.numel()])
    return decompress(d)


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


def segment_groups(keys: Sequence[Hashable]) -> list[list[int]]:
    """The groups :func:`join_segments` forms: ``groups[g]`` lists the indexes of ``keys`` equal to the g-th
    distinct key, keys in order of first appearance, indexes in order."""
    index: dict[Hashable, int] = {}
    groups: list[list[int]] = []
    for i, key in enumerate(keys):
        if key not in index:
            index[key] = len(groups)
            groups.append([])
        groups[index[key]].append(i)
    return groups


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
    groups = segment_groups(keys)
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


class RdaAcrossRounds:
    """Radial-directional averaging across the recent rounds of one fragment, for rounds of share ``s < 1``.

    RDA keeps a full round's step at the islands' mean delta norm; a plain mean would shrink it by
    the islands' misalignment. A round that merges one island of M has nothing to average: under a
    scaled step rule (``clock``, ``participation``) it moves ``s = 1/M`` of a full step, and the rounds
    that make up one full round's worth add up like a plain *mean* of the islands' deltas, the
    shrinkage RDA exists to undo (measured in the heterogeneity scenario: the islands' outer gradients
    make K = all's RDA lengthen its steps 1.2-1.35x, while the same length ratio over a window of
    K = 1 rounds is 1.2-1.6x and nothing applied it). This tracker applies RDA's norm rule across
    rounds: per tensor it keeps decayed sums over the fragment's rounds

    - ``N = a * N + s * ||g||`` (radial: the rounds' share-weighted norms),
    - ``V = a * V + s * g`` (directional: their share-weighted sum),

    with ``a = exp(-DECAY * s)`` per round, a window of about one full round of clock time, and
    returns the factor ``clamp(N / ||V||, 1, 1 / sqrt(s))`` by which the round's merged outer
    gradient is lengthened. The decay is chosen so that a stream of rounds of share ``s`` with
    mutually orthogonal gradients of equal norm gives about ``1 / sqrt(s)``, what RDA gives ``1 / s``
    orthogonal deltas in one round, and aligned gradients give 1. The cap ``1 / sqrt(s)`` is that
    orthogonal limit, so a full round (``s = 1``) always gets 1: K = all is unchanged.

    Args:
        num_tensors: tensors of the fragment.
        tracked: ``tracked[t]`` is True where the round's merge rule is RDA (not embeddings, not the
            ``mean`` rule); other tensors always get factor 1.
    """

    DECAY = 2.0  # per full round of clock time: exp(-2 * 0.25) = 0.61 per quarter round, see above

    def __init__(self, num_tensors: int, tracked: Sequence[bool]) -> None:
        if len(tracked) != num_tensors:
            raise ValueError(f"tracked has {len(tracked)} entries for {num_tensors} tensors; give one per tensor")
        self._tracked = [bool(x) for x in tracked]
        self._norms = [0.0] * num_tensors
        self._sums: list[Tensor | None] = [None] * num_tensors  # allocated at the first partial round

    @property
    def active(self) -> bool:
        """Whether a partial round has been seen (before it, every factor is 1 and nothing is held)."""
        return any(v is not None for v in self._sums)

    def update(self, outer_grad: Sequence[Tensor], share: float) -> list[float]:
        """Fold one round's merged outer gradient (before any factor) in; return one factor per tensor.

        Full rounds (``share == 1``) before the first partial round are not tracked (K = all holds no
        extra copy of the fragment); after it they decay and join the window like any round.
        """
        factors = [1.0] * len(outer_grad)
        if not self.begin([tuple(g.shape) for g in outer_grad], share):
            return factors
        return [self.fold(t, g, share) for t, g in enumerate(outer_grad)]

    def begin(self, shapes: Sequence[tuple[int, ...]], share: float) -> bool:
        """Check a round's tensor `shapes` and `share`; whether its tensors fold in (:meth:`fold`, one by one).

        False for a full round while no partial round has been seen: every factor is then 1.
        """
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share={share} must be in (0, 1]; pass the round's step scale")
        if len(shapes) != len(self._tracked):
            raise ValueError(f"outer_grad has {len(shapes)} tensors but the tracker has {len(self._tracked)}")
        for t, (shape, v) in enumerate(zip(shapes, self._sums)):  # all checked before any is folded in
            if v is not None and tuple(v.shape) != tuple(shape):
                raise ValueError(f"outer_grad[{t}] has shape {tuple(shape)} but the tracker holds "
                                 f"{tuple(v.shape)}; one tracker per fragment")
        return not (share >= 1.0 and not self.active)

    def fold(self, t: int, g: Tensor, share: float) -> float:
        """Fold tensor `t` of a round that :meth:`begin` admitted; its factor (1 where not tracked)."""
        if not self._tracked[t]:
            return 1.0
        decay = math.exp(-self.DECAY * share)
        cap = 1.0 / math.sqrt(share)
        g32 = g.detach().to(torch.float32)
        acc = self._sums[t]
        if acc is None:
            acc = self._sums[t] = torch.zeros_like(g32)
        self._norms[t] = decay * self._norms[t] + share * float(torch.linalg.vector_norm(g32))
        v = acc.mul_(decay).add_(g32, alpha=share)
        v_norm = float(torch.linalg.vector_norm(v))
        return min(cap, max(1.0, self._norms[t] / v_norm)) if v_norm > 0.0 else 1.0

    def state_dict(self) -> dict[str, Any]:
        """``{"norms": [float], "sums": [Tensor | None]}``, copies."""
        return {"norms": list(self._norms), "sums": [None if v is None else v.clone() for v in self._sums]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        norms, sums = list(state["norms"]), list(state["sums"])
        if len(norms) != len(self._tracked) or len(sums) != len(self._tracked):
            raise ValueError(f"state holds {len(norms)} norms and {len(sums)} sums for {len(self._tracked)} tensors")
        self._norms = [float(x) for x in norms]
        self._sums = [None if v is None else v.detach().to(torch.float32).clone() for v in sums]
