"""How far a run is from a baseline run: held-out loss at equal tokens, bytes per token, time to the baseline's loss.

Pure: both runs arrive as their evaluation points (tokens processed, held-out loss, seconds of training), as
summary.json's `evals` holds them. Used by `diloco report RUN_DIR --baseline OTHER_RUN_DIR`
(orchestrator/run/baseline_compare.py).

Equal tokens: a run and its baseline rarely stop at the same token count (an island's last step, a synchronous
step's size), so both curves are read at T = the smaller of the two final token counts, each interpolated linearly
between the two evaluations around T. Each curve has a point at or past T, so no curve is extrapolated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EvalPoint", "QualityGap", "loss_at_tokens", "quality_gap", "time_to_loss"]


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: after `tokens` tokens processed and `wall_s` seconds of training, `loss`."""

    tokens: float
    loss: float
    wall_s: float


@dataclass(frozen=True)
class QualityGap:
    """A run against its baseline (see `quality_gap`).

    Attributes:
        tokens: T, the token count both losses are read at (the smaller final count).
        loss: the run's held-out loss at T.
        baseline_loss: the baseline's held-out loss at T.
        relative: loss / baseline_loss - 1 (+0.02: 2% worse than the baseline).
        bytes_ratio: the baseline's bytes sent per token over the run's (62.5: 62.5x fewer bytes per token);
            None when either run sent no bytes or processed no tokens.
        time_to_baseline_loss_s: the run's seconds of training to the baseline's final loss, interpolated between
            its evaluations; None if the run never reached it.
        baseline_time_s: the baseline's seconds of training to its final evaluation.
    """

    tokens: float
    loss: float
    baseline_loss: float
    relative: float
    bytes_ratio: float | None
    time_to_baseline_loss_s: float | None
    baseline_time_s: float


def _sorted(points: Sequence[EvalPoint], name: str) -> list[EvalPoint]:
    pts = sorted((p for p in points if math.isfinite(p.loss)), key=lambda p: p.tokens)
    if not pts:
        raise ValueError(f"{name} has no finite held-out evaluation to compare")
    return pts


def loss_at_tokens(points: Sequence[EvalPoint], tokens: float) -> float:
    """The held-out loss at `tokens`, linear between the evaluations around it; `tokens` past the last one or before
    the first is an error (the caller picks T inside both curves)."""
    pts = _sorted(points, "the curve")
    if not pts[0].tokens <= tokens <= pts[-1].tokens:
        raise ValueError(f"{tokens:,.0f} tokens is outside the evaluations ({pts[0].tokens:,.0f} to {pts[-1].tokens:,.0f})")
    for a, b in zip(pts, pts[1:]):
        if a.tokens <= tokens <= b.tokens:
            if b.tokens == a.tokens:
                return b.loss
            return a.loss + (b.loss - a.loss) * (tokens - a.tokens) / (b.tokens - a.tokens)
    return pts[-1].loss  # a single point, at exactly `tokens`


def time_to_loss(points: Sequence[EvalPoint], target: float) -> float | None:
    """Seconds of training until the held-out loss first reaches `target` (linear between the two evaluations
    that cross it), None if it never does."""
    pts = sorted((p for p in points if math.isfinite(p.loss)), key=lambda p: p.wall_s)
    for a, b in zip([None, *pts], pts):
        if b.loss <= target:
            if a is None or a.loss == b.loss:
                return b.wall_s
            return a.wall_s + (b.wall_s - a.wall_s) * (a.loss - target) / (a.loss - b.loss)
    return None


def quality_gap(run: Sequence[EvalPoint], baseline: Sequence[EvalPoint], *, run_bytes: float | None = None,
                baseline_bytes: float | None = None) -> QualityGap:
    """`run` against `baseline` at equal tokens (the module docstring says how); bytes are each run's bytes sent."""
    mine, theirs = _sorted(run, "the run"), _sorted(baseline, "the baseline")
    t = min(mine[-1].tokens, theirs[-1].tokens)
    loss, base = loss_at_tokens(mine, t), loss_at_tokens(theirs, t)
    ratio = None
    if run_bytes and baseline_bytes and mine[-1].tokens > 0 and theirs[-1].tokens > 0:
        ratio = (baseline_bytes / theirs[-1].tokens) / (run_bytes / mine[-1].tokens)
    return QualityGap(tokens=t, loss=loss, baseline_loss=base, relative=loss / base - 1.0, bytes_ratio=ratio,
                      time_to_baseline_loss_s=time_to_loss(mine, theirs[-1].loss), baseline_time_s=theirs[-1].wall_s)
