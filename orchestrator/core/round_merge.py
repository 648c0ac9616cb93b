"""The merge of one round of one fragment: token weights, the merge rule, the outer step (docs/architecture.md section 3).

`merge_round` turns a round's accepted submissions into one outer gradient (policies.weighting, the run's
merge rule: policies.merge_rules, a plug-in), lengthens it across partial rounds (policies.merge.RdaAcrossRounds) and applies the
fragment's outer step (policies.outer_optimizer's Nesterov SGD, or the user's torch optimizer:
policies.torch_outer_optimizer, which steps once every tensor of the round is given), in place on the fragment's global tensors.

It goes tensor by tensor: each tensor is merged into a reused buffer (`MergeWorkspace`), lengthened and
stepped before the next is merged, so the merged outer gradient never exists for the whole fragment and a
tensor's gradient, momentum and parameters are still in cache when the step reads them. Every tensor's
update reads only its own values, so the order changes no result (docs/outer.md, Round speed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from islands.plugins import load_compressor, load_merge_rule
from orchestrator.core.fragment_optimizers import fragment_optimizer
from orchestrator.core.rounds import Pending
from policies.compression import Compressed, decompress
from policies.merge import RdaAcrossRounds, join_segments, merge_into, rules_per_tensor, segment_groups
from policies.merge_rules import merge_rule
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


class FragmentMerges:
    """What every fragment's rounds merge with: which tensors are embeddings and trained buffers, each fragment's
    outer optimizer (core/fragment_optimizers.py) and RDA window across rounds, the run's merge rule and
    compressor (loaded here, so a plug-in that does not load fails before any round), and one workspace.

    `embedding_names` merge by the plain mean where the rule says so; `buffer_names` (trained buffers such as
    BatchNorm statistics) always do, and skip the outer step.
    """

    def __init__(self, params: Sequence[Sequence[torch.Tensor]], fragments: Sequence[Sequence[str]], settings: OuterSettings,
                 *, embedding_names: Set[str], buffer_names: Set[str]) -> None:
        self.embedding_mask = [[n in embedding_names or n in buffer_names for n in frag] for frag in fragments]
        self.buffer_mask = [[n in buffer_names for n in frag] for frag in fragments]
        # The built-in Nesterov SGD, or the user's torch optimizer (settings.optimizer).
        self.opts = [fragment_optimizer(frag, settings) for frag in params]
        rule = load_merge_rule(settings.merge_rule)
        load_compressor(settings.compression)  # registers a user's in this process, for the wire tensors it decodes
        # RDA's norm rule across partial rounds, where the rule carries it (its across_rounds) and the run enables it.
        tracked = [[r.across_rounds for r in rules_per_tensor(rule, emb, buf)]
                   for emb, buf in zip(self.embedding_mask, self.buffer_mask)]
        self.windows = [RdaAcrossRounds(len(t), t) if settings.rda_across_rounds else None for t in tracked]
        # One tensor's merged outer gradient at a time: the largest tensor's size.
        self.workspace = MergeWorkspace(max((t.numel() for frag in params for t in frag), default=1))

    def merge(self, p: int, pending: Sequence[Pending], *, settings: OuterSettings, live_islands: int,
              final: bool) -> MergedRound:
        """`merge_round` of fragment `p`'s `pending` submissions with its optimizer, window and masks, under the
        outer optimizer's `settings` as they are now (the ones it was built with may have been replaced)."""
        return merge_round(pending, opt=self.opts[p], window=self.windows[p], settings=settings,
                           embedding_mask=self.embedding_mask[p], buffer_mask=self.buffer_mask[p],
                           live_islands=live_islands, final=final, workspace=self.workspace)


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

    Each tensor merges by the run's rule (``settings.merge_rule``, a plug-in: policies/merge_rules.py), or by the
    weighted mean where policies.merge.rules_per_tensor says so. Tensors under `buffer_mask` (trained buffers
    such as BatchNorm statistics) move to the islands' weighted mean: no outer lr, no momentum, no RDA
    lengthening. `workspace`: the buffers to merge in (the outer optimizer keeps one); None allocates one.
    """
    entries = [Pending(*e) for e in pending]
    subs = [e.sub for e in entries]
    num_tensors = len(embedding_mask)
    groups, columns, norms = island_columns(entries, num_tensors)
    group_weights, weights = round_weights(entries, groups, settings)
    shapes = [tuple(p.shape) for p in opt.params]
    if workspace is None:
        workspace = MergeWorkspace(max((math.prod(s) for s in shapes), default=1))
    # The final flush moves to the islands' weighted mean position. Radial-directional averaging lengthens
    # the merged step to the islands' mean norm, which later rounds would correct; after the last round it
    # only amplifies their disagreement: on identical held-out batches the RDA flush raised the final loss
    # by 0.54-0.70% in four default 3M runs, the mean flush lowered it by 0.65-1.11% in four more
    # (benchmarks/RESULTS.md, the final flush).
    rules = rules_per_tensor(merge_rule("mean") if final else load_merge_rule(settings.merge_rule), embedding_mask,
                             buffer_mask)
    scale = 1.0 if final else round_step_scale(settings.step_scale, participants=len({s.island for s in subs}),
                                                live_islands=live_islands)
    clock = is_clock_rule(settings.step_scale)
    folding = window is not None and not final and window.begin(shapes, scale)
    is_buffer = list(buffer_mask) + [False] * (num_tensors - len(buffer_mask))
    factors = [1.0] * num_tensors
    for t, shape in enumerate(shapes):
        g = merge_into(workspace.out(shape), [c[t] for c in columns], group_weights, rule=rules[t],
                       norms=[n[t] for n in norms],
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


def island_columns(entries: Sequence[Pending], num_tensors: int) -> tuple[list[list[int]], list[list], list[list]]:
    """``(groups, columns, norms)``: the entries grouped by island incarnation (policies.merge.segment_groups),
    ``columns[g][t]`` group g's outer gradient of tensor t (a group of one as it arrived, wire tensors included;
    several segments added up, decoded) and ``norms[g][t]`` its norm where the submission check knew it, else None.

    An island's several submissions in one round are consecutive segments: weighted and merged as one.
    """
    groups = segment_groups([(e.sub.island, e.sub.incarnation) for e in entries])
    columns: list[list] = []
    norms: list[list] = []
    for members in groups:
        if len(members) == 1:
            e = entries[members[0]]
            columns.append(list(e.deltas))
            norms.append(list(e.norms) if e.norms is not None else [None] * num_tensors)
        else:
            _, joined = join_segments([0] * len(members), [[decoded(d) for d in entries[m].deltas] for m in members])
            columns.append(joined[0])
            norms.append([None] * num_tensors)
    for g, column in enumerate(columns):
        if len(column) != num_tensors:
            raise ValueError(f"submission group {g} has {len(column)} tensors but the fragment has {num_tensors}; "
                             "every submission must carry every tensor of the fragment")
    return groups, columns, norms


def round_weights(entries: Sequence[Pending], groups: Sequence[Sequence[int]],
                  settings: OuterSettings) -> tuple[list[float], list[float]]:
    """``(group_weights, weights)``: one merge weight per island group (policies.weighting.merge_weights over the
    group's tokens, steps and largest staleness) and, for the record, per submission its group's weight shared
    among the group's segments by tokens."""
    subs = [e.sub for e in entries]
    tokens = [sum(subs[i].tokens for i in g) for g in groups]
    group_weights = merge_weights(
        tokens=tokens, steps=[sum(subs[i].inner_steps for i in g) for g in groups],
        scheme=settings.weighting, staleness=[max(entries[i].staleness for i in g) for g in groups],
        staleness_discount=settings.staleness_discount,
    )
    weights = [0.0] * len(subs)
    for g, members in enumerate(groups):
        for i in members:
            weights[i] = group_weights[g] * (subs[i].tokens / tokens[g] if tokens[g] else 1.0 / len(members))
    return group_weights, weights


def decoded(d: torch.Tensor | Compressed) -> torch.Tensor:
    """The float32 values of a pending outer gradient (wire tensors decoded)."""
    return decompress(d) if isinstance(d, Compressed) else d
