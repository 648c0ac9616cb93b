"""Ctrl-C and SIGTERM of a real `diloco train`, and Ctrl-C under `fit()` (issue 59, item 4).

The default run has one test: `diloco train` (a subprocess, as a user runs it, on the session cluster) gets one
SIGINT while it trains. It stops cleanly: exit 130, one line naming `diloco train --resume RUN_DIR`, no traceback,
no island reported lost, summary.json `stopped_by` "interrupted" with every token's fate adding up and none lost
(the final flush merged what the islands had), and a resume from that directory continues from the interrupted
session's final ledger. SIGTERM (the same stop, exit 143) and `fit()` (KeyboardInterrupt after the clean stop)
are extended tests (`-m extended`): each is one more run of about the same length, and CI's 15 minutes are
spent. A second SIGINT (exit at once) is tests/integration/test_ledger_moments.py's Ctrl-C test, and `ray job
stop` is tests/deploy/test_jobs.py's; both extended too. The handler's logic without Ray:
tests/engine/test_interrupts.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from orchestrator.config import apply_overrides, build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.run.driver import resume_config, train
from tests.engine.test_token_ledger import assert_shown_everywhere
from tests.integration.test_recovery import small_config
from tests.integration.test_self_healing import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LOST = re.compile(r"island \d+ incarnation \d+ (dead|hung|lost)")


def _start_cli(cluster, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """`diloco train` of small_config (2 nano islands, checkpoints every second) on the session cluster."""
    run_dir, cfg_path, err_path = tmp_path / "run", tmp_path / "config.yaml", tmp_path / "driver.err"
    cfg_path.write_text(yaml.safe_dump(small_config()))
    with err_path.open("w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "train", "--address", cluster.address, "--config", str(cfg_path),
             "--run-dir", str(run_dir), "--quiet"], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    return driver, run_dir, err_path


def _wait_until_merging(driver: subprocess.Popen, run_dir: Path) -> None:
    """Until the driver's loop runs (it links `latest` at its first tick) and a checkpoint holds merged rounds."""
    store = CheckpointStore(str(run_dir / "checkpoints"))
    try:
        wait_for("the driver's loop and a checkpoint with merged rounds", lambda: driver.poll() is None
                 and (run_dir.parent / "latest").is_symlink() and len(store.list()) >= 2
                 and sum(store.load(store.list()[-1]).meta["outer"]["versions"]) >= 2, timeout_s=180)
    except BaseException:
        driver.kill()
        driver.wait(30)
        raise


def _signal_and_check(driver: subprocess.Popen, run_dir: Path, err_path: Path, signum: int, code: int) -> dict:
    """Send `signum` once; the run stops cleanly and says how to resume. Returns its summary."""
    driver.send_signal(signum)
    try:
        driver.wait(120)
    finally:
        if driver.poll() is None:
            driver.kill()
    err = err_path.read_text()
    assert driver.returncode == code, err[-3000:]
    assert "Traceback" not in err and not LOST.search(err), err[-3000:]
    resume = [line for line in err.splitlines() if "--resume" in line]
    assert resume == [f"diloco train: interrupted: stopped cleanly; resume with: diloco train --resume {run_dir}"], err
    assert f"diloco train: {signal.Signals(signum).name}: stopping cleanly" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted"
    assert_shown_everywhere(summary)
    ledger = summary["token_ledger"]
    assert sum(ledger["lost"]) == sum(ledger["in_flight"]) == 0 and sum(ledger["merged"]) > 0, ledger
    return summary


def test_ctrl_c_stops_cleanly_says_how_to_resume_and_the_resume_continues(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    driver, run_dir, err_path = _start_cli(cluster, tmp_path)
    _wait_until_merging(driver, run_dir)
    stopped = _signal_and_check(driver, run_dir, err_path, signal.SIGINT, 130)

    # The command it printed continues the run: the same driver as `diloco train --resume RUN_DIR`, here in this
    # process on the same cluster. The interrupted session's final checkpoint held its whole ledger: nothing lost.
    cfg = build_config(apply_overrides(resume_config(run_dir).model_dump(mode="json"), ["run.max_wall_s=3"]))
    summary = train(cfg, run_dir, resume=True)
    assert summary["resumed"] is True and summary["stopped_by"] == "max_wall_s"
    before = summary["token_ledger_before"]
    assert before["merged"] == stopped["token_ledger"]["merged"] and sum(before["lost"]) == 0, (before, stopped)
    assert before["processed"] == stopped["token_ledger"]["processed"], (before, stopped)
    assert summary["tokens_processed"] > stopped["tokens_processed"], "the resumed session trained on"
    assert_shown_everywhere(summary)


@pytest.mark.extended
def test_sigterm_stops_the_same_way(ray_cluster, tmp_path):
    """SIGTERM (`kill PID`; `ray job stop` sends it too) is the same clean stop; exit 143 = 128 + SIGTERM.
    Extended: a second run of the default test's length, for a path the unit tests cover but for the signal."""
    cluster, _ = ray_cluster
    driver, run_dir, err_path = _start_cli(cluster, tmp_path)
    _wait_until_merging(driver, run_dir)
    _signal_and_check(driver, run_dir, err_path, signal.SIGTERM, 143)


FIT_SCRIPT = textwrap.dedent("""
    import sys
    import yaml
    from orchestrator import DilocoTrainer
    from orchestrator.config import build_config

    cfg = build_config(yaml.safe_load(open(sys.argv[1])))

    def ticks(progress):  # the driver's loop runs: the test may interrupt it now
        print("tick", flush=True)

    try:
        DilocoTrainer(run_config=cfg, run_dir=sys.argv[2], address=sys.argv[3], progress=ticks).fit()
    except KeyboardInterrupt as err:
        print(f"KeyboardInterrupt {type(err).__name__} {err.summary['stopped_by']}", flush=True)
        sys.exit(3)
""")


@pytest.mark.extended
def test_fit_raises_keyboard_interrupt_after_the_clean_stop(ray_cluster, tmp_path):
    """Ctrl-C in a notebook is a KeyboardInterrupt in the thread running fit(), by Python's own SIGINT handler
    (fit() installs none): the run stops cleanly, then fit() raises RunInterrupted, a KeyboardInterrupt.
    Extended: one more run, through the same driver path as the default test's."""
    cluster, _ = ray_cluster
    run_dir, cfg_path, out_path = tmp_path / "run", tmp_path / "config.yaml", tmp_path / "fit.out"
    cfg_path.write_text(yaml.safe_dump(small_config()))
    with out_path.open("w") as out:
        child = subprocess.Popen([sys.executable, "-c", FIT_SCRIPT, str(cfg_path), str(run_dir), cluster.address],
                                 env=ENV, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for("fit()'s loop", lambda: child.poll() is None and "tick" in out_path.read_text(), timeout_s=180)
        child.send_signal(signal.SIGINT)
        child.wait(120)
    finally:
        if child.poll() is None:
            child.kill()
    text = out_path.read_text()
    assert child.returncode == 3 and "KeyboardInterrupt RunInterrupted interrupted" in text, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted"
    assert_shown_everywhere(summary)
