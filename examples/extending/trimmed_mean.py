"""A merge rule robust to one bad island: the coordinate-wise trimmed mean.

Per coordinate of every tensor, the islands' values are sorted, the largest and the smallest dropped, and the rest
averaged, unweighted. One island's outer gradient, however wrong (scaled, sign-flipped, a flipped exponent bit:
examples/extending/bit_flip.py), is at one end of every coordinate it spoils, so it is dropped there and cannot
move the merge. Below three submissions there is nothing to trim and the rule is the unweighted mean.

What it gives up against the built-in ``rda``: the token weights (a slow island's short outer gradient counts as
much as a fast one's), RDA's norm (the merge is no longer rescaled to the islands' mean norm) and RDA's window
across rounds (``across_rounds`` stays False). At the default quorum of K = 1 most rounds merge one or two
submissions, where it trims nothing; a quorum of three or more is where it protects.

Use it by import path: ``--set outer.merge_rule=examples.extending.trimmed_mean:TrimmedMean`` (or
``outer.merge_rule`` in a config file, or ``DilocoTrainer(..., config={"outer": {"merge_rule": ...}})``). The
engine builds it with no arguments in every process that merges (the driver checks it first). It holds no state:
nothing of it is checkpointed, and the run directory records its import path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policies.merge_rules import Column, MergeRule

__all__ = ["TrimmedMean"]


class TrimmedMean(MergeRule):
    """Per coordinate, the unweighted mean of the islands' values without the largest and the smallest (all of
    them under three islands): one island's outlier cannot move the merge. Embeddings too."""

    # Embeddings are merged by this rule as well: a bad island spoils them as much as any other tensor.
    mean_for_embeddings = False

    def merge_into(self, out: torch.Tensor, column: Column, weights: Sequence[float]) -> torch.Tensor:
        """Sorted per coordinate, the ends dropped, the rest averaged into `out`."""
        values = torch.stack([column.value(m).clone() for m in range(len(column))])  # value() may be reused: clone
        if len(column) >= 3:
            values = values.sort(dim=0).values[1:-1]
        return out.copy_(values.mean(dim=0))
