"""Text through a tokenizer in the data path (data.tokenizer), and token ids past 255 for the built-in model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.config import build_config
from orchestrator.run.driver import train
from orchestrator.run.trained import load_trained
from orchestrator.run.workload import prepare

ROOT = Path(__file__).resolve().parents[2]


def test_a_token_column_past_255_sets_the_built_in_model_vocabulary(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": [[1, 2, 999, 5] * 16] * 64}), path)
    cfg = build_config({"data": {"source": "parquet", "path": str(path), "token_column": "ids", "batch_size": 2},
                        "model": {"preset": "nano"}})
    prepared = prepare(cfg)
    assert prepared.data.vocab_size == 1000 and prepared.recipe.model.cfg.vocab_size == 1000
    assert tuple(prepared.initial["tok_emb.weight"].shape) == (1000, 32)


@pytest.mark.ray
@pytest.mark.slow
def test_a_run_trains_its_own_tokenizer_and_sample_decodes_with_it(ray_cluster, tmp_path):
    pytest.importorskip("tokenizers")
    cfg = build_config({
        "run": {"token_budget": 60_000, "seed": 4},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 400_000, "tokenizer": "train", "vocab_size": 512, "batch_size": 8},
        "eval": {"interval_s": 3.0, "batches": 2},
        "health": {"warm_spares": 0},
        "pools": [{"name": "a", "labels": {"pool": "a"}, "cpus_per_island": 0.5},
                  {"name": "b", "labels": {"pool": "b"}, "cpus_per_island": 0.5}],
    })
    run_dir = tmp_path / "run"
    summary = train(cfg, run_dir)
    assert (run_dir / "tokenizer.json").is_file()
    assert "vocab 512" in summary["corpus"]
    evals = summary["evals"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5
    assert load_trained(run_dir).model.tok_emb.num_embeddings == 512  # the tokenizer's vocabulary, not 256
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sample", str(run_dir), "--prompt", "def ",
                          "--tokens", "12", "--seed", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("def ") and len(got.stdout.strip()) > len("def ")
