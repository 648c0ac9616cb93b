"""Experiment trackers as run callbacks: MLflow, TensorBoard, Weights & Biases (docs/trackers.md).

    DilocoTrainer(..., callbacks=[MLflowCallback("http://host:5000")]).fit()
    diloco train --tracker mlflow:http://host:5000 --tracker tensorboard       # or run.trackers in the config

Each logs the run's config, its held-out loss and bits per byte, training loss, goodput, uptime, versions, rounds,
refusals, bytes sent and token fates (orchestrator/run/callbacks.py says what each is) against tokens processed,
and its island events. Their packages are the `trackers` extra, imported only when a tracker starts: the engine
needs none of them, and a tracker that is not installed is refused before Ray starts (preflight) or when its
callback is built, in one line that says what to install.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config import TRACKERS, ConfigError, RunConfig, tracker_spec
from orchestrator.run.callbacks import FAILED, Callback, RunInfo

__all__ = ["MLflowCallback", "TensorBoardCallback", "WandbCallback", "check_installed", "config_trackers",
           "flat_config", "tracker_status"]

log = logging.getLogger(__name__)

INSTALL = 'pip install -c constraints-cpu.txt -e ".[trackers]"'
"""How to install every tracker's package (the project's `trackers` extra, with the CPU torch kept)."""

# The module each tracker imports: TensorBoard's writer is torch's, which needs the tensorboard package.
_PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}

# stopped_by values of a run that ended by its own stop rules: its tracker runs are finished, not killed.
_OWN_STOPS = ("token_budget", "stop_at_eval_loss", "max_wall_s")

MLFLOW_PARAM_LIMIT = 6000
"""MLflow's longest param value (characters, MLflow 2.x/3.x); longer config values are cut to it, and marked."""


def _missing(tracker: str) -> str | None:
    """Why `tracker`'s package cannot be imported here (one line), None when it can. Imports nothing."""
    if importlib.util.find_spec(_PACKAGES[tracker]) is None:
        return f"{tracker} is not installed; {INSTALL}"
    return None


def _require(tracker: str) -> None:
    why = _missing(tracker)
    if why is not None:
        raise ImportError(why)


def check_installed(cfg: RunConfig) -> None:
    """Raise ConfigError (one line) for the first tracker of `cfg.run.trackers` whose package is not installed."""
    for entry in cfg.run.trackers:
        why = _missing(tracker_spec(entry)[0])
        if why is not None:
            raise ConfigError(f"run.trackers: {why}")


def config_trackers(entries: Sequence[str]) -> list[Callback]:
    """The callbacks `run.trackers` names: "mlflow[:URI]", "tensorboard[:DIR]", "wandb[:PROJECT]" (W&B's mode is
    $WANDB_MODE, else offline)."""
    out: list[Callback] = []
    for entry in entries:
        name, arg = tracker_spec(entry)
        if name == "mlflow":
            out.append(MLflowCallback(tracking_uri=arg))
        elif name == "tensorboard":
            out.append(TensorBoardCallback(log_dir=arg))
        else:
            out.append(WandbCallback(project=arg or "diloco", mode=os.environ.get("WANDB_MODE") or "offline"))
    assert len(TRACKERS) == 3, "a new tracker needs its branch above"
    return out


def tracker_status(summary: Mapping[str, Any]) -> str:
    """The tracker run's end state for a run's `summary`: FINISHED when its own stop rule ended it (the token
    budget, stop_at_eval_loss, max_wall_s), FAILED when it raised, KILLED when it was stopped (interrupted, asked)."""
    stopped_by = summary.get("stopped_by")
    if stopped_by in _OWN_STOPS:
        return "FINISHED"
    return "FAILED" if stopped_by == FAILED else "KILLED"


