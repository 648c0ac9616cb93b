"""`diloco train` on SIGINT (Ctrl-C) and SIGTERM (`kill`, `ray job stop`): the first stops the run cleanly, a
second exits at once.

The first signal asks the run's one stop (orchestrator/run/stopping.py): the islands flush, the outer optimizer
merges and checkpoints, summary.json says "interrupted", and the command ends with one line naming
`diloco train --resume RUN_DIR`. Before the run trains there is nothing to stop cleanly: the signal interrupts
the start-up (KeyboardInterrupt, which the command turns into one line). A second signal exits at once, without
a clean stop. Exit codes follow the shell's 128 + signal number: 130 after SIGINT, 143 after SIGTERM, so a
caller (a shell, systemd, Kubernetes, Ray Jobs) can tell which signal ended the run.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TextIO

from orchestrator.run.stopping import INTERRUPTED, StopRequest, resume_command

SIGNALS = (signal.SIGINT, signal.SIGTERM)
HARD_STOP_S = 3.0
"""How long a second signal waits for the run's actors to be killed (a cluster run) before it exits anyway."""


def exit_code(signum: int) -> int:
    """The exit code after signal `signum`, as a shell reports a process it ended: 128 + the signal number."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    """`SIGINT`, `SIGTERM`, ... for a signal number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SignalStop:
    """The signal handler of `diloco train`: the first SIGINT or SIGTERM asks `stop` for a clean stop, a
    second exits the process at once (`exit`, os._exit by default: no cleanup that could hang)."""

    def __init__(self, stop: StopRequest, *, out: TextIO | None = None, exit: Callable[[int], object] = os._exit,
                 hard_stop_s: float = HARD_STOP_S) -> None:
        self.stop = stop
        self.out = out
        self.exit = exit
        self.hard_stop_s = hard_stop_s
        self.run_dir: Path | None = None  # once known: the lines name the resume command
        self.received: list[int] = []

    @property
    def exit_code(self) -> int:
        """The command's exit code after the first signal it received (130 if none: a KeyboardInterrupt)."""
        return exit_code(self.received[0]) if self.received else exit_code(signal.SIGINT)

    def install(self) -> None:
        """Handle SIGINT and SIGTERM in this process (call from the main thread)."""
        for sig in SIGNALS:
            signal.signal(sig, self)

    def reinstall_sigterm(self) -> None:
        """Handle SIGTERM again: `ray.init` installs its own handler (it exits), after `install`."""
        signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: FrameType | None = None) -> None:
        """First signal: a clean stop (or, while the run starts, a KeyboardInterrupt); second: exit now."""
        self.received.append(signum)
        if len(self.received) == 1:
            if not self.stop.ask(INTERRUPTED):
                raise KeyboardInterrupt  # still starting: the start-up is abandoned (train() cleans up)
            again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
            self._say(f"{signal_name(signum)}: stopping cleanly (the islands' last progress merged, then a "
                      f"checkpoint); {again} exits at once")
            return
        where = (f"{self.run_dir} may resume from its last checkpoint: {resume_command(self.run_dir)}"
                 if self.run_dir is not None else "nothing was stopped cleanly")
        self._say(f"{signal_name(signum)} again: exiting now without a clean stop; {where}")
        self._hard_stop()
        self.exit(self.exit_code)

    def _hard_stop(self) -> None:
        """Kill the run's actors where they would outlive this process, bounded: an exit must not hang on it."""
        if self.stop.hard_stop is None:
            return
        worker = threading.Thread(target=self._quietly, args=(self.stop.hard_stop,), daemon=True)
        worker.start()
        worker.join(self.hard_stop_s)

    @staticmethod
    def _quietly(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort on the way out: a resume kills what is left
            pass

    def _say(self, text: str) -> None:
        out = self.out or sys.stderr
        # A terminal's progress bar redraws its line in place: start on a fresh line, which the bar then leaves.
        lead = "\n" if getattr(out, "isatty", lambda: False)() else ""
        out.write(f"{lead}diloco train: {text}\n")
        out.flush()
