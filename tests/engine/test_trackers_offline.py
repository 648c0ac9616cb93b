"""The three trackers write what a user reads back, without Ray: MLflow (its local SQLite store, the default with no
URI), TensorBoard and W&B (offline) fed the hook calls a run makes (`Callbacks`, as the driver calls it), then read
with each tracker's own reader (MlflowClient, TensorBoard's EventAccumulator, W&B's records).

The hooks' metrics are the driver's own (`eval_metrics`, `round_metrics` on a ledger and statuses). The same three
trackers log a real run in tests/integration/test_trackers.py (`-m extended`: a run start-up on the cluster and an
`mlflow server`, about 50 s of CI's serial Ray tests); this test keeps their writes and reads in the default run.
"""

from __future__ import annotations

from pathlib import Path

import mlflow  # noqa: F401 - the extra must be installed: fail here, not skip (CI installs it)
import pytest
import tensorboard  # noqa: F401
import torch
import wandb  # noqa: F401
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from islands.spec import DataCursor, IslandStatus
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore, checkpoint_dirname
from orchestrator.run.callbacks import Callbacks, RunInfo
from orchestrator.run.stopping import StopRequest
from orchestrator.run.trackers import MLflowCallback, TensorBoardCallback, WandbCallback
from tests.integration.test_trackers import items, wandb_records

LEDGER = {"processed": [4096, 4096], "merged": [3000, 3001], "refused": [96, 96], "in_flight": [900, 899],
          "lost": [100, 100], "overwritten": [0, 0]}
STATUS = {"versions": [3, 2], "rounds": 5, "refusals": 1, "bytes_up": 3000, "bytes_down": 7000}


def status(island: int, loss: float) -> IslandStatus:
    return IslandStatus(island=island, incarnation=1, pool="a", state="training", steps=8, tokens=4096, train_loss=loss,
                        step_time_s=0.1, versions=[3, 2], unsubmitted_tokens=[0, 0], outbox_tokens=[0, 0], inflight=0,
                        cursor=DataCursor())


def point(tokens: int, loss: float) -> dict:
    return {"wall_s": tokens / 1000, "at": 0.0, "tokens_processed": tokens, "tokens_merged": float(tokens // 2),
            "versions": [tokens // 2048, tokens // 4096], "eval_loss": loss, "eval_bits_per_byte": loss * 1.4427}


def test_the_trackers_log_a_runs_hooks_and_their_readers_read_them_back(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default: a SQLite store in the run directory
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = (tmp_path / "run").resolve()
    cfg = build_config({"run": {"token_budget": 4096, "trackers": ["mlflow", "tensorboard", "wandb"]},
                        "pools": [{"name": "a", "islands": 2}]})
    # A final checkpoint for the opt-in artifact: what a run leaves in RUN_DIR/checkpoints.
    CheckpointStore(str(run_dir / "checkpoints")).save(7, {"w": torch.ones(3)}, {"note": "final"})
    info = RunInfo(run_dir=run_dir, run_id="run-offline1", config=cfg, resumed=False,
                   request_stop=lambda reason: StopRequest().ask(reason) and None)
    opted = MLflowCallback(experiment="diloco-checkpoints", log_checkpoint=True)
    cbs = Callbacks([MLflowCallback(), TensorBoardCallback(), WandbCallback(), opted], info)

    cbs.start()
    cbs.eval(point(0, 5.5))
    cbs.round(ledger=LEDGER, status=STATUS, statuses=[status(0, 3.0), status(1, 2.0)], new_rounds=5, wall_s=4.0,
              goodput=0.75, uptime=0.9)
    cbs.island_events({"slots": {1: {"pool": "a"}}, "timeline": [(1.0, 1, 1, "dead"), (2.0, 1, 2, "restarting")],
                       "detections": [{"island": 1, "incarnation": 1, "kind": "dead", "reason": "killed"}]}, tokens=2048)
    cbs.eval(point(4096, 2.25))
    summary = {"stopped_by": "token_budget", "tokens_processed": 4096, "eval_loss": 2.25, "goodput": 0.75}
    cbs.end(summary)
    steps = [0, 4096]

    # MLflow: the local store a run without a URI writes, read back by MlflowClient.
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("diloco").experiment_id],
                                  filter_string="tags.run_id = 'run-offline1'")
    assert found.info.status == "FINISHED" and found.data.tags["run_dir"] == str(run_dir)
    assert found.data.params["pools.a.islands"] == "2" and found.data.params["outer.lr"] == str(cfg.outer.lr)
    history = client.get_metric_history(found.info.run_id, "eval_loss")
    assert [(m.step, m.value) for m in history] == [(0, 5.5), (4096, 2.25)]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "train_loss")] == [2.5]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "tokens_lost")] == [100]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "island_failures")] == [1]
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"events.jsonl", "summary.json"} <= artifacts and "checkpoint" not in artifacts, "the checkpoint is opt-in"
    assert (run_dir / "mlartifacts").is_dir(), "a local store keeps its artifacts beside it, in the run directory"
    (with_ckpt,) = client.search_runs([client.get_experiment_by_name("diloco-checkpoints").experiment_id])
    (folder,) = client.list_artifacts(with_ckpt.info.run_id, "checkpoint")
    assert folder.path == f"checkpoint/{checkpoint_dirname(7)}"

    # TensorBoard: RUN_DIR/tensorboard, read by TensorBoard's loader.
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [(0, 5.5), (4096, 2.25)]
    assert [e.value for e in acc.Scalars("goodput")] == [pytest.approx(0.75)]
    assert {"config", "island_events", "end"} <= {t.split("/")[0] for t in acc.Tags()["tensors"]}

    # W&B: the offline run's records.
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (records_file,) = offline.glob("run-*.wandb")
    records = list(wandb_records(records_file))
    (config,) = [items(r.run.config.update) for r in records if r.HasField("run")]
    assert config["pools"][0]["islands"] == 2 and config["run"]["trackers"] == cfg.run.trackers
    history_rows = [items(r.history.item) for r in records if r.HasField("history")]
    assert [(h["tokens"], h["eval_loss"]) for h in history_rows if "eval_loss" in h] == list(zip(steps, [5.5, 2.25]))
    assert [h["_step"] for h in history_rows] == list(range(len(history_rows)))
    final = {k: v for r in records if r.HasField("summary") for k, v in items(r.summary.update).items()}
    assert final["stopped_by"] == "token_budget" and final["final/eval_loss"] == 2.25
    assert [r.exit.exit_code for r in records if r.HasField("exit")] == [0]


def test_a_failed_run_ends_its_tracker_runs_as_failed(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = (tmp_path / "run").resolve()
    info = RunInfo(run_dir=run_dir, run_id="run-failed1", config=build_config({}), resumed=False,
                   request_stop=lambda reason: None)
    cbs = Callbacks([MLflowCallback()], info)
    cbs.start()
    cbs.fail(RuntimeError("the outer optimizer died"))
    client = MlflowClient(f"sqlite:///{Path(run_dir) / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("diloco").experiment_id])
    assert found.info.status == "FAILED"
