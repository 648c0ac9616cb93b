"""Stopping a run at a target held-out loss (``run.stop_at_eval_loss``).

Benchmarks ask how long a method takes to reach a loss, not what it reaches after the whole budget.
A run that stops at the first evaluation under the target could stop on a dip; requiring the last
few evaluations in a row to be at or below it matches how benchmarks/compare.py times a target (the
crossing after the last evaluation above it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["TARGET_EVALS_IN_A_ROW", "target_reached"]

TARGET_EVALS_IN_A_ROW = 2


def target_reached(losses: Sequence[float], target: float | None, in_a_row: int = TARGET_EVALS_IN_A_ROW) -> bool:
    """True when the last `in_a_row` held-out losses are all at or below `target` (None: never).

    A NaN loss is never at the target, so a diverged run does not stop as if it had converged.
    """
    if target is None:
        return False
    if in_a_row < 1:
        raise ValueError(f"in_a_row must be >= 1, got {in_a_row}")
    tail = list(losses)[-in_a_row:]
    return len(tail) == in_a_row and all(not math.isnan(x) and x <= target for x in tail)
