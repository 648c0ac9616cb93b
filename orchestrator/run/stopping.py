"""Stopping a run before its budget: a request from another thread, Ctrl-C, SIGTERM. No Ray, no torch.

`tick_stop` is the driver loop's stop rule at each tick: a stop asked, the token budget, run.max_wall_s (the
held-out loss target, run.stop_at_eval_loss, is checked with each evaluation: orchestrator/run/evaluations.py).

There is one stop, whatever asks for it: `StopRequest.ask(reason)` ends the driver's loop at its next tick and
the run finishes as it does at the token budget (the islands stop with a final flush, the outer optimizer
merges what they sent and checkpoints, every token keeps its fate in the ledger, `summary.json`'s
`stopped_by` says why). A KeyboardInterrupt in the driver's loop (Ctrl-C under a notebook's `fit()`) asks the
same stop with reason INTERRUPTED, and `train()` then raises RunInterrupted, a KeyboardInterrupt.
`diloco train` turns SIGINT and SIGTERM into `ask(INTERRUPTED)` (orchestrator/cli/interrupts.py).
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

INTERRUPTED = "interrupted"
"""summary.json's `stopped_by` for a run stopped by Ctrl-C (KeyboardInterrupt), SIGINT or SIGTERM."""
STOP_REQUEST = "stop request"
"""summary.json's `stopped_by` for a run stopped by `Run.request_stop()` (another thread: a test, a notebook)."""


def tick_stop(asked: str | None, *, processed: int, budget: int, elapsed_s: float, max_wall_s: float | None) -> str | None:
    """Why the run stops at this tick, summary.json's `stopped_by`: the reason of a stop `asked`, "token_budget"
    once `processed` tokens reach `budget`, "max_wall_s" once `elapsed_s` reach it; None to go on."""
    if asked is not None or processed >= budget:
        return asked or "token_budget"
    if max_wall_s is not None and elapsed_s >= max_wall_s:
        log.warning("stopping on max_wall_s=%s before the token budget", max_wall_s)
        return "max_wall_s"
    return None


def resume_command(run_dir: str | Path) -> str:
    """The command that continues the run in `run_dir`: `diloco train --resume /absolute/run/dir`."""
    return f"diloco train --resume {shlex.quote(str(Path(run_dir).expanduser().resolve()))}"


class StopRequest:
    """A request that a run stop cleanly, shared by the driver and whoever asks (a signal handler, a thread).

    Setting plain attributes only, it is safe to use from a signal handler and from other threads.
    `stoppable` is set by the driver once its loop runs: before that there is nothing to stop cleanly, and the
    asker interrupts the start-up instead. `hard_stop`, set by the driver where the run's actors would outlive
    this process (a cluster it joined), kills them: what an exit without a clean stop does first.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self.stoppable = False
        self.hard_stop: Callable[[], object] | None = None

    def ask(self, reason: str = STOP_REQUEST) -> bool:
        """Ask the run to stop for `reason` (the first reason asked is kept). True when the run stops cleanly
        at its next tick (or is already stopping); False while it is still starting."""
        if self.reason is None:
            self.reason = reason
        return self.stoppable


class RunInterrupted(KeyboardInterrupt):
    """What `train()` (and so `DilocoTrainer.fit()`) raises after a run interrupted by Ctrl-C stopped cleanly.

    A KeyboardInterrupt, so a notebook cell or a script ends as on any Ctrl-C; `summary` is what the run wrote
    to summary.json (`stopped_by` "interrupted"), `run_dir` the run directory, which `--resume` continues.
    """

    def __init__(self, run_dir: str | Path, summary: dict) -> None:
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.summary = summary
        super().__init__(f"interrupted: the run stopped cleanly; its summary.json and last checkpoint are in "
                         f"{self.run_dir}; continue it with {resume_command(self.run_dir)} "
                         "(or DilocoTrainer(..., resume=True).fit() with the same run_dir)")
