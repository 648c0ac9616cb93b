"""Ctrl-C and SIGTERM without Ray (issue 59, item 4): `diloco train`'s signal handler, the one stop request, the
driver's loop turning a KeyboardInterrupt into that stop, and the lines the command prints. The runs that stop
for real are in tests/integration/test_interrupt.py.
"""

from __future__ import annotations

import io
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from orchestrator.cli.interrupts import SignalStop, exit_code
from orchestrator.cli.train import _interrupted_before
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.run.callbacks import Callbacks
from orchestrator.run.driver import Run
from orchestrator.run.evaluations import RunEvaluations
from orchestrator.run.ledger import SessionLedger
from orchestrator.run.startup import StartupStages
from orchestrator.run.stopping import INTERRUPTED, STOP_REQUEST, RunInterrupted, StopRequest, resume_command, tick_stop
from orchestrator.run.summary import faults_cell


class _Exit(Exception):
    """What the handler's `exit` raises here in place of ending the test process."""


def _handler(stoppable: bool, *, run_dir: Path | None = None, hard_stop=None, hard_stop_s: float = 3.0):
    stop = StopRequest()
    stop.stoppable, stop.hard_stop = stoppable, hard_stop
    out = io.StringIO()

    def exit_now(code: int) -> None:
        raise _Exit(code)

    handler = SignalStop(stop, out=out, exit=exit_now, hard_stop_s=hard_stop_s)
    handler.run_dir = run_dir
    return handler, out


def test_the_first_signal_asks_the_clean_stop_and_says_so_in_one_line():
    handler, out = _handler(stoppable=True)
    handler(signal.SIGINT)  # returns: the driver's loop stops at its next tick
    assert handler.stop.reason == INTERRUPTED and handler.exit_code == 130
    assert out.getvalue() == ("diloco train: SIGINT: stopping cleanly (the islands' last progress merged, then a "
                              "checkpoint); Ctrl-C again exits at once\n")


def test_a_signal_while_the_run_starts_interrupts_the_start_up():
    handler, out = _handler(stoppable=False)
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGTERM)
    assert handler.exit_code == 143 and out.getvalue() == ""


