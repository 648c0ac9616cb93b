"""What `DilocoTrainer.fit()` shows by default while it trains: start-up stages and a progress line every few seconds.

The driver (orchestrator/run/driver.py) calls a progress callable with a `Progress` at every tick (about
twice a second) and a stages callable with each start-up `Stage` (orchestrator/run/startup.py).
:class:`ProgressPrinter` is both: it writes one line per start-up stage, then one progress line every
`every_s` seconds and one when the token budget is reached, as plain lines (a notebook or a log keeps
each), to stderr unless given a stream. Both losses are in one unit, as on `diloco train`'s bar and in its
final table: bits per byte for byte-level text (a token is a byte), else bits per token (the islands'
nats converted). `fit(progress=False)` silences it; a callable of one's own replaces it.

    start-up   1.4s  starting a local Ray
    progress  37%  1.11M/3.00M tokens | versions [21, 20] | rounds 41 | bits/byte: train 2.095, held-out 2.160 | 31s | islands 4 training
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["ProgressPrinter", "progress_fields", "progress_line", "stage_line"]


def progress_fields(p: Any) -> tuple[float, str, str]:
    """What every progress line shows of a `Progress` `p` (orchestrator.run.driver.Progress), `fit()`'s and
    `diloco train`'s bar alike: (fraction of the token budget, "versions ... | rounds ... | bits/UNIT: train X,
    held-out Y", "N training, ..." island states). Both losses in one unit: the islands' nats in bits."""
    unit = getattr(p, "unit", "token")
    frac = min(1.0, p.tokens / p.budget) if p.budget else 0.0
    states: dict[str, int] = {}
    for s in p.islands.values():
        states[s] = states.get(s, 0) + 1
    # Before the first loss (and the first evaluation) there is no number to show: "-", not "nan".
    train = "-" if p.train_loss is None else f"{p.train_loss / math.log(2):.3f}"
    held = "-" if p.eval_bpb is None else f"{p.eval_bpb:.3f}"
    islands = ", ".join(f"{n} {k}" for k, n in sorted(states.items())) or "-"
    return frac, f"versions {p.versions} | rounds {p.rounds} | bits/{unit}: train {train}, held-out {held}", islands


def stage_line(elapsed_s: float, s: Any) -> str:
    """One start-up stage (an orchestrator.run.startup.Stage) `elapsed_s` into the start, as `fit()` and `diloco
    train` print it, e.g. `start-up   3.1s  islands ready 2 of 4`."""
    return f"start-up {elapsed_s:5.1f}s  {s.text}"


def progress_line(p: Any) -> str:
    """One line for a `Progress` `p` (orchestrator.run.driver.Progress): tokens, versions, rounds, losses, islands."""
    frac, middle, islands = progress_fields(p)
    return (f"progress {frac:4.0%}  {p.tokens / 1e6:.2f}M/{p.budget / 1e6:.2f}M tokens | {middle} | "
            f"{p.elapsed_s:.0f}s | islands {islands}")


class ProgressPrinter:
    """The default `progress` of `DilocoTrainer.fit()`: start-up stages, then a progress line every `every_s` seconds.

    `stream`: where the lines go (default: ``sys.stderr`` at the time of each line, so a notebook shows them);
    `emulation`: a line written first (the EMULATION note of emulated pool speeds); `clock`: monotonic seconds.
    """

    def __init__(self, stream: TextIO | None = None, *, every_s: float = 10.0, emulation: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every_s < 0:
            raise ValueError(f"every_s={every_s} is negative; pass the seconds between progress lines (0: every tick)")
        self.stream, self.every_s, self.clock = stream, every_s, clock
        self._started = clock()
        self._last: float | None = None
        self._pending = emulation

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stderr
        if self._pending:
            stream.write(self._pending + "\n")
            self._pending = None
        stream.write(line + "\n")
        stream.flush()

    def stage(self, s: Any) -> None:
        """One line per start-up stage (an orchestrator.run.startup.Stage), e.g. `start-up   3.1s  islands ready 2 of 4`."""
        self._write(stage_line(self.clock() - self._started, s))

    def __call__(self, p: Any) -> None:
        """The progress line of `p` when `every_s` have passed since the last one, or the budget is reached."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s and p.tokens < p.budget:
            return
        self._last = now
        self._write(progress_line(p))
