"""The held-out evaluations of one driver session, and the losses the summary reports beside them.

`RunEvaluations` scores parameters that `Run` (orchestrator/run/driver.py) read from the outer optimizer and
keeps what came of it: the evaluation points (each also an `evals` event and an `on_eval` callback), a fresh
run's starting point (held until an island has stepped, then scored first), the corpus's unigram baseline,
the loss just before the final flush and the raw global model's under run.average_window. `target_reached`
is the stop_at_eval_loss rule on the points so far. No Ray: the driver makes the calls and hands the
parameters here.
"""

from __future__ import annotations

import logging
import time

import torch

from islands.data import unigram_bits_per_byte
from orchestrator.core.evaluation import Evaluator
from orchestrator.core.eventlog import EventLog
from orchestrator.run.callbacks import Callbacks
from orchestrator.run.streams import heldout_unigram_bits
from orchestrator.run.workload import TrainingData
from policies.stopping import target_reached

log = logging.getLogger(__name__)


def unigram_baseline(data: TrainingData) -> float | None:
    """The corpus's unigram baseline in bits per token; None for a dataset of examples (no token stream).

    A streamed corpus's training tokens never reach the driver: its unigram is fitted on the first half of the
    held-out sample and scored on the second (islands.data.unigram_bits_per_byte either way)."""
    if not (data.is_tokens and data.vocab_size):
        return None
    if data.is_streamed:
        return heldout_unigram_bits(data.heldout, data.vocab_size)
    return unigram_bits_per_byte(data.train, data.heldout, vocab_size=data.vocab_size)


class RunEvaluations:
    """One session's evaluations with `evaluator` on the held-out batches of `data`, recorded to `events` and
    handed to `callbacks`.

    points: every evaluation point, in the order scored. unigram_bpb: the corpus's unigram baseline, once
    scored. before_flush_loss, raw_loss: what `loss` gave for the model before the final flush and for the raw
    global model, when the driver asked (None otherwise).
    """

    def __init__(self, evaluator: Evaluator | None, data: TrainingData | None, events: EventLog | None,
                 callbacks: Callbacks) -> None:
        self.evaluator = evaluator
        self.data = data
        self.events = events
        self.callbacks = callbacks
        self.points: list[dict] = []
        self.unigram_bpb: float | None = None
        self.before_flush_loss: float | None = None  # held-out loss just before the final flush
        self.raw_loss: float | None = None  # final held-out loss of the raw global model, under run.average_window
        # A fresh run's starting point (parameters, versions, read time), scored once an island has stepped: off
        # the start-up's critical path, where the driver's scoring took CPU from the island processes starting.
        self._start: tuple[dict, list[int], float] | None = None

    def score(self, params: dict[str, torch.Tensor], *, versions: list[int], tokens: int, merged: float,
              wall_s: float, at: float) -> dict:
        """Evaluate `params` (fragment `versions`, read when `tokens` were processed and `merged` merged, a
        fragment mean) and record the point. `wall_s`/`at` are when the parameters were read, not when scoring
        them ended: the first evaluation in a process is slow (seconds under load), and the starting point must
        sort first."""
        assert self.evaluator is not None and self.events is not None, "a session's evaluations need its evaluator"
        loss, bpb = self.evaluator.evaluate(params)
        point = {"wall_s": wall_s, "at": at, "tokens_processed": tokens, "tokens_merged": merged,
                 "versions": versions, "eval_loss": loss, "eval_bits_per_byte": bpb}
        self.points.append(point)
        self.events.add("evals", [point])
        self.callbacks.eval(point)
        log.info("eval at %.0fs: loss %.4f, %.3f bits/byte (%d tokens processed)", point["wall_s"], loss, bpb, tokens)
        return point

    def loss(self, params: dict[str, torch.Tensor]) -> float:
        """The held-out loss of `params` on the same batches, recorded nowhere (the caller keeps it)."""
        assert self.evaluator is not None, "a session's evaluations need its evaluator"
        return self.evaluator.evaluate(params)[0]

    def hold_start(self, params: dict[str, torch.Tensor], fragments: int) -> None:
        """Keep a fresh run's seeded `params` (version 0 of every fragment), read now, for `score_start`."""
        self._start = (params, [0] * fragments, time.time())

    @property
    def start_pending(self) -> bool:
        """Whether a fresh run's starting point waits to be scored."""
        return self._start is not None

    def score_start(self) -> None:
        """Score a fresh run's starting point (and the corpus's unigram baseline) if not done yet. Its `wall_s`
        is 0 and `at` is when the islands were asked to start: the parameters are those the run seeded."""
        if self._start is None:
            return
        params, versions, at = self._start
        self._start = None
        # 0 tokens: a fresh run's seeded parameters (a resume scores its restored start at once).
        self.score(params, versions=versions, tokens=0, merged=0.0, wall_s=0.0, at=at)
        self.score_unigram()
        if self.unigram_bpb is not None:
            log.info("unigram baseline %.3f bits/byte", self.unigram_bpb)

    def score_unigram(self) -> None:
        """Fit and score the corpus's unigram baseline (`unigram_bpb`)."""
        assert self.data is not None, "a session's evaluations need its data"
        self.unigram_bpb = unigram_baseline(self.data)

    def target_reached(self, target: float | None) -> bool:
        """run.stop_at_eval_loss's rule (policies/stopping.py) on the points so far."""
        return target_reached([p["eval_loss"] for p in self.points], target)

    @property
    def last_bpb(self) -> float | None:
        """The latest point's bits per byte, None before the first."""
        return self.points[-1]["eval_bits_per_byte"] if self.points else None
