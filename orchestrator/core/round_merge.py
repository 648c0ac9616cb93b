"""The merge of one round of one fragment: token weights, the merge rule, the outer step (docs/architecture.md section 3).

`merge_round` turns a round's accepted submissions into one outer gradient (policies.weighting,
policies.merge), lengthens it across partial rounds (policies.merge.RdaAcrossRounds) and applies the
fragment's outer step (policies.outer_optimizer's Nesterov SGD, or the user's torch optimizer:
policies.torch_outer_optimizer, which steps once every tensor of the round is given), in place on the fragment's global tensors.

It goes tensor by tensor: each tensor is merged into a reused buffer (`MergeWorkspace`), lengthened and
stepped before the next is merged, so the merged outer gradient never exists for the whole fragment and a
tensor's gradient, momentum and parameters are still in cache when the step reads them. Every tensor's
update reads only its own values, so the order changes no result (docs/outer.md, Round speed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from orchestrator.core.rounds import Pending
from policies.compression import Compressed, decompress
from policies.merge import RdaAcrossRounds, join_segments, merge_into, segment_groups
from policies.outer_optimizer import is_clock_rule, round_step_scale
from policies.weighting import merge_weights

if TYPE_CHECKING:
    from orchestrator.core.settings import OuterSettings
    from policies.torch_outer_optimizer import OuterStep

@dataclass(frozen=True)
class MergedRound:
    """What the merge did, for the round's record."""

    weights: list[float]  # per submission: its island's weight, shared among its segments by tokens
    step_scale: float  # the factor on the merged outer gradient (policies.outer_optimizer.round_step_scale)
    rda_factor: float  # RdaAcrossRounds' lengthening of the outer gradient, size-weighted mean over tensors


class MergeWorkspace:
    """Two float32 buffers of the largest tensor's size, reused by every round: one tensor's merged outer
    gradient (which its step then works in) and one decoded int8/int4 outer gradient. The only memory a round
    needs beyond the submissions it merges; allocated once, so rounds do not fault fresh pages in."""

    def __init__(self, numel: int) -> None:
        self.numel = max(1, int(numel))
        self.merged = torch.empty(self.numel, dtype=torch.float32)
        self._decode: torch.Tensor | None = None  # made on the first quantized submission

    def out(self, shape: Sequence[int]) -> torch.Tensor:
        """A view of the merge buffer with `shape` (a tensor no larger than the workspace)."""
        n = math.prod(shape)
        if n > self.numel:
            raise ValueError(f"a tensor of {n} elements does not fit the merge workspace of {self.numel}; size it "
                             "to the largest tensor of the fragment plan")
        return self.merged[:n].view(tuple(shape))

    @property
    def decode(self) -> torch.Tensor:
        """The decode buffer (flat, float32)."""
        if self._decode is None:
            self._decode = torch.empty(self.numel, dtype=torch.float32)
        return self._decode

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self.merged.nbytes + (0 if self._decode is None else self._decode.nbytes)


def merge_round(
    pending: Sequence[Pending | tuple],
    *,
    opt: OuterStep,
    window: RdaAcrossRounds | None,
    settings: OuterSettings,
    embedding_mask: Sequence[bool],
    live_islands: int,
    final: bool,
    buffer_mask: Sequence[bool] = (),
    workspace: MergeWorkspace | None = None,
) -> MergedRound:
    """Merge one round's `pending` submissions and step `opt` (a `final` flush: the mean, no momentum).

    Tensors under `buffer_mask` (trained buffers such as BatchNorm statistics, merged by the mean through
    `embedding_mask`) move to the islands' weighted mean: no outer lr, no momentum, no RDA lengthening.
    `workspace`: the buffers to merge in (the outer optimizer keeps one); None allocates one for this call.
    """
    entries = [Pending(*e) for e in pending]
    subs = [e.sub for e in entries]
    staleness = [e.staleness for e in entries]
    num_tensors = len(embedding_mask)
    # An island's several submissions in one round are consecutive segments: weighted and merged as one.
    groups = segment_groups([(s.island, s.incarnation) for s in subs])
    columns, norms = [], []
    for members in groups:
        if len(members) == 1:
            e = entries[members[0]]
            columns.append(list(e.deltas))
            norms.append(list(e.norms) if e.norms is not None else [None] * num_tensors)
        else:
            _, joined = join_segments([0] * len(members), [[decoded(d) for d in entries[m].deltas] for m in members])
            columns.append(joined[0])
            norms.append([None] * num_tensors)
    tokens = [sum(subs[i].tokens for i in g) for g in groups]
    group_weights = merge_weights(
        tokens=tokens, steps=[sum(subs[i].inner_steps for i in g) for g in groups],
        scheme=settings.weighting, staleness=[max(staleness[i] for i in g) for g in groups],
        staleness_discount=settings.staleness_discount,
    )
    weights = [0.0] * len(subs)  # per submission, for the record: its group's weight shared by tokens
    for g, members in enumerate(groups):
        for i in members:
            weights[i] = group_weights[g] * (subs[i].tokens / tokens[g] if tokens[g] else 1.0 / len(members))
    for g, column in enumerate(columns):
        if len(column) != num_tensors:
            raise ValueError(f"submission group {g} has {len(column)} tensors but the fragment has {num_tensors}; "
                             "every submission must carry every tensor of the fragment")
    shapes = [tuple(p.shape) for p in opt.params]
    if workspace is None:
        workspace = MergeWorkspace(max((math.prod(s) for s in shapes), default=1))
    # The final flush moves to the islands' weighted mean position. Radial-directional averaging lengthens
    # the merged step to the islands' mean norm, which later rounds would correct; after the last round it
    # only amplifies their disagreement: on identical held-out batches the RDA flush raised the final loss
    # by 0.54-0.70% in four default 3M runs, the mean flush lowered it by 0.65-1.11% in four more
    # (benchmarks/RESULTS.md, the final flush).
    rule = "mean" if final else settings.merge_rule
    scale = 1.0 if final else round_step_scale(settings.step_scale, participants=len({s.island for s in subs}),
                                                live_islands=live_islands)
    clock = is_clock_rule(settings.step_scale)
    folding = window is not None and not final and window.begin(shapes, scale)
    is_buffer = list(buffer_mask) + [False] * (num_tensors - len(buffer_mask))
    factors = [1.0] * num_tensors
    for t, shape in enumerate(shapes):
        g = merge_into(workspace.out(shape), [c[t] for c in columns], group_weights,
                       rda=rule == "rda" and not embedding_mask[t], norms=[n[t] for n in norms],
                       scratch=workspace.decode if any(isinstance(c[t], Compressed) for c in columns) else None)
        if final or is_buffer[t]:
            # A buffer takes the plain mean, with no lr or momentum: a Nesterov step of a zero gradient would
            # leave it exactly where it is (and its momentum at zero), so it is skipped.
            opt.average_step_tensor(t, g)
            continue
        if folding:
            assert window is not None
            factors[t] = window.fold(t, g, scale)
            if factors[t] != 1.0:
                g.mul_(factors[t])
        opt.step_tensor(t, g, scale=scale, clock=clock)
    if final:
        return MergedRound(weights, 1.0, 1.0)
    sizes = [math.prod(s) for s in shapes]
    rda_factor = sum(f * n for f, n in zip(factors, sizes)) / max(1, sum(sizes)) if window is not None else 1.0
    return MergedRound(weights, scale, rda_factor)


def decoded(d: torch.Tensor | Compressed) -> torch.Tensor:
    """The float32 values of a pending outer gradient (wire tensors decoded)."""
    return decompress(d) if isinstance(d, Compressed) else d
