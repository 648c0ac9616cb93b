"""One ledger at the moments the default suite's runs do not reach: an island killed during the final flush,
kills under `overwrite` adoption (where an adoption replaces progress), and Ctrl-C of a `diloco train` then
`--resume`. Whatever the moment, summary.json's fates add up to tokens_processed in every fragment, and so do
the final table, report.md and the islands' rows (issue 60, item 1). Each is a run of its own, so they are
extended tests (`-m extended`): the default suite checks the same identity in the runs it already makes
(test_self_healing, test_recovery, test_stream_resume, test_elastic) and at every moment by hand
(tests/engine/test_token_ledger.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml

from orchestrator.config import apply_overrides, build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.run.driver import Run, resume_config, train
from orchestrator.run.summary import format_summary
from policies.chaos import Fault, FaultTape
from tests.engine.test_token_ledger import assert_shown_everywhere
from tests.integration.test_recovery import small_config
from tests.integration.test_self_healing import actor, config, finish, start, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]
ROOT = Path(__file__).resolve().parents[2]


def test_kills_under_overwrite_adoption_and_during_the_final_flush_add_up(ray_cluster, tmp_path):
    """Overwrite adoption (each adoption replaces the progress since the last cut: overwritten tokens), islands
    killed at steps between cuts and adoptions, and island 0 killed as the final flush begins."""
    tape = FaultTape((Fault(island=1, kind="kill_island", at_step=7), Fault(island=2, kind="kill_island", at_step=13),
                      Fault(island=3, kind="kill_island", at_step=22)))
    cfg = config(tmp_path, tape)
    cfg["outer"] = {**cfg["outer"], "adoption": "overwrite", "sync_every_steps": 8}
    run = Run(build_config(cfg), tmp_path / "run")
    finish_run = run._finish

    def kill_then_finish(t0: float) -> dict:  # the final flush starts while island 0 dies
        ray.kill(actor(f"{run.run_id}-island0-inc1"), no_restart=True)
        return finish_run(t0)

    run._finish = kill_then_finish
    th, out = start(run)
    try:
        wait_for("the three kills to heal", lambda: all(
            run.snapshot["slots"][i]["incarnation"] >= 2 and run.snapshot["slots"][i]["state"] == "training"
            for i in (1, 2, 3)), timeout_s=240)
    finally:
        summary = finish(run, th, out)
    assert summary["failures"] >= 3 and summary["tokens_overwritten"] > 0, summary
    assert_shown_everywhere(summary)


def test_ctrl_c_then_resume_keeps_the_interrupted_sessions_fates(ray_cluster, tmp_path):
    """Ctrl-C twice ends `diloco train` at once, without a clean stop or a summary (one Ctrl-C stops cleanly:
    tests/integration/test_interrupt.py); `--resume` restores its newest checkpoint. The table then counts the
    interrupted session's tokens as of that checkpoint: merged as it holds them, and what the interruption lost
    as lost."""
    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(small_config()))
    err_path = tmp_path / "driver.err"
    with err_path.open("w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "train", "--address", cluster.address, "--config", str(cfg_path),
             "--run-dir", str(run_dir), "--quiet"], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=err)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    try:
        wait_for("checkpoints with merged rounds and a noted ledger", lambda: driver.poll() is None and len(store.list()) >= 3
                 and (lambda meta: sum(meta["outer"]["versions"]) >= 2 and meta["extra"].get("token_ledger"))(
                     store.load(store.list()[-1]).meta), timeout_s=180)
    finally:
        driver.send_signal(signal.SIGINT)  # Ctrl-C: the clean stop begins ...
        time.sleep(0.5)
        driver.send_signal(signal.SIGINT)  # ... and a second one exits at once
        driver.wait(60)
    assert driver.returncode == 130 and "SIGINT again: exiting now without a clean stop" in err_path.read_text()
    assert not (run_dir / "summary.json").exists()
    newest = store.load(store.list()[-1]).meta
    cfg = build_config(apply_overrides(resume_config(run_dir).model_dump(mode="json"), ["run.max_wall_s=5"]))
    summary = train(cfg, run_dir, resume=True)

    before = summary["token_ledger_before"]
    assert before["merged"] == newest["outer"]["tokens_merged"], "the interrupted session's merges, as of its checkpoint"
    assert before["processed"][0] >= newest["extra"]["tokens_processed"] and sum(before["lost"]) > 0, before
    assert_shown_everywhere(summary)
    assert "  lost" in format_summary(summary) and "of earlier sessions" in format_summary(summary)
