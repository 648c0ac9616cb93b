"""Model averaging: the run's served model as a moving average of its global model (``run.average_window``).

The outer optimizer's global parameters jitter from round to round: each round adds a Nesterov step
built from a few islands' noisy progress, and the outer learning rate does not decay. At 30M tokens
the held-out loss of the global model swings about 0.5% between evaluations seconds apart, and with
a window of 0.04 the average scored about 1% lower than the final global model (benchmarks/RESULTS.md,
Averaging the global model). Data parallel's model gains as much from the same average, so the
baseline keeps one too (orchestrator/baselines/data_parallel.py). Islands keep training from the raw global
model; only what the run evaluates, checkpoints as its model and exports is the average.

The rule is a moving average whose time constant is a fixed fraction ``window`` of the tokens merged
so far: after a round that merges ``n`` tokens into a total of ``T``, the average moves toward the
global model by ``min(1, n / (window * T))``. Early in a run, when the model changes fast, it follows
closely; late, it averages over the last ``window`` of the run. In the limit of small rounds this is
the power-function EMA of Karras et al. (2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", EDM2) with exponent ``1 / window - 1``, whose averaging profile has a standard
deviation of about ``window`` times the run's length, so one setting suits any token budget and a run
does not need to know when it will stop. The window must span many rounds to average anything: a
round (or the final flush, which merges every island's last steps at once) of at least ``window``
times the tokens so far replaces the average with the global model.
"""

from __future__ import annotations

import math

__all__ = ["average_weight"]


def average_weight(new_tokens: float, total_tokens: float, window: float) -> float:
    """How far the average moves toward the newest model: ``min(1, new_tokens / (window * total_tokens))``.

    `new_tokens` is what the newest update merged, `total_tokens` everything merged up to and including
    it, `window` the average's time constant as a fraction of `total_tokens` (0 < window <= 1). An
    update before anything was merged (`total_tokens` 0) replaces the average.
    """
    if not (isinstance(window, (int, float)) and math.isfinite(window) and 0 < window <= 1):
        raise ValueError(f"window must be a fraction in (0, 1], got {window!r}")
    if new_tokens < 0 or total_tokens < new_tokens:
        raise ValueError(f"need 0 <= new_tokens <= total_tokens, got new_tokens={new_tokens}, total_tokens={total_tokens}")
    if total_tokens == 0:
        return 1.0
    return min(1.0, new_tokens / (window * total_tokens))
