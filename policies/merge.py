"""Merging one round: the rule's checked entry point, whole fragments, segments, and RDA across rounds
(docs/architecture.md section 3, step 5).

The rules themselves are plug-ins (policies/merge_rules.py: radial-directional averaging ``rda``, the weighted
``mean``, or a user's); :func:`merge_into` checks a round's column and runs a rule on it in place, decoding wire
tensors as it goes, and :func:`merge_fragment` merges a whole fragment the same way (embeddings by the mean where
the rule says so). :class:`RdaAcrossRounds` carries RDA's norm rule across the rounds that merge fewer than every
island.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from policies.compression import Compressed, compressor
from policies.merge_rules import Column, MergeRule, merge_rule, merge_rule_names

__all__ = ["MERGE_RULES", "RdaAcrossRounds", "rda_merge", "mean_merge", "merge_fragment", "merge_into", "join_segments",
           "segment_groups", "rule_of", "rules_per_tensor"]

MERGE_RULES = merge_rule_names()  # the built-in rules' names (a user's registers later, by its import path)


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
    _check_weights(weights)


def _check_weights(weights: Sequence[float]) -> None:
    for m, w in enumerate(weights):
        if math.isnan(w) or w < 0:
            raise ValueError(f"weights[{m}] must be >= 0, got {w}; use merge_weights()")


def rule_of(rule: str | MergeRule) -> MergeRule:
    """A registered rule's object (a rule passes through); one line naming the registered ones for an unknown name."""
    return rule if isinstance(rule, MergeRule) else merge_rule(rule)


def rules_per_tensor(rule: str | MergeRule, embedding_mask: Sequence[bool],
                     buffer_mask: Sequence[bool] = ()) -> list[MergeRule]:
    """The rule each tensor of a fragment merges by: `rule`, but the weighted mean for trained buffers
    (`buffer_mask`) and, where the rule's ``mean_for_embeddings`` says so, for embeddings (`embedding_mask`)."""
    chosen, mean = rule_of(rule), merge_rule("mean")
    is_buffer = list(buffer_mask) + [False] * (len(embedding_mask) - len(buffer_mask))
    return [mean if buf or (emb and chosen.mean_for_embeddings) else chosen
            for emb, buf in zip(embedding_mask, is_buffer)]


def mean_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Weighted mean ``sum_m w_m * d_m``, in float32, in a new tensor: the ``mean`` rule (policies.merge_rules).

    Weights are used as given (normalize them first, e.g. with ``merge_weights``).
    """
    _check_inputs(deltas, weights)
    return merge_rule("mean").merged(deltas, weights)


def rda_merge(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Radial-directional average of same-shape tensors, in float32, in a new tensor: the ``rda`` rule
    (policies.merge_rules.RdaRule has the formula). A single delta with weight 1 comes back unchanged."""
    _check_inputs(deltas, weights)
    return merge_rule("rda").merged(deltas, weights)


def merge_into(
    out: Tensor,
    column: Sequence[Tensor | Compressed],
    weights: Sequence[float],
    *,
    rule: str | MergeRule,
    norms: Sequence[float | None] | None = None,
    scratch: Tensor | None = None,
) -> Tensor:
    """`rule` (a registered name or a :class:`MergeRule`) run on `column` into `out`, after checking what it is
    given, without allocating a tensor of the merged size. The outer optimizer's hot path
    (orchestrator/core/round_merge.py) calls it per tensor.

    Args:
        out: contiguous float32, the column's shape; overwritten.
        column: one outer gradient per submission, float32 tensors (read where they lie) or wire tensors
            (``Compressed``: ``none`` read in place, int8/int4 decoded into `scratch`, others decompressed).
        weights: one normalized weight per entry.
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
    _check_weights(weights)
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32, got {out.dtype}; pass a view of the merge buffer")
    return rule_of(rule).merge_into(out, Column(column, norms, decode=_decoded, scratch=scratch), weights)


def _decoded(d: Compressed, scratch: Tensor | None) -> Tensor:
    """The float32 values of one wire tensor by its compressor: into `scratch` where the format decodes in place
    (int8, int4), else its decode (``none``'s is a view of the payload, no copy)."""
    comp = compressor(d.scheme)
    if comp.decodes_in_place:
        if scratch is None:
            scratch = torch.empty(d.numel, dtype=torch.float32)
        return comp.decode_into(d, scratch.view(-1)[: d.numel])
    return comp.decode(d)


def merge_fragment(
    submissions: Sequence[Sequence[Tensor]],
    weights: Sequence[float],
    *,
    rule: str | MergeRule,
    embedding_mask: Sequence[bool],
) -> list[Tensor]:
    """Merge one fragment tensor by tensor, each into a new tensor.

    ``out[t]`` is `rule`'s merge of ``[s[t] for s in submissions]``, except the weighted mean where
    ``embedding_mask[t]`` is True and the rule's ``mean_for_embeddings`` is.

    Args:
        submissions: ``submissions[m][t]`` is tensor ``t`` of submission ``m``.
        weights: one normalized weight per submission.
        rule: a registered rule's name (``MERGE_RULES`` for the built-ins) or a :class:`MergeRule`.
        embedding_mask: ``embedding_mask[t]`` is True for embedding tensors.

    Returns:
        One float32 tensor per tensor of the fragment.
    """
    by = rules_per_tensor(rule, embedding_mask)
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
        _check_inputs(column, weights)
        out.append(by[t].merged(column, weights))
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
        tracked: ``tracked[t]`` is True where the round's merge rule carries its norms across rounds (RDA's
            ``across_rounds``, not embeddings, not the ``mean`` rule); other tensors always get factor 1.
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
