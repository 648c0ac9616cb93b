"""`diloco report RUN_DIR --baseline OTHER_RUN_DIR`: how far a run is from a baseline run, from two run directories
written as `diloco train` and `diloco baseline-dp` write them (no Ray, no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config import build_config
from tests.engine.test_report import make_run

DP_NETWORK = "EMULATED network wan-4-regions (links scaled to a 12B model's traffic)"


def baseline_dir(root: Path, *, preset: str = "tiny") -> Path:
    """A data-parallel run directory: summary.json (its evals, bytes) and config.yaml."""
    root.mkdir(parents=True)
    evals = [{"wall_s": w, "tokens_processed": t, "eval_loss": loss} for w, t, loss in
             [(0.0, 0, 4.9), (30.0, 65_536, 3.0), (60.0, 131_072, 2.5)]]
    (root / "summary.json").write_text(json.dumps({"mode": "data-parallel", "evals": evals, "eval_loss": 2.5,
                                                   "bytes_sent": 800_000_000, "tokens_processed": 131_072,
                                                   "network": DP_NETWORK}))
    cfg = build_config({"model": {"preset": preset}}).model_dump(mode="json")
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root


def run_dir(root: Path) -> Path:
    run = make_run(root)  # test_report's decoupled run: 133,120 tokens, final loss 2.8, 8 MB sent, EMULATED pools
    (run / "config.yaml").write_text(yaml.safe_dump(build_config({}).model_dump(mode="json")))
    return run


def test_the_report_says_how_far_the_run_is_from_the_baseline_at_equal_tokens(tmp_path, capsys):
    run, dp = run_dir(tmp_path / "run"), baseline_dir(tmp_path / "dp")
    assert main(["report", str(run), "--baseline", str(dp), "--out", str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    # At 131,072 tokens (the baseline's end): the run's 3.2 at 50,000 and 2.8 at 133,120, read linearly.
    loss = 3.2 + (2.8 - 3.2) * (131_072 - 50_000) / (133_120 - 50_000)
    assert line == (f"against data-parallel run dp at 131,072 tokens: held-out loss {loss:.4f} vs 2.5000 "
                    f"({loss / 2.5 - 1:+.1%}), {(800e6 / 131_072) / (8e6 / 133_120):.1f}x fewer bytes per token")
    text = (tmp_path / "out" / "report.md").read_text()
    section = text[text.index("## Against the baseline"):]
    assert f"| gap | {loss / 2.5 - 1:+.2%} |" in section and "| compared at (tokens processed" in section
    assert "not reached (the baseline's: 60 s)" in section, "the run never got down to 2.5"
    assert DP_NETWORK in section and "EMULATION" in section, "emulated pools and links are named as emulation"
    assert "not like for like" not in section, "same model and data: no differences to name"


def test_a_baseline_of_another_model_is_compared_and_the_difference_named(tmp_path, capsys):
    run, dp = run_dir(tmp_path / "run"), baseline_dir(tmp_path / "dp", preset="nano")
    assert main(["report", str(run), "--baseline", str(dp)]) == 0
    assert capsys.readouterr().out.strip().endswith("; the runs differ in model.preset")
    assert "- model.preset: 'tiny' vs 'nano'" in (run / "report" / "report.md").read_text()


@pytest.mark.parametrize("broken", ["missing", "no_evals"])
def test_an_unreadable_baseline_is_one_line_exit_2_and_no_report_written(tmp_path, capsys, broken):
    run = run_dir(tmp_path / "run")
    dp = tmp_path / "dp"
    if broken == "no_evals":
        dp.mkdir()
        (dp / "summary.json").write_text(json.dumps({"mode": "data-parallel", "evals": []}))
    assert main(["report", str(run), "--baseline", str(dp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco report: the baseline ") and str(dp) in err[0]
    assert not (run / "report").exists(), "nothing written before the baseline was read"
