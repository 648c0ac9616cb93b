"""Ray Tune: trials of DilocoTrainer under a Tuner, reporting their held-out losses, stopped cleanly (docs/tune.md).

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from orchestrator.tune import diloco_trainable

    tuner = tune.Tuner(
        diloco_trainable(base_config, run_root="runs/tune"),
        param_space={"outer.lr": tune.loguniform(0.1, 1.0), "outer.sync_every_steps": tune.choice([20, 40])},
        tune_config=tune.TuneConfig(scheduler=ASHAScheduler(time_attr="tokens", grace_period=200_000,
                                                            max_t=base_config.run.token_budget),
                                    metric="eval_loss", mode="min", max_concurrent_trials=1))
    results = tuner.fit()

Each trial is one run: its driver is the Tune trial actor, its islands, outer optimizer and health monitor the actors
that driver starts, as under ``fit()`` anywhere. The trial's ``config`` is a set of dotted overrides of the base
config (``{"outer.lr": 0.5}``, or nested ``{"outer": {"lr": 0.5}}``), checked as ``--set`` is. Every held-out
evaluation is reported to Tune (:class:`TuneReportCallback`): ``tokens`` (processed so far; the natural
``time_attr``), ``eval_loss``, ``eval_bits_per_byte``, the latest ``train_loss``, ``goodput``, ``rounds``, ..., and
``run_dir``.

How Tune stops a function trial, in Ray 2.60's source, and what this module does about it:

1. The scheduler's STOP sets the trial TERMINATED at once and asks the trial actor's ``stop`` task
   (tune/execution/tune_controller.py ``_schedule_trial_stop``, ``_remove_actor``); ``stop`` calls
   ``FunctionTrainable.cleanup``, which calls ``session.finish(timeout=0)``: it sets the session's stop event and
   releases the lock that ``tune.report`` waits on, and does not wait for the training thread
   (tune/trainable/function_trainable.py ``cleanup``; train/_internal/session.py ``finish``).
2. The training thread, blocked in ``tune.report`` since its last result, wakes up and raises ``sys.exit(0)``:
   a SystemExit inside ``tune.report`` (session.py ``_report_training_result``). Its thread runner swallows a
   SystemExit of code 0 (air/_internal/util.py ``RunnerThread.run``).
3. As soon as ``stop`` returns, Tune removes the trial's placement group (air/execution/_internal/actor_manager.py
   ``_cleanup_actor``, air/execution/resources/placement_group.py ``free_resources``), which kills the trial actor
   and with it the run's driver, in whatever it was doing: the islands (detached actors) would be left behind.

So :class:`TuneReportCallback` turns the SystemExit into the run's one clean stop (``request_stop(TUNE_STOPPED)``:
the islands' last progress merged, a final checkpoint, summary.json's ``stopped_by`` "tune", the islands and their
placement groups released), and the trainable that :func:`tune_trainable` builds makes ``cleanup`` ask that stop
too (a stop that comes while the run starts, or between reports) and wait for the run to end before it returns.
The trial thread then ends with SystemExit(0), as Tune's own stop does, and the trial stays TERMINATED.

Tune's patience with a ``stop`` that waits: ``TUNE_FORCE_TRIAL_CLEANUP_S`` (default 600 s) while the experiment
goes on; once every trial has finished (the last trial's STOP ends the experiment) it kills trial actors 10 s after
their stop was asked (``TuneController._actor_force_cleanup_timeout``, not configurable). A run's clean stop takes
a few seconds for the small models (1-6 s for nano on a loaded 2-core machine); a larger model's final flush and checkpoint
may take longer, so ``Tuner.fit()`` is followed by :func:`release_trials` (it kills what a killed trial left).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config import ConfigError, RunConfig, apply_overrides, build_config
from orchestrator.run.callbacks import Callback, RunInfo

__all__ = ["TRIAL_RESOURCES", "TUNE_STOPPED", "TuneReportCallback", "diloco_trainable", "release_trials",
           "trial_config", "tune_trainable"]

log = logging.getLogger(__name__)

TUNE_STOPPED = "tune"
"""summary.json's `stopped_by` for a run whose Tune trial was stopped (its scheduler, a stopper, the experiment's end)."""

TRIAL_RESOURCES: dict[str, float] = {"cpu": 0, "memory": 1}
"""What a trial's driver reserves: no CPU, as `diloco train`'s driver takes none; the islands reserve theirs in their
own placement groups. Tune needs a non-empty bundle, hence 1 byte of Ray's `memory` resource. With no CPU per trial,
Tune's own resource check no longer bounds how many trials run at once: set `max_concurrent_trials` to how many runs'
islands the cluster holds at once (its CPUs // one run's `cpus_per_island` x islands, spares included)."""

STOP_TIMEOUT_S = 600.0
"""How long a stopped trial's `cleanup` waits for its run's clean stop: Tune's own bound while the experiment goes
on (TUNE_FORCE_TRIAL_CLEANUP_S, 600 s by default in Ray 2.60)."""

# The latest `on_round` numbers that ride along with each evaluation's report (an evaluation has none of its own).
_ROUND_KEYS = ("train_loss", "goodput", "uptime", "rounds", "refusals", "bytes_sent", "tokens_in_flight",
               "tokens_lost", "tokens_refused")


class _TrialStop:
    """One trial's stop, shared in the trial actor's process by its `cleanup` (the actor's thread) and its run (the
    training thread): the reason asked, the run's `request_stop` once the run has started, and whether the trial's
    function has returned."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.done = threading.Event()
        self._request_stop: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def ask(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            request = self._request_stop
        if request is not None:
            request(reason)

    def attach(self, request_stop: Callable[[str], None]) -> None:
        """The run started: a stop asked before it (the trial stopped while it prepared) reaches it now."""
        with self._lock:
            self._request_stop, reason = request_stop, self.reason
        if reason is not None:
            request_stop(reason)


_TRIALS: dict[str, _TrialStop] = {}  # trial id -> its stop; only in a trial actor's process
_TRIALS_LOCK = threading.Lock()


def _trial_stop(trial_id: str | None) -> _TrialStop | None:
    """The stop of trial `trial_id` in this process (created on first use); None outside a trial."""
    if trial_id is None:
        return None
    with _TRIALS_LOCK:
        return _TRIALS.setdefault(trial_id, _TrialStop())


def _current_trial_id() -> str | None:
    """The Tune trial this thread runs in, None outside one (without Tune's warning for a call outside a session)."""
    from ray.train._internal.session import get_session
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    session = get_session()
    return session.trial_id if session is not None and _in_tune_session() else None


class TuneReportCallback(Callback):
    """Reports every held-out evaluation of the run to Ray Tune (``ray.tune.report``), and stops the run cleanly
    when Tune stops its trial.

    Each report: the evaluation's metrics (``tokens``, ``eval_loss``, ``eval_bits_per_byte``, ``tokens_merged``,
    ``versions``, ``wall_s``), the latest flush's ``train_loss``, ``goodput``, ``uptime``, ``rounds``, ... when
    there was one, and the run's ``run_dir`` and ``run_id``. ``tune.report`` blocks until Tune takes the result (the
    islands train on meanwhile). When Tune has stopped the trial it raises SystemExit there; this callback then asks
    the run's clean stop (`TUNE_STOPPED`) and reports nothing more. Use it inside a trainable made by
    :func:`tune_trainable` (or :func:`diloco_trainable`), whose stop waits for the run to finish; outside a Tune
    trial it does nothing.
    """

    def __init__(self) -> None:
        self._trial = _trial_stop(_current_trial_id())
        self._round: dict[str, Any] = {}
        self.stopped = False

    def on_start(self, run: RunInfo) -> None:
        """Hand the run's clean stop to the trial's `cleanup`."""
        if self._trial is not None:
            self._trial.attach(run.request_stop)

    def on_round(self, run: RunInfo, metrics: dict) -> None:
        """Keep the flush's numbers for the next report."""
        self._round = {k: metrics[k] for k in _ROUND_KEYS if k in metrics}

    def on_eval(self, run: RunInfo, metrics: dict) -> None:
        """Report the evaluation to Tune; a SystemExit there (Tune stopped the trial) becomes the run's clean stop."""
        if self._trial is None or self.stopped or self._trial.reason is not None:
            return  # after a stop the session is closed: a report would warn, or wait for a lock no one releases
        from ray import tune

        result = {**self._round, **metrics, "run_dir": str(run.run_dir), "run_id": run.run_id}
        try:
            tune.report(result)
        except SystemExit:  # Ray 2.60: sys.exit(0) in the report once the trial's stop event is set
            self.stopped = True
            self._trial.ask(TUNE_STOPPED)
            run.request_stop(TUNE_STOPPED)


def trial_config(base: RunConfig, config: Mapping[str, Any]) -> RunConfig:
    """`base` with a trial's `config` applied: dotted keys (``{"outer.lr": 0.5, "pools.slow.islands": 3}``) or nested
    dicts (``{"outer": {"lr": 0.5}}``), checked as ``--set`` overrides are (a one-line ConfigError for an unknown
    field, a bad value or a setting without effect). Tune's own keys in `config` are none of ours: pass the
    search space's keys only."""
    if not isinstance(base, RunConfig):
        raise ConfigError(f"the base config is a {type(base).__name__}; pass an orchestrator.RunConfig")
    overrides = [f"{key}={_yaml_value(value)}" for key, value in _flatten(config)]
    if not overrides:
        return base
    return build_config(apply_overrides(base.model_dump(mode="json"), overrides))


def _flatten(config: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{path}.")
        else:
            yield path, value


def _yaml_value(value: Any) -> str:
    """`value` as the YAML text an override parses back to it (numpy scalars from a search space as Python's)."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip()
    return text.removesuffix("\n...").strip()


def _run_trial(fn: Callable[[dict], Any], config: dict) -> Any:
    """The body of a trial of `tune_trainable(fn)`, in its training thread."""
    from ray import tune

    stop = _trial_stop(tune.get_context().get_trial_id())
    try:
        out = fn(config)
    finally:
        if stop is not None:
            stop.done.set()
    if stop is not None and stop.reason is not None:
        # Tune closed this trial's session: a return would report to a session that is gone. SystemExit(0) is how
        # Tune's own stop ends a trial's thread, quietly.
        raise SystemExit(0)
    return out


def _stop_trial(trial_id: str, cleanup: Callable[[], None], timeout_s: float) -> None:
    """A trial's `cleanup` (the trial actor's thread): ask its run's clean stop, let Tune's own cleanup release the
    report the training thread waits in (SystemExit there), then wait for the trial's function to return."""
    stop = _trial_stop(trial_id)
    assert stop is not None
    stop.ask(TUNE_STOPPED)  # also reaches a run still starting, or between two reports
    started = time.monotonic()
    try:
        cleanup()
    finally:
        ended = stop.done.wait(timeout_s)
        with _TRIALS_LOCK:
            _TRIALS.pop(trial_id, None)
        if ended:
            log.info("trial %s: its run stopped in %.1f s", trial_id, time.monotonic() - started)
        else:
            log.warning("trial %s: its run did not stop within %.0f s", trial_id, timeout_s)


def tune_trainable(fn: Callable[[dict], Any], *, resources: Mapping[str, float] | None = None,
                   stop_timeout_s: float = STOP_TIMEOUT_S) -> type:
    """A Tune trainable (a class for ``tune.Tuner``) running `fn(config)`, a function that runs DilocoTrainer with a
    :class:`TuneReportCallback`, whose trials stop cleanly.

    When Tune stops a trial, its `cleanup` asks the run to stop (`TUNE_STOPPED`) and waits, up to `stop_timeout_s`,
    until `fn` has returned: the run's final flush, checkpoint, summary.json and the release of its islands and
    placement groups happen before Tune removes the trial's actor. The trial then ends TERMINATED. `resources`: the
    trial actor's (``tune.with_resources``), by default `TRIAL_RESOURCES` (no CPU). Trial actors are never reused
    (``reuse_actors`` has no effect): a run's driver is not reset in place.
    """
    from ray import tune
    from ray.tune.trainable.function_trainable import wrap_function

    def diloco_trial(config: dict) -> Any:
        return _run_trial(fn, config)

    name = getattr(fn, "__name__", "")
    diloco_trial.__name__ = name if name.isidentifier() else "diloco"  # the trials' names: <name>_<trial id>

    class DilocoTrial(wrap_function(diloco_trial)):  # type: ignore[misc]
        """A function trainable whose stop waits for its run's clean stop."""

        def cleanup(self) -> None:
            _stop_trial(self.trial_id, super().cleanup, stop_timeout_s)

        def reset_config(self, new_config: dict) -> bool:
            return False  # no actor reuse: a run's driver ends with its trial

    DilocoTrial.__name__ = DilocoTrial.__qualname__ = diloco_trial.__name__
    return tune.with_resources(DilocoTrial, dict(resources if resources is not None else TRIAL_RESOURCES))


def diloco_trainable(run_config: RunConfig | None = None, *, model: Callable[[], Any] | str | None = None,
                     datasets: Mapping[str, Any] | None = None, loss_fn: Callable[..., Any] | str | None = None,
                     optimizer: Callable[..., Any] | str | None = None,
                     outer_optimizer: Callable[..., Any] | str | None = None,
                     callbacks: Sequence[Callback] | None = None, run_root: str | Path | None = None,
                     resources: Mapping[str, float] | None = None, stop_timeout_s: float = STOP_TIMEOUT_S) -> type:
    """The Tune trainable of DilocoTrainer runs: each trial trains `model` on `datasets` (DilocoTrainer's arguments)
    with `run_config` plus the trial's config as overrides (:func:`trial_config`), in its own run directory
    ``run_root/<trial name>``, reporting every held-out evaluation to Tune and stopping cleanly (:func:`tune_trainable`).

    `run_root`: where the trials' run directories go, resolved now, in this process (default ``runs/tune-<time>``);
    on a cluster, a path the trials' nodes share. A trial run again (``Tuner.restore``, a retried failure) resumes its
    run from its newest checkpoint. `callbacks`: run callbacks of every trial, after the Tune report. No progress is
    printed (a trial's stderr is Tune's log). A trial's last result in Tune is its last evaluation (the final one,
    for a run that reached its budget); its summary.json is in ``result.metrics["run_dir"]``.
    """
    from orchestrator.api import DilocoTrainer
    from orchestrator.run.callbacks import check_callbacks

    base = run_config if run_config is not None else RunConfig()  # type: ignore[call-arg]  # pydantic defaults (no mypy plugin here)
    if not isinstance(base, RunConfig):
        raise ConfigError(f"run_config is a {type(base).__name__}; pass an orchestrator.RunConfig")
    check_callbacks(callbacks)
    root = Path(run_root if run_root is not None else Path("runs") / time.strftime("tune-%Y%m%d-%H%M%S"))
    root = root.expanduser().resolve()
    extra = list(callbacks or ())

    def diloco(config: dict) -> None:
        from ray import tune

        cfg = trial_config(base, config)
        run_dir = root / tune.get_context().get_trial_name()
        resume = (run_dir / "run.json").is_file()  # this trial ran before: continue its run
        DilocoTrainer(model, datasets=datasets, loss_fn=loss_fn, optimizer=optimizer, outer_optimizer=outer_optimizer,
                      run_config=cfg, run_dir=run_dir, progress=False, resume=resume,
                      callbacks=[TuneReportCallback(), *extra]).fit()

    return tune_trainable(diloco, resources=resources, stop_timeout_s=stop_timeout_s)


def release_trials(results: Any) -> int:
    """Kill whatever the runs of a finished Tuner's trials left on the cluster (their islands, keepers and placement
    groups), and return how many actors and groups that was: nothing after clean stops. Needed only where Tune
    killed a trial's driver before its run stopped (its 10 s at the experiment's end, a node lost).
    `results`: the ``ResultGrid`` of ``Tuner.fit()``, or its ``Result`` objects."""
    from orchestrator.run.setup import kill_run_actors

    n = 0
    for result in results:
        run_id = (result.metrics or {}).get("run_id")
        if run_id:
            n += kill_run_actors(str(run_id))
    return n
