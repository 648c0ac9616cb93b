"""Bad input to `diloco train` is refused before Ray starts (orchestrator/run/preflight.py): one line that
names the fix in CLI spelling, exit code 2, no run directory. A local Ray that does not start is retried
once, and a run that never trained leaves no run directory (orchestrator/run/driver.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.config import ConfigError, load_config
from orchestrator.run import driver
from orchestrator.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]

# Runs the real CLI (`python -m orchestrator.cli`) with Ray, and torch where asked, made unimportable:
# a refusal that arrives with exit code 2 rather than an ImportError traceback was decided without them,
# so no Ray was started (nor could be).
BLOCKED_CLI = """
import runpy, sys
for name in sys.argv.pop(1).split(","):
    sys.modules[name] = None
sys.argv[0] = "diloco"
runpy.run_module("orchestrator.cli", run_name="__main__")
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A Parquet file with a string column, an int column and two token-id columns (ids < 256 and not)."""
    path = tmp_path_factory.mktemp("data") / "rows.parquet"
    pq.write_table(pa.table({"text": ["def f(): pass"] * 40, "n": list(range(40)),
                             "ids": [[1, 2, 3]] * 40, "big": [[1, 2, 999]] * 40}), path)
    return path


def _train(tmp_path: Path, *args: str, blocked: str = "ray,torch") -> subprocess.CompletedProcess:
    """`diloco train --run-dir tmp_path/run ARGS` from tmp_path (so a default runs/ would land there too)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", BLOCKED_CLI, blocked] if blocked else [sys.executable, "-m", "orchestrator.cli"]
    return subprocess.run([*command, "train", "--quiet", "--run-dir", str(tmp_path / "run"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


BAD_INPUTS = [
    (["--set", "data.source=parquet", "--set", "data.path={missing}", "--set", "data.text_column=text"],
     "does not exist", "--set data.path="),
    (["--set", "data.source=parquet", "--set", "data.path={data}", "--set", "data.text_column=nope"],
     "column 'nope' not found", "--set data.text_column="),
    (["--set", "data.source=parquet", "--set", "data.path={data}", "--set", "data.text_column=n"],
     "has type int64, not string", "--set data.text_column="),
    (["--set", "data.source=parquet", "--set", "data.path={data}", "--set", "data.token_column=text"],
     "not list<int>", "--set data.token_column="),
    (["--set", "data.source=parquet", "--set", "data.path={data}", "--set", "data.token_column=big",
      "--set", "data.vocab_size=500"], "span [1, 999]", "--set data.vocab_size=1000"),
    (["--set", "model.preset=nope"], "unknown model preset 'nope'", "--set model.preset="),
    (["--set", "model.n_heads=3"], "divisible by n_heads=3", "--set model.n_heads="),
    (["--set", "network.scenario=wan-4-regions", "--set", "pools.slow.region=mars"],
     "not in network scenario", "--set pools.NAME.region="),
    (["--chaos", "tape:{missing}.yaml"], "No such file", "--chaos"),
]


@pytest.mark.parametrize(("args", "what", "fix"), BAD_INPUTS, ids=[b[1].split()[0] + str(i) for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_one_line_exit_2_without_ray_or_a_run_directory(tmp_path, dataset, args, what, fix):
    args = [a.format(data=dataset, missing=tmp_path / "nope") for a in args]
    got = _train(tmp_path, *args)
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2, got.stderr
    assert len(lines) == 1 and lines[0].startswith("diloco train: "), got.stderr
    assert what in lines[0] and fix in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_the_plain_cli_refuses_a_missing_dataset_the_same_way(tmp_path):
    """The console entry as a user runs it (nothing blocked): same line, same code, no run directory."""
    got = _train(tmp_path, "--set", "data.source=parquet", "--set", f"data.path={tmp_path / 'nope'}",
                 "--set", "data.text_column=text", blocked="")
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().splitlines()[-1].endswith("--set data.path=PATH")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_fresh_run_over_checkpoints_is_refused_before_ray_and_changes_nothing(tmp_path):
    from orchestrator.core.checkpoint import CheckpointStore

    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    store.save(0, {}, {})
    before = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    got = _train(tmp_path, blocked="ray")
    assert got.returncode == 2, got.stderr
    assert "already holds checkpoints; continue it with --resume" in got.stderr
    assert sorted(str(p) for p in (tmp_path / "run").rglob("*")) == before


def test_preflight_writes_nothing_for_a_run_directory_without_checkpoints(tmp_path):
    (tmp_path / "run").mkdir()
    preflight(load_config(None, []), tmp_path / "run")
    assert list((tmp_path / "run").iterdir()) == []  # opening a checkpoint store would have created one


def test_baseline_wire_choices_match_the_wire_formats():
    from orchestrator.baselines.data_parallel import WIRE_BYTES
    from orchestrator.cli.baseline import WIRES

    assert sorted(WIRES) == sorted(WIRE_BYTES)


# ---------------------------------------------------------------------------------- Ray start retry
# A raylet that misses its 30 s registration ("The current node timed out during startup") cannot be
# provoked reliably on a test machine, so these inject the failure through ensure_ray's `init` seam.

class FlakyInit:
    """Stands in for ray.init: raises `failures` times, then succeeds; records each call's kwargs."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            raise Exception("The current node timed out during startup. This could happen because ...")


def test_a_local_ray_that_times_out_once_is_started_again_with_longer_timeouts(caplog):
    init = FlakyInit(failures=1)
    with caplog.at_level(logging.WARNING):
        driver.start_local_ray(init, pause_s=0, shutdown=lambda: None, address="local", num_cpus=2)
    assert len(init.calls) == 2
    assert init.calls[0] == {"address": "local", "num_cpus": 2}
    assert init.calls[1]["_system_config"]["worker_register_timeout_seconds"] > 60
    assert "retrying once" in caplog.text


def test_a_local_ray_that_fails_twice_is_one_line_saying_what_to_do():
    init = FlakyInit(failures=2)
    with pytest.raises(driver.RayStartError) as err:
        driver.start_local_ray(init, pause_s=0, shutdown=lambda: None, address="local")
    message = str(err.value)
    assert len(init.calls) == 2 and "\n" not in message
    assert "timed out during startup" in message and "--address" in message and "ray stop" in message


def test_a_bad_argument_to_ray_init_is_not_retried():
    def init(**kwargs):
        raise TypeError("unexpected keyword")

    with pytest.raises(TypeError):
        driver.start_local_ray(init, pause_s=0, shutdown=lambda: None, address="local")


# ---------------------------------------------------------------------------------- no false run directories

class FailingRun:
    """Stands in for driver.Run: writes what setup writes (config, checkpoint 0), then fails."""

    began = False
    run_id = "failing-run"
    callbacks = driver.Run.callbacks  # none: what train() ends when the run fails

    def __init__(self, cfg, run_dir, *, progress=None, resume=False, stages=None, workload=None, prepared=None,
                 stop=None, callbacks=None) -> None:
        self.run_dir, self.training_began = Path(run_dir), self.began

    def train(self) -> dict:
        (self.run_dir / "config.yaml").write_text("mode: decoupled\n")
        (self.run_dir / "checkpoints" / "step-000000000000").mkdir(parents=True)
        logging.getLogger("orchestrator.run.driver").warning("placing islands")
        raise RuntimeError("islands failed to start: boom")

    def teardown(self) -> None:
        pass


@pytest.fixture
def no_ray(monkeypatch):
    """driver.train without Ray: no local start, no step measurement, the Run replaced by FailingRun."""
    monkeypatch.setattr(driver, "ensure_ray", lambda cfg, address: False)
    monkeypatch.setattr(driver, "with_measured_step", lambda cfg, address, prepared=None: cfg)
    monkeypatch.setattr(driver, "Run", FailingRun)
    monkeypatch.setattr(FailingRun, "began", False)
    return FailingRun


def test_a_run_that_fails_before_training_leaves_no_run_directory_and_says_where_its_log_went(tmp_path, no_ray):
    run_dir = tmp_path / "runs" / "r1"
    with pytest.raises(driver.RunNotStarted) as err:
        driver.train(load_config(None, []), run_dir)
    message = str(err.value)
    assert not run_dir.exists()
    assert message.startswith("RuntimeError: islands failed to start: boom") and str(run_dir) in message
    kept = Path(message.rsplit("its driver.log is ", 1)[1].rstrip(")"))
    assert "placing islands" in kept.read_text()
    kept.unlink()


def test_a_run_that_began_training_or_a_directory_that_existed_is_kept(tmp_path, no_ray):
    no_ray.began = True
    with pytest.raises(RuntimeError, match="boom"):
        driver.train(load_config(None, []), tmp_path / "trained")
    assert (tmp_path / "trained" / "driver.log").is_file()
    no_ray.began = False
    (tmp_path / "mine").mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        driver.train(load_config(None, []), tmp_path / "mine")
    assert (tmp_path / "mine" / "config.yaml").is_file()


def test_driver_train_runs_the_preflight_before_anything(tmp_path, no_ray):
    with pytest.raises(ConfigError, match="--set model.preset="):
        driver.train(load_config(None, ["model.preset=nope"]), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_driver_train_uses_the_workload_the_cli_prepared_instead_of_preparing_it_again(tmp_path, no_ray, monkeypatch):
    """`diloco train` checks the model and data before it imports Ray and hands the result to train()."""
    handed = []

    class Recording(FailingRun):
        def __init__(self, cfg, run_dir, **kw) -> None:
            super().__init__(cfg, run_dir, **kw)
            handed.append(kw["prepared"])

    monkeypatch.setattr(driver, "Run", Recording)
    monkeypatch.setattr(driver, "prepare", lambda *args: pytest.fail("prepared a second time"))
    prepared = object()
    with pytest.raises(driver.RunNotStarted):
        driver.train(load_config(None, []), tmp_path / "r", prepared=prepared)
    assert handed == [prepared]
