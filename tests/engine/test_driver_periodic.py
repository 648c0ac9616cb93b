"""The driver's periodic evaluation and event drain survive an outer optimizer that is restarting.

An outer-optimizer kill can land between the loop's status call and the evaluation's call for the global
parameters; Ray then raises ActorUnavailableError for a call that may or may not have run. That once failed a
whole run (a clean-clone CI run of test_self_healing). The evaluation must stay due and run at the next tick.
No Ray here: a Run without its set-up, with recording stand-ins for the calls it makes.
"""

from __future__ import annotations

from ray.exceptions import ActorUnavailableError

from orchestrator.config import build_config
from orchestrator.run.callbacks import Callbacks
from orchestrator.run.driver import Run
from orchestrator.run.evaluations import RunEvaluations
from orchestrator.run.ledger import SessionLedger


class _Recorder:
    def __init__(self) -> None:
        self.calls = 0

    def flush(self) -> None:
        self.calls += 1

    def record_goodput_so_far(self, fetch, **_) -> None:
        self.calls += 1


def _run(fail_evals: int, fail_drains: int = 0) -> Run:
    run = Run.__new__(Run)  # no set-up: only what _periodic touches
    run.cfg = build_config({"eval": {"interval_s": 10.0}})
    run.events, run.metrics = _Recorder(), _Recorder()
    run.evals = RunEvaluations(None, None, None, Callbacks(None, None))  # its points: what _evaluate recorded
    run.ledger = SessionLedger(fragments=1)
    run.outer = run.snapshot = run.run_start = None
    run.stopped_by = None
    left = {"eval": fail_evals, "drain": fail_drains}

    def flaky(kind: str, point=None):
        if left[kind] > 0:
            left[kind] -= 1
            raise ActorUnavailableError("The actor was restarted.", None)
        if point is not None:
            run.evals.points.append(point)

    run._evaluate = lambda t0: flaky("eval", {"eval_loss": 3.0})
    run._drain_events = lambda: flaky("drain")
    return run


def test_a_failed_evaluation_stays_due_and_runs_at_the_next_tick():
    run = _run(fail_evals=1)
    next_eval, next_flush, stop = run._periodic(0.0, 10.0, 10.0, 100.0, {})
    assert (next_eval, next_flush, stop) == (10.0, 100.0, False) and run.evals.points == []
    next_eval, next_flush, stop = run._periodic(0.0, 10.5, next_eval, next_flush, {})
    assert (next_eval, stop) == (20.5, False) and run.evals.points == [{"eval_loss": 3.0}]


def test_a_failed_drain_stays_due_and_nothing_after_it_runs():
    run = _run(fail_evals=0, fail_drains=1)
    next_eval, next_flush, stop = run._periodic(0.0, 5.0, 100.0, 5.0, {})
    assert next_flush == 5.0 and not stop and run.events.calls == 0 and run.metrics.calls == 0
    next_eval, next_flush, stop = run._periodic(0.0, 5.5, next_eval, next_flush, {})
    assert next_flush == 10.5 and run.events.calls == 1 and run.metrics.calls == 1


def test_the_eval_target_still_stops_the_run():
    run = _run(fail_evals=0)
    run.cfg = build_config({"eval": {"interval_s": 10.0}, "run": {"stop_at_eval_loss": 3.5}})
    run.evals.points = [{"eval_loss": 3.2}]  # the rule wants two evaluations at or below the target in a row
    _, _, stop = run._periodic(0.0, 10.0, 10.0, 100.0, {})
    assert stop and run.stopped_by == "stop_at_eval_loss"
