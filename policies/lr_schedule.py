"""The inner learning rate over a run: linear warmup, then constant or cosine decay to the token budget.

A decay needs to know how far the run is. An island cannot count that itself: islands run at different
speeds, restart from scratch and join late, and the run ends when *all* islands together have processed
the token budget. So the decay follows the run's global ``progress`` (tokens processed / token budget,
which the driver tells the outer optimizer and every published fragment carries down to the islands),
while the warmup counts the island incarnation's own steps (a restarted island warms its fresh AdamW
state up again). Data parallel uses the same function with its exact progress, so both methods anneal
alike at equal tokens.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULES", "lr_factor"]

LR_SCHEDULES = ("constant", "cosine")
"""``constant``: the peak rate after warmup (no decay). ``cosine``: half a cosine from the peak at
progress 0 to ``final_ratio`` times the peak at progress 1 (and held there past it)."""


def lr_factor(schedule: str, *, step: int, warmup_steps: int, progress: float, final_ratio: float) -> float:
    """The multiplier on the peak learning rate for an inner step.

    ``warm * decay`` with ``warm = min(1, (step + 1) / warmup_steps)`` (1 when ``warmup_steps`` is 0) and

    - ``constant``: ``decay = 1``;
    - ``cosine``: ``decay = final_ratio + (1 - final_ratio) * (1 + cos(pi * min(progress, 1))) / 2``,
      torch's ``CosineAnnealingLR`` with ``eta_min = final_ratio * peak`` evaluated at ``T_cur / T_max =
      progress``.

    Args:
        schedule: one of :data:`LR_SCHEDULES`.
        step: inner steps this island incarnation has taken before this one, ``>= 0``.
        warmup_steps: steps of linear warmup, ``>= 0``.
        progress: the run's tokens processed over its token budget, ``>= 0`` (values past 1 hold the
            final rate: the last steps before a run notices its budget is spent).
        final_ratio: the decayed rate as a fraction of the peak, in ``[0, 1]``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step={step} and warmup_steps={warmup_steps} must both be >= 0")
    if not math.isfinite(progress) or progress < 0:
        raise ValueError(f"progress must be a finite fraction >= 0 of the token budget, got {progress}")
    if not 0.0 <= final_ratio <= 1.0:
        raise ValueError(f"final_ratio must be in [0, 1], got {final_ratio}; use e.g. 0.1")
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if schedule == "constant":
        return warm
    t = min(progress, 1.0)
    return warm * (final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))