def flat_config(cfg: RunConfig) -> dict[str, str]:
    """The config as dotted keys and text values, as `--set` spells them: `outer.lr`, `pools.fast.islands`
    (a pool by its name), lists of plain values and empty sections as JSON."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{v.get('name', i)}", v)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", cfg.model_dump(mode="json"))
    return out


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a tracker logs: the numeric ones (not `tokens`, which is the step)."""
    return {k: float(v) for k, v in metrics.items()
            if k != "tokens" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Events:
    """Island events counted per kind (failures, restarts, reintegrations), and kept for an events.jsonl."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.events: list[dict] = []

    def add(self, event: dict) -> dict[str, float]:
        """Count `event`; returns the counter metric it moved, e.g. {"island_failures": 2.0}."""
        self.events.append(event)
        kind = str(event.get("kind"))
        self.counts[kind] = self.counts.get(kind, 0) + 1
        return {f"island_{kind}s": float(self.counts[kind])}

    def jsonl(self) -> str:
        return "".join(json.dumps(e, default=str) + "\n" for e in self.events)


class _Tracker(Callback):
    """What the three trackers share: every number of an evaluation or a flush, and the island events' counters,
    logged against tokens by `_log` (each tracker's own write)."""

    def __init__(self) -> None:
        self._events = _Events()

    def _log(self, values: Mapping[str, float], tokens: int) -> None:
        raise NotImplementedError

    def on_eval(self, run: RunInfo, metrics: dict) -> None:
        self._log(_numbers(metrics), metrics["tokens"])

    def on_round(self, run: RunInfo, metrics: dict) -> None:
        self._log(_numbers(metrics), metrics["tokens"])

    def on_island_event(self, run: RunInfo, event: dict) -> None:
        self._log(self._events.add(event), event.get("tokens", 0))


class MLflowCallback(_Tracker):
    """Log the run to MLflow: one MLflow run per driver session, in experiment `experiment`.

    `tracking_uri`: an MLflow tracking server (``http://host:5000``) or store URI; None: $MLFLOW_TRACKING_URI,
    else a SQLite store in the run directory (``sqlite:///RUN_DIR/mlflow.db``, artifacts in RUN_DIR/mlartifacts:
    ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``). Params: the flattened config (values longer
    than MLflow's 6000 characters cut, ending "...[truncated]"); tags: run_id, run_dir, resumed, mode. Metrics with
    step = tokens processed: every key of `on_eval` and `on_round`, and island_failures / island_restarts /
    island_reintegrations counters; at the end, the artifacts events.jsonl (every island event) and summary.json,
    the final checkpoint directory (under checkpoint/) when `log_checkpoint`, and the status FINISHED (the run's
    own stop rule), KILLED (interrupted, a stop asked) or FAILED.
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = "diloco", log_checkpoint: bool = False) -> None:
        _require("mlflow")
        self.tracking_uri, self.experiment, self.log_checkpoint = tracking_uri, experiment, log_checkpoint
        self.client: Any = None
        self.mlflow_run_id: str | None = None  # the MLflow run's id (not the DiLoCo run's)
        super().__init__()

    def on_start(self, run: RunInfo) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        local = self.tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI")
        uri = f"sqlite:///{run.run_dir / 'mlflow.db'}" if local else (self.tracking_uri or os.environ["MLFLOW_TRACKING_URI"])
        if local:
            run.run_dir.mkdir(parents=True, exist_ok=True)
        self.client = client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        # A local store's artifacts beside it, not in ./mlruns of whatever directory the driver runs in.
        experiment_id = found.experiment_id if found is not None else client.create_experiment(
            self.experiment, artifact_location=(run.run_dir / "mlartifacts").as_uri() if local else None)
        tags = {"run_id": run.run_id, "run_dir": str(run.run_dir), "resumed": str(run.resumed), "mode": run.config.mode}
        self.mlflow_run_id = client.create_run(experiment_id, run_name=run.run_id, tags=tags).info.run_id
        params, cut = [], []
        for key, value in flat_config(run.config).items():
            if len(value) > MLFLOW_PARAM_LIMIT:
                value = value[:MLFLOW_PARAM_LIMIT - 15] + "...[truncated]"
                cut.append(key)
            params.append(Param(key, value))
        if cut:
            log.warning("mlflow: params %s are longer than MLflow's %d characters: cut (config.yaml in the run "
                        "directory has them whole)", ", ".join(cut), MLFLOW_PARAM_LIMIT)
        client.log_batch(self.mlflow_run_id, params=params, tags=[RunTag("truncated_params", ",".join(cut))] if cut else [])
        log.info("mlflow: logging to run %s of experiment %r at %s", self.mlflow_run_id, self.experiment, uri)

    def _log(self, values: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        if self.client is None or not values:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.mlflow_run_id, metrics=[Metric(k, v, now, int(step)) for k, v in values.items()])

    def on_end(self, run: RunInfo, summary: dict) -> None:
        if self.client is None:
            return
        client, run_id = self.client, self.mlflow_run_id
        try:
            client.log_text(run_id, self._events.jsonl(), "events.jsonl")
            client.log_dict(run_id, summary, "summary.json")
            if self.log_checkpoint:
                checkpoint = _final_checkpoint(run)
                if checkpoint is not None:
                    client.log_artifacts(run_id, str(checkpoint), f"checkpoint/{checkpoint.name}")
        finally:  # the run's status is set whatever an artifact upload did
            client.set_terminated(run_id, tracker_status(summary))


class TensorBoardCallback(_Tracker):
    """Write TensorBoard event files (torch.utils.tensorboard's SummaryWriter; needs the tensorboard package).

    `log_dir`: default RUN_DIR/tensorboard, so ``tensorboard --logdir runs`` shows every run under runs/. Scalars
    with global_step = tokens processed: every key of `on_eval` and `on_round` and the island event counters; text:
    the config (YAML), each island event (JSON), and the summary's stop reason at the end.
    """

    def __init__(self, log_dir: str | Path | None = None) -> None:
        _require("tensorboard")
        self.log_dir = log_dir
        self.writer: Any = None
        super().__init__()

    def on_start(self, run: RunInfo) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        where = Path(self.log_dir).expanduser() if self.log_dir is not None else run.run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(where))
        text = yaml.safe_dump(run.config.model_dump(mode="json"), sort_keys=False)
        # TensorBoard's text plugin reads Markdown: indented lines show as code, the YAML as written.
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), global_step=0)
        self.writer.add_text("run", f"run_id {run.run_id}, run_dir {run.run_dir}, resumed {run.resumed}", global_step=0)

    def _log(self, values: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=int(step))

    def on_eval(self, run: RunInfo, metrics: dict) -> None:
        super().on_eval(run, metrics)
        if self.writer is not None:
            self.writer.flush()  # evaluations are what a reader waits for: on disk now, not in 2 minutes

    def on_island_event(self, run: RunInfo, event: dict) -> None:
        super().on_island_event(run, event)
        if self.writer is not None:
            self.writer.add_text("island_events", json.dumps(event, default=str), global_step=int(event.get("tokens", 0)))

    def on_end(self, run: RunInfo, summary: dict) -> None:
        if self.writer is None:
            return
        step = int(summary.get("tokens_processed") or 0)
        self.writer.add_text("end", f"stopped_by {summary.get('stopped_by')}" +
                             (f": {summary['error']}" if summary.get("error") else ""), global_step=step)
        self.writer.close()


class WandbCallback(_Tracker):
    """Log the run to Weights & Biases: one W&B run per driver session, named by run id, grouped by run directory.

    `mode`: "offline" (default: files under `dir`/wandb/offline-run-*, `wandb sync` uploads them later),
    "online" or "disabled"; `dir`: default the run directory. The config as W&B config; the metrics of `on_eval`
    and `on_round` and the island event counters with W&B's step a counter (W&B wants it monotone) and `tokens`
    logged beside them as the charts' x-axis (`define_metric`); the summary's numbers in the W&B summary; then
    `finish()` (exit code 1 for a failed run). W&B's console capture is off: the progress line stays as it is.
    """

    def __init__(self, project: str = "diloco", mode: str = "offline", dir: str | Path | None = None) -> None:
        _require("wandb")
        self.project, self.mode, self.dir = project, mode, dir
        self.run: Any = None
        self._step = 0
        super().__init__()

    def on_start(self, run: RunInfo) -> None:
        import wandb

        where = Path(self.dir).expanduser() if self.dir is not None else run.run_dir
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, mode=self.mode, dir=str(where), name=run.run_id,
                              group=run.run_dir.name, config=run.config.model_dump(mode="json"),
                              tags=[run.config.mode], reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True, disable_git=True, save_code=False))
        self.run.define_metric("tokens")
        self.run.define_metric("*", step_metric="tokens")

    def _log(self, values: Mapping[str, float], tokens: int) -> None:
        if self.run is None:
            return
        self.run.log({**values, "tokens": int(tokens)}, step=self._step)
        self._step += 1

    def on_end(self, run: RunInfo, summary: dict) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update({f"final/{k}": v for k, v in _numbers(summary).items()})
            self.run.summary["stopped_by"] = summary.get("stopped_by")
        finally:
            self.run.finish(exit_code=1 if summary.get("stopped_by") == FAILED else 0)


def _final_checkpoint(run: RunInfo) -> Path | None:
    """The directory of the run's newest local checkpoint (None for a remote checkpoint URI or none yet)."""
    from orchestrator.core.checkpoint import CheckpointStore, checkpoint_dirname, run_checkpoint_uri

    uri = run_checkpoint_uri(run.config.checkpoint.uri, run.run_dir)
    steps = CheckpointStore(uri).list() if "://" not in uri else []
    return Path(uri) / checkpoint_dirname(steps[-1]) if steps else None
