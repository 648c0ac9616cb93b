"""Callbacks: user code the driver calls as a run goes (Ray Train's shape), and the metrics they are handed.

    class Printer(Callback):
        def on_eval(self, run, metrics):
            print(run.run_id, metrics["tokens"], metrics["eval_loss"])

    DilocoTrainer(..., callbacks=[Printer()]).fit()

Every hook runs in the driver's thread, at the place where the driver already has the numbers: an evaluation
(`on_eval`), the flush every ~5 s that drains the rounds merged since the last one (`on_round`), an island's state
change in the health monitor's timeline (`on_island_event`) and the end (`on_end`, with what summary.json holds).
No number is counted twice: token counts are the run's one ledger (orchestrator/core/accounting.py), as the
progress line, the Prometheus metrics and the summary show it. A hook that raises is logged once (per hook and
callback) and the run goes on; a BaseException that is not an Exception (KeyboardInterrupt, SystemExit) is not
caught. The built-in experiment trackers (MLflow, TensorBoard, W&B) are callbacks too: orchestrator/run/trackers.py.
No Ray here: the dispatch is plain Python, tested without a cluster (tests/engine/test_callbacks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config import ConfigError, RunConfig
from orchestrator.core.accounting import FATES, shown_fates
from orchestrator.run.stopping import INTERRUPTED
from policies.island_states import IslandState

__all__ = ["Callback", "Callbacks", "RunInfo", "check_callbacks", "eval_metrics", "island_event_kind", "mean_train_loss", "round_metrics"]

log = logging.getLogger(__name__)

FAILED = "failed"
"""`stopped_by` of the summary `on_end` gets when the run raised before it could write summary.json."""

# Timeline states (the health monitor's) that are island events, and the event kind each one is.
ISLAND_EVENTS = {IslandState.DEAD: "failure", IslandState.RESTARTING: "restart", IslandState.REINTEGRATING: "reintegration"}


@dataclass(frozen=True)
class RunInfo:
    """The run a hook is called for.

    `run_dir` is absolute; `run_id` is this driver session's (`RUN_DIR name-6 hex`: a resumed run gets a new one);
    `config` the run's resolved RunConfig (as config.yaml records it); `resumed` whether this session continues an
    earlier one (`--resume`); `request_stop(reason)` asks the run to stop cleanly at its next tick, as the token
    budget does (the islands' last progress merged, a checkpoint), `reason` becoming summary.json's `stopped_by`.
    """

    run_dir: Path
    run_id: str
    config: RunConfig
    resumed: bool
    request_stop: Callable[[str], None]


class Callback:
    """Override any hook; every hook is called in the driver's thread; an exception in a hook is logged once per
    hook and callback and never stops the run, EXCEPT BaseException that is not Exception (SystemExit,
    KeyboardInterrupt) which propagates. The metrics' keys are in docs/api.md (Callbacks)."""

    def on_start(self, run: RunInfo) -> None:
        """The run starts (before its islands are placed; a resumed run's restored starting point is scored after)."""

    def on_eval(self, run: RunInfo, metrics: dict) -> None:
        """After each held-out evaluation of the global model (the starting point, every eval.interval_s, the end)."""

    def on_round(self, run: RunInfo, metrics: dict) -> None:
        """At each flush (every ~5 s) with the rounds merged since the last, and once at the end with the final counts."""

    def on_island_event(self, run: RunInfo, event: dict) -> None:
        """An island failed (`kind` "failure"), is restarting ("restart") or reintegrating ("reintegration")."""

    def on_end(self, run: RunInfo, summary: dict) -> None:
        """The run ended: `summary` is what summary.json holds (also when it stopped early: max_wall_s, a stop asked,
        interrupted); a run that raised first gets `{"stopped_by": "failed", "error": "<one line>"}` ("interrupted" for a
        KeyboardInterrupt that stopped it at once)."""


def check_callbacks(callbacks: Sequence[Any] | None) -> None:
    """Raise ConfigError (one line) unless `callbacks` is None or a sequence of Callback instances."""
    if callbacks is None:
        return
    if isinstance(callbacks, (Callback, str)) or not isinstance(callbacks, Sequence):
        raise ConfigError(f"callbacks is a {type(callbacks).__name__}; pass a list of "
                          "orchestrator.run.callbacks.Callback instances, e.g. callbacks=[MLflowCallback()]")
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise ConfigError(f"callbacks holds a {type(cb).__name__}; each must be an instance of a subclass of "
                              "orchestrator.run.callbacks.Callback (a class, not called, is not one)")


def mean_train_loss(statuses: Iterable[Any]) -> float | None:
    """The islands' latest training losses (IslandStatus.train_loss), averaged; None before the first."""
    losses = [s.train_loss for s in statuses if s.train_loss is not None]
    return sum(losses) / len(losses) if losses else None


def eval_metrics(point: Mapping[str, Any]) -> dict:
    """What `on_eval` gets from one evaluation point (the driver's `eval_points` entry)."""
    return {"tokens": int(point["tokens_processed"]), "eval_loss": point["eval_loss"],
            "eval_bits_per_byte": point["eval_bits_per_byte"], "versions": int(sum(point["versions"])),
            "tokens_merged": point["tokens_merged"], "wall_s": point["wall_s"]}


def round_metrics(*, ledger: Mapping[str, Sequence[int]], status: Mapping[str, Any], statuses: Iterable[Any],
                  new_rounds: int, wall_s: float, goodput: float | None = None, uptime: float | None = None) -> dict:
    """What `on_round` gets: the run's token ledger as shown everywhere (`shown_fates`: whole tokens that add up to
    processed), the outer optimizer's `status` (versions, rounds, refusals, bytes), the islands' last `statuses`
    (their training loss), the rounds drained since the last call, and goodput/uptime so far when known."""
    shown = shown_fates(ledger)
    out: dict[str, Any] = {"tokens": shown["processed"], **{f"tokens_{fate}": shown[fate] for fate in FATES},
                           "versions": int(sum(status.get("versions", []))), "rounds": int(status.get("rounds", 0)),
                           "new_rounds": int(new_rounds), "refusals": int(status.get("refusals", 0)),
                           "bytes_sent": int(status.get("bytes_up", 0)) + int(status.get("bytes_down", 0)),
                           "wall_s": wall_s}
    for key, value in (("train_loss", mean_train_loss(statuses)), ("goodput", goodput), ("uptime", uptime)):
        if value is not None:
            out[key] = value
    return out


def island_event_kind(state: str) -> str | None:
    """The island event a timeline state is ("failure", "restart", "reintegration"), None for the others."""
    return ISLAND_EVENTS.get(state)


class Callbacks:
    """The run's callbacks, called as one: each hook of each callback in order, each failure logged once.

    `start/eval/round/island_events/end` are what the driver calls; with no callbacks each returns at once (a
    run without callbacks pays nothing). `end` is called once at most; `fail` ends a run that raised (and is a
    no-op after `end`), so that a tracker never leaves its run open.
    """

    def __init__(self, callbacks: Sequence[Callback] | None, info: RunInfo | None) -> None:
        check_callbacks(callbacks)
        if callbacks and info is None:
            raise ValueError("callbacks need the RunInfo they are called with")
        self.callbacks = list(callbacks or ())
        self.info = info
        self.started = self.ended = False
        self._failed: set[tuple[int, str]] = set()  # (callback index, hook) already logged
        self._timeline_seen: set[tuple] = set()

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook: str, *args: Any) -> None:
        for i, cb in enumerate(self.callbacks):
            try:
                getattr(cb, hook)(self.info, *args)
            except Exception as err:  # noqa: BLE001 - a callback never stops the run
                if (i, hook) in self._failed:
                    log.debug("%s.%s failed again: %s", type(cb).__name__, hook, err)
                else:
                    self._failed.add((i, hook))
                    log.warning("callback %s.%s failed (the run goes on; later failures of this hook are not logged): %s",
                                type(cb).__name__, hook, _first_line(err), exc_info=True)

    def start(self) -> None:
        """Call every `on_start`."""
        if self.callbacks and not self.started:
            self.started = True
            self._call("on_start")

    def eval(self, point: Mapping[str, Any]) -> None:
        """Call every `on_eval` with an evaluation point's metrics (`eval_metrics`)."""
        if self.callbacks:
            self._call("on_eval", eval_metrics(point))

    def round(self, **kwargs: Any) -> None:
        """Call every `on_round` with `round_metrics(**kwargs)`."""
        if self.callbacks:
            self._call("on_round", round_metrics(**kwargs))

    def island_events(self, snapshot: Mapping[str, Any], tokens: int) -> None:
        """Call `on_island_event` for each island event in the health monitor's `snapshot` timeline not seen yet.

        Each event: kind, island, pool, incarnation, state, at (wall time), tokens (processed so far); a failure also
        carries its detection's `failure_kind` and `reason` where the monitor recorded one."""
        if not self.callbacks:
            return
        slots = snapshot.get("slots", {})
        for entry in snapshot.get("timeline", []):
            at, island, incarnation, state = entry
            key = (at, island, incarnation, state)
            if key in self._timeline_seen:
                continue
            self._timeline_seen.add(key)
            kind = island_event_kind(state)
            if kind is None:
                continue
            slot = slots.get(island) or slots.get(str(island)) or {}
            event = {"kind": kind, "island": island, "pool": slot.get("pool"), "incarnation": incarnation,
                     "state": state, "at": at, "tokens": tokens}
            if kind == "failure":
                found = [d for d in snapshot.get("detections", [])
                         if d.get("island") == island and d.get("incarnation") == incarnation]
                if found:
                    event.update(failure_kind=found[-1].get("kind"), reason=found[-1].get("reason"))
            self._call("on_island_event", event)

    def end(self, summary: dict) -> None:
        """Call every `on_end` with the run's summary, once."""
        if self.callbacks and self.started and not self.ended:
            self.ended = True
            self._call("on_end", summary)

    def fail(self, err: BaseException | None) -> None:
        """End a started run that raised `err` (None: it did not finish, cause unknown) before `end` was called:
        `stopped_by` "failed", or "interrupted" for a KeyboardInterrupt (a second Ctrl-C, a start-up abandoned)."""
        why = "the run did not finish" if err is None else f"{type(err).__name__}: {_first_line(err)}"
        self.end({"stopped_by": INTERRUPTED if isinstance(err, KeyboardInterrupt) else FAILED, "error": why})


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__
