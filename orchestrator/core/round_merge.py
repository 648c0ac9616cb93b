"""The merge of one round of one fragment: token weights, the merge rule, the outer step (docs/architecture.md section 3).

`merge_round` turns a round's accepted submissions into one outer gradient (policies.weighting,
policies.merge), lengthens it across partial rounds (policies.merge.RdaAcrossRounds) and applies the
fragment's Nesterov step (policies.outer_optimizer), in place on the fragment's global tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.core.rounds import Pending
from policies.merge import RdaAcrossRounds, join_segments, merge_fragment
from policies.outer_optimizer import FragmentOuterOptimizer, is_clock_rule, round_step_scale
from policies.weighting import merge_weights

if TYPE_CHECKING:
    from orchestrator.core.settings import OuterSettings

@dataclass(frozen=True)
class MergedRound:
    """What the merge did, for the round's record."""

    weights: list[float]  # per submission: its island's weight, shared among its segments by tokens
    step_scale: float  # the factor on the merged outer gradient (policies.outer_optimizer.round_step_scale)
    rda_factor: float  # RdaAcrossRounds' lengthening of the outer gradient, size-weighted mean over tensors


def merge_round(
    pending: Sequence[Pending],
    *,
    opt: FragmentOuterOptimizer,
    window: RdaAcrossRounds | None,
    settings: OuterSettings,
    embedding_mask: Sequence[bool],
    live_islands: int,
    final: bool,
    buffer_mask: Sequence[bool] = (),
) -> MergedRound:
    """Merge one round's `pending` submissions and step `opt` (a `final` flush: the mean, no momentum).

    Tensors under `buffer_mask` (trained buffers such as BatchNorm statistics, merged by the mean through
    `embedding_mask`) move to the islands' weighted mean: no outer lr, no momentum, no RDA lengthening.
    """
    subs = [s for s, _, _ in pending]
    staleness = [st for _, st, _ in pending]
    # An island's several submissions in one round are consecutive segments: weighted and merged as one.
    groups, deltas = join_segments([(s.island, s.incarnation) for s in subs], [d for _, _, d in pending])
    tokens = [sum(subs[i].tokens for i in g) for g in groups]
    group_weights = merge_weights(
        tokens=tokens, steps=[sum(subs[i].inner_steps for i in g) for g in groups],
        scheme=settings.weighting, staleness=[max(staleness[i] for i in g) for g in groups],
        staleness_discount=settings.staleness_discount,
    )
    # The final flush moves to the islands' weighted mean position. Radial-directional averaging lengthens
    # the merged step to the islands' mean norm, which later rounds would correct; after the last round it
    # only amplifies their disagreement: on identical held-out batches the RDA flush raised the final loss
    # by 0.54-0.70% in four default 3M runs, the mean flush lowered it by 0.65-1.11% in four more
    # (benchmarks/RESULTS.md, the final flush).
    rule = "mean" if final else settings.merge_rule
    outer_grad = merge_fragment(deltas, group_weights, rule=rule, embedding_mask=embedding_mask)
    weights = [0.0] * len(subs)  # per submission, for the record: its group's weight shared by tokens
    for g, members in enumerate(groups):
        for i in members:
            weights[i] = group_weights[g] * (subs[i].tokens / tokens[g] if tokens[g] else 1.0 / len(members))
    if final:
        opt.average_step(outer_grad)
        return MergedRound(weights, 1.0, 1.0)
    buffers = [g for g, is_buffer in zip(outer_grad, buffer_mask) if is_buffer]
    if buffers:
        # Zero gradients leave a buffer's momentum at zero and the Nesterov step moves it by nothing;
        # its own step is the plain mean, applied after the optimizer's.
        outer_grad = [g.new_zeros(()).expand_as(g) if is_buffer else g
                      for g, is_buffer in zip(outer_grad, list(buffer_mask) + [False] * len(outer_grad))]
    scale = round_step_scale(settings.step_scale, participants=len({s.island for s in subs}),
                             live_islands=live_islands)
    rda_factor = 1.0
    if window is not None:
        factors = window.update(outer_grad, scale)
        outer_grad = [g.mul_(f) if f != 1.0 else g for g, f in zip(outer_grad, factors)]
        sizes = [g.numel() for g in outer_grad]
        rda_factor = sum(f * n for f, n in zip(factors, sizes)) / max(1, sum(sizes))
    opt.step(outer_grad, scale=scale, clock=is_clock_rule(settings.step_scale))
    if buffers:
        params = [p for p, is_buffer in zip(opt.params, buffer_mask) if is_buffer]
        for p, g in zip(params, buffers):
            p.sub_(g.to(device=p.device, dtype=p.dtype))
    return MergedRound(weights, scale, rda_factor)
