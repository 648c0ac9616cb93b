"""The README's quickstart, typed as a user types it: `diloco train`, then report, sample, evaluate, export.

The command lines are read from README.md's code blocks, so this test breaks when they change. Each runs
as `python -m orchestrator.cli ...` (the `diloco` console script may belong to another checkout) in a
subprocess from a fresh working directory, so `runs/latest` is the one this `diloco train` made. The
train command gets TINY below appended: the README's run takes minutes, this one seconds, and it
starts its own local Ray as a user's would.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# What makes the README's `diloco train` tiny: the nano model on the first 2 MB of the corpus, one pool of one
# island (fewer processes to start: no second pool, no warm spare, no progress keeper), a 300k-token budget.
TINY = ["model.preset=nano", "run.token_budget=300000", "data.max_bytes=2000000", "eval.interval_s=1",
        "eval.batches=8", "outer.sync_every_steps=8", "health.warm_spares=0", "health.salvage_every_steps=0",
        "pools=[{name: fast, islands: 1, cpus_per_island: 1}]"]
AFTER_TRAIN = ("report", "sample", "evaluate", "export")


def readme_commands() -> list[list[str]]:
    """Every `diloco ...` command in README.md's code blocks, as argv without `diloco` (comments dropped)."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    commands = []
    for line in (line for block in blocks for line in block.splitlines()):
        for part in (p.strip() for p in line.split("&&")):
            if part.startswith("diloco "):  # `$ diloco ...` in an output block is an example, not a command
                commands.append(shlex.split(part, comments=True)[1:])
    return commands


def quickstart() -> list[list[str]]:
    """The set-up block's bare `diloco train`, then the README's report/sample/evaluate/export of runs/latest."""
    commands = readme_commands()
    assert ["train"] in commands, "the README's set-up line ends with a bare `diloco train`"
    after = [c for c in commands if c[0] in AFTER_TRAIN and "runs/latest" in c]
    assert [c[0] for c in after] == list(AFTER_TRAIN), f"the README's commands on runs/latest: {after}"
    return [["train"]] + after


def diloco(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run `diloco ARGV` from this checkout, in `cwd`, as a user's shell would; print how long it took (-s shows it)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    got = subprocess.run([sys.executable, "-m", "orchestrator.cli", *argv], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    print(f"diloco {argv[0]}: exit {got.returncode} after {time.monotonic() - start:.1f} s")
    return got


def test_readme_quickstart_runs_as_written(tmp_path):
    train, report, sample, evaluate, export = quickstart()
    assert train == ["train"]
    got = diloco(train + [arg for kv in TINY for arg in ("--set", kv)], tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    run_dir = re.search(r"^run directory: (runs/\d{8}-\d{6})$", got.stdout, flags=re.M).group(1)
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == Path(run_dir).name
    summary = json.loads((latest / "summary.json").read_text())
    assert re.search(rf"^held-out bits/byte +{summary['eval_bits_per_byte']:.3f}$", got.stdout, re.M), got.stdout
    assert summary["tokens_processed"] >= 300_000

    got = diloco(report, tmp_path)
    assert got.returncode == 0, got.stderr
    out = tmp_path / "runs" / "latest" / "report"
    assert got.stdout.split() == [f"runs/latest/report/{n}" for n in ("loss.png", "timeline.png", "report.md")]
    assert (out / "loss.png").stat().st_size > 10_000 and (out / "timeline.png").stat().st_size > 10_000
    md = (out / "report.md").read_text()
    assert md.startswith(f"# Run report: {Path(run_dir).name}\n"), "named after the run, not the link"
    assert f"| held-out bits/byte | {summary['eval_bits_per_byte']:.3f} (unigram baseline" in md

    got = diloco(sample, tmp_path)
    assert sample[sample.index("--prompt") + 1] == "def "
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("def ") and len(got.stdout.encode()) > 100
    assert got.stderr.startswith("runs/latest: checkpoint ")

    got = diloco(evaluate, tmp_path)
    assert got.returncode == 0, got.stderr
    line = re.search(r"^held-out loss ([\d.]+) nats/byte, ([\d.]+) bits/byte over [\d,]+ bytes of Python", got.stdout, re.M)
    assert line, got.stdout
    # The last checkpoint is the model the summary's final evaluation scored, on the same windows.
    assert float(line.group(2)) == pytest.approx(summary["eval_bits_per_byte"], abs=2e-3)
    assert f"unigram model of the same data: {summary['unigram_bits_per_byte']:.3f} bits/byte" in got.stdout

    got = diloco(export, tmp_path)
    assert export[export.index("--out") + 1] == "model.pt"
    assert got.returncode == 0, got.stderr
    assert re.match(r"model\.pt: [\d,]+ parameters from runs/latest: checkpoint", got.stdout)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved["model_config"]["n_layers"] >= 1 and saved["tokens_processed"] == summary["tokens_processed"]
