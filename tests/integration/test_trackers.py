"""The experiment trackers log a real run: one short nano run on the session cluster with MLflow (a real `mlflow
server` in a subprocess), TensorBoard and W&B (offline) on at once, named in run.trackers as a config would, read
back with each tracker's own reader. One run for the three: CI pays for it once.

mlflow, tensorboard and wandb are imported at the top, so that without the `trackers` extra this module fails
(an error at collection), never skips: CI installs the extra (.ci/run).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow  # noqa: F401 - the extra must be installed: fail here, not skip
import pytest
import tensorboard  # noqa: F401
import wandb  # noqa: F401
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from orchestrator.config import build_config
from orchestrator.run.callbacks import Callback
from orchestrator.run.driver import train
from orchestrator.run.trackers import MLflowCallback

# Extended: a run start-up on the cluster plus an `mlflow server`, about 50 s of CI's serial Ray tests on a slow day.
# The default run keeps the trackers' real writes and reads without Ray (tests/engine/test_trackers_offline.py) and
# the driver's hook calls (tests/engine/test_callbacks.py).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server (SQLite store, local artifact root) on a free port; its URI once it answers."""
    port = free_port()
    root = tmp_path / "mlflow-server"
    root.mkdir()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--default-artifact-root", (root / "artifacts").as_uri()],
                            stdout=log, stderr=subprocess.STDOUT, cwd=root)
    uri = f"http://127.0.0.1:{port}"
    try:
        yield proc, uri
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wait_until_up(proc: subprocess.Popen, uri: str, root: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mlflow server exited: {(root / 'server.log').read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow server not up in {timeout_s:.0f} s: {(root / 'server.log').read_text()[-2000:]}")


class Recorder(Callback):
    """Every hook call, in order (a user's own callback beside the trackers)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.info = None

    def on_start(self, run):
        self.info = run
        self.calls.append(("start", None))

    def on_eval(self, run, metrics):
        self.calls.append(("eval", metrics))

    def on_round(self, run, metrics):
        self.calls.append(("round", metrics))

    def on_end(self, run, summary):
        self.calls.append(("end", summary))


class Broken(Callback):
    def on_round(self, run, metrics):
        raise RuntimeError("a callback's own bug")


def tracked_config(mlflow_uri: str) -> dict:
    cfg = {
        # The cheapest run with two evaluations and a flush between its starting point and its end.
        "run": {"token_budget": 150_000, "seed": 3, "trackers": [f"mlflow:{mlflow_uri}", "tensorboard", "wandb"]},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 1_000_000},
        "eval": {"interval_s": 2.0, "batches": 2},
        "outer": {"sync_every_steps": 10},
        "health": {"warm_spares": 0},
        "pools": [
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5},
            {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5},
        ],
    }
    return cfg


def test_one_run_logs_to_mlflow_tensorboard_and_wandb(ray_cluster, tmp_path, mlflow_server, monkeypatch):
    proc, uri = mlflow_server
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    wait_until_up(proc, uri, tmp_path / "mlflow-server")
    run_dir = tmp_path / "run"
    cfg = build_config(tracked_config(uri))
    recorder = Recorder()
    # A second MLflow run from the Python API, with the opt-in final checkpoint as an artifact (the same server).
    with_checkpoint = MLflowCallback(uri, experiment="diloco-checkpoints", log_checkpoint=True)
    summary = train(cfg, run_dir, callbacks=[recorder, Broken(), with_checkpoint])
    assert summary["stopped_by"] == "token_budget", "a failing callback never stops the run"

    # The user's callback: start first, end last with the summary, evaluations and flushes between, tokens the x-axis.
    kinds = [k for k, _ in recorder.calls]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("end") == 1
    assert recorder.calls[-1][1]["tokens_processed"] == summary["tokens_processed"]
    evals = [m for k, m in recorder.calls if k == "eval"]
    rounds = [m for k, m in recorder.calls if k == "round"]
    assert len(evals) == len(summary["evals"]) >= 2 and evals[0]["tokens"] == 0
    assert evals[-1]["eval_loss"] == summary["eval_loss"]
    assert rounds and rounds[-1]["tokens"] == summary["tokens_processed"] and rounds[-1]["goodput"] == summary["goodput"]
    assert rounds[-1]["tokens_merged"] + rounds[-1]["tokens_in_flight"] + rounds[-1]["tokens_refused"] + \
        rounds[-1]["tokens_lost"] + rounds[-1]["tokens_overwritten"] == summary["tokens_processed"]
    info = recorder.info
    assert info.run_dir == run_dir.resolve() and info.config == cfg and not info.resumed

    # MLflow, read back from the server.
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("diloco")
    (found,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.run_id = '{info.run_id}'")
    assert found.info.status == "FINISHED"
    assert found.data.params["outer.lr"] == str(cfg.outer.lr) and found.data.params["pools.a.islands"] == "1"
    assert found.data.tags["run_dir"] == str(run_dir.resolve())
    history = client.get_metric_history(found.info.run_id, "eval_loss")
    steps = [m.step for m in history]
    assert len(history) >= 2 and steps == sorted(steps) and steps[0] == 0 and steps[-1] == summary["tokens_processed"]
    assert history[-1].value == pytest.approx(summary["eval_loss"])
    goodput = client.get_metric_history(found.info.run_id, "goodput")
    assert goodput and goodput[-1].value == pytest.approx(summary["goodput"])
    for key in ("eval_bits_per_byte", "train_loss", "uptime", "versions", "rounds", "refusals", "bytes_sent",
                "tokens_merged", "tokens_in_flight"):
        assert client.get_metric_history(found.info.run_id, key), f"{key} not logged"
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"events.jsonl", "summary.json"} <= artifacts and "checkpoint" not in artifacts, "the checkpoint is opt-in"
    (opted,) = client.search_runs([client.get_experiment_by_name("diloco-checkpoints").experiment_id])
    (folder,) = client.list_artifacts(opted.info.run_id, "checkpoint")
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert folder.path == f"checkpoint/{final.name}"
    assert "checkpoint/" + final.name + "/manifest.json" in {a.path for a in client.list_artifacts(opted.info.run_id, folder.path)}

    # TensorBoard's event files in RUN_DIR/tensorboard, read by TensorBoard's own loader.
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    assert {"eval_loss", "eval_bits_per_byte", "goodput", "train_loss", "tokens_merged"} <= scalars
    tb = acc.Scalars("eval_loss")
    assert [e.step for e in tb] == steps and tb[-1].value == pytest.approx(summary["eval_loss"], rel=1e-6)
    assert "config" in "".join(acc.Tags()["tensors"])  # the config as a text summary

    # W&B's offline run directory (RUN_DIR/wandb/offline-run-*): its .wandb file, read as W&B's records.
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (records_file,) = offline.glob("run-*.wandb")
    records = list(wandb_records(records_file))
    (config,) = [items(r.run.config.update) for r in records if r.HasField("run")]
    assert config["outer"]["lr"] == cfg.outer.lr and config["run"]["trackers"] == cfg.run.trackers
    history = [items(r.history.item) for r in records if r.HasField("history")]
    logged = [(h["tokens"], h["eval_loss"]) for h in history if "eval_loss" in h]
    assert [t for t, _ in logged] == steps and logged[-1][1] == pytest.approx(summary["eval_loss"])
    assert [h["_step"] for h in history] == list(range(len(history))), "W&B's step: a counter, tokens beside it"
    assert any("goodput" in h for h in history)
    final = {k: v for r in records if r.HasField("summary") for k, v in items(r.summary.update).items()}
    assert final["stopped_by"] == "token_budget" and final["final/eval_loss"] == pytest.approx(summary["eval_loss"])
    assert [r.exit.exit_code for r in records if r.HasField("exit")] == [0]


def items(entries) -> dict:
    """W&B's key/value items (config, history, summary) as a dict: a key is `key`, or `nested_key` joined by dots."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in entries}


def wandb_records(path: Path):
    """The records of a W&B run file (`.wandb`): W&B's protobuf Records in LevelDB's log format, as wandb-core writes
    them (a 7-byte header ":W&B", 0xBEE1, version 0; then 32 KiB blocks of chunks: CRC, length, type, data). wandb
    0.31 ships no Python reader of its own (`wandb sync` reads them in Go)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:  # zero padding at the file's end
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