@pytest.mark.parametrize("first, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_exits_at_once_with_the_first_signals_code(tmp_path, first, code):
    killed = []
    handler, out = _handler(stoppable=True, run_dir=tmp_path / "run", hard_stop=lambda: killed.append(1))
    handler(first)
    with pytest.raises(_Exit) as ended:
        handler(signal.SIGINT)
    assert ended.value.args == (code,) and killed == [1], "the run's actors on a cluster are killed first"
    last = out.getvalue().splitlines()[-1]
    assert last == (f"diloco train: SIGINT again: exiting now without a clean stop; {tmp_path / 'run'} may resume "
                    f"from its last checkpoint: diloco train --resume {tmp_path / 'run'}")


def test_the_hard_stop_is_bounded():
    """A kill that hangs (an unreachable cluster) does not hold the exit: it is waited for hard_stop_s at most."""
    handler, _ = _handler(stoppable=True, hard_stop=lambda: time.sleep(30), hard_stop_s=0.2)
    handler(signal.SIGINT)
    began = time.monotonic()
    with pytest.raises(_Exit):
        handler(signal.SIGINT)
    assert time.monotonic() - began < 10.0  # not the kill's 30 s


def test_exit_codes_are_the_shells():
    assert exit_code(signal.SIGINT) == 130 and exit_code(signal.SIGTERM) == 143


def test_a_stop_keeps_its_first_reason_and_the_resume_command_names_an_absolute_quoted_path(tmp_path, monkeypatch):
    stop = StopRequest()
    assert stop.ask(INTERRUPTED) is False, "not stoppable before the driver's loop runs"
    stop.stoppable = True
    assert stop.ask(STOP_REQUEST) is True and stop.reason == INTERRUPTED
    monkeypatch.chdir(tmp_path)
    assert resume_command("runs/my run") == f"diloco train --resume '{tmp_path}/runs/my run'"
    err = RunInterrupted("runs/r1", {"stopped_by": INTERRUPTED})
    assert isinstance(err, KeyboardInterrupt) and err.run_dir == tmp_path / "runs" / "r1"
    assert err.summary == {"stopped_by": INTERRUPTED} and resume_command(tmp_path / "runs" / "r1") in str(err)


def _bare_run(loop) -> tuple[Run, list]:
    """A Run without its set-up: `_loop` replaced by `loop`, `_finish` recording the reason it finished for."""
    run = Run.__new__(Run)
    run.stop, run.stopped_by, finished = StopRequest(), "token_budget", []
    run._setup = lambda: None
    run._loop = lambda t0: loop(run)
    run._finish = lambda t0: finished.append(run.stopped_by) or {"stopped_by": run.stopped_by}
    return run, finished


def test_a_keyboard_interrupt_in_the_loop_finishes_the_run_as_interrupted():
    """Ctrl-C under fit(): the loop's KeyboardInterrupt becomes the clean stop (the final flush and checkpoint in
    _finish), and train() then raises RunInterrupted."""
    def interrupted(run):
        assert run.stop.stoppable, "a stop asked from here on is a clean one"
        raise KeyboardInterrupt

    run, finished = _bare_run(interrupted)
    assert run.train() == {"stopped_by": INTERRUPTED} and finished == [INTERRUPTED]


def test_a_stop_asked_from_another_thread_keeps_its_reason():
    def loop(run):  # as _loop does at a tick once a stop is asked
        threading.Thread(target=run.request_stop).run()
        run.stopped_by = run.stop.reason or "token_budget"

    run, finished = _bare_run(loop)
    assert run.train()["stopped_by"] == STOP_REQUEST and finished == [STOP_REQUEST]


def test_the_loop_stops_at_the_tick_after_a_stop_is_asked():
    """_loop itself: a stop asked by a signal handler ends it at the next tick, before the budget."""
    run = Run.__new__(Run)
    run.cfg = build_config({"run": {"token_budget": 10**9}})
    run.stop, run.stopped_by, run.injector = StopRequest(), "token_budget", None
    run.evals = RunEvaluations(None, None, None, Callbacks(None, None))  # no starting point waits to be scored
    run.startup = StartupStages(None)
    run.run_id = "r"
    run.snapshot = {"slots": {}}
    run.ledger = SessionLedger(fragments=1)
    run.ledger.current = {"processed": [10]}
    ticks = []

    class _Outer:
        class _Call:
            def __init__(self, value):
                self.value = value

            def remote(self, *a, **kw):
                return self.value

        status = _Call({"versions": [0], "rounds": 0, "ledger": {}, "received": []})
        note = _Call(None)

    run.outer = _Outer()
    run._refresh = lambda: ticks.append(1) or (run.stop.ask(INTERRUPTED) if len(ticks) == 2 else None)
    run._get = lambda ref, timeout=None: ref
    run.ledger.account = lambda status, snapshot: run.ledger.current
    run.ledger.note = dict
    run._report = lambda *a: None
    run.metrics = type("M", (), {"record_status": lambda *a, **kw: None})()
    run._periodic = lambda t0, now, e, f, s: (e, f, False)
    run._loop(time.monotonic())
    assert len(ticks) == 2 and run.stopped_by == INTERRUPTED


def test_the_faults_line_says_an_interrupt_ended_the_run():
    assert faults_cell({"faults_planned": 4, "faults_injected": 1, "stopped_by": INTERRUPTED}) == (
        "1 of 4 planned (the run was interrupted first)")


def test_an_interrupted_start_up_names_the_resume_only_where_a_checkpoint_is(tmp_path):
    cfg = build_config({})
    run_dir = tmp_path / "run"
    assert _interrupted_before(run_dir, cfg) == "interrupted while starting, before every island trained; nothing to resume"
    assert _interrupted_before(None, None).endswith("nothing to resume")
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    assert _interrupted_before(run_dir, cfg).endswith("nothing to resume"), "a config.yaml but no checkpoint"
    CheckpointStore(str(run_dir / "checkpoints")).save(0, {"w": torch.zeros(1)}, {})
    assert _interrupted_before(run_dir, cfg) == f"interrupted while starting; resume with: diloco train --resume {run_dir}"


def test_the_tick_stop_rule_names_why_the_run_stops():
    kw = {"processed": 10, "budget": 100, "elapsed_s": 5.0, "max_wall_s": None}
    assert tick_stop(None, **kw) is None
    assert tick_stop(STOP_REQUEST, **kw) == STOP_REQUEST
    assert tick_stop(None, **{**kw, "processed": 100}) == "token_budget"
    assert tick_stop(INTERRUPTED, **{**kw, "processed": 100}) == INTERRUPTED, "a stop asked keeps its reason"
    assert tick_stop(None, **{**kw, "max_wall_s": 5.0}) == "max_wall_s"
    assert tick_stop(None, **{**kw, "max_wall_s": 6.0}) is None
