"""Hugging Face models through the public API on two pools of a real local Ray cluster (transformers extra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator import DilocoTrainer
from orchestrator.config import build_config
from tests.api import zoo

pytest.importorskip("transformers")
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]
ROOT = Path(__file__).resolve().parents[2]


def two_pools(**run) -> dict:
    return {
        "run": {"token_budget": 60_000, "seed": 2, **run},
        "model": {"preset": "nano"},  # seq_len 32: the training windows
        # The text goes through a BPE trained on the corpus (data.tokenizer), its vocabulary the model's.
        "data": {"max_bytes": 400_000, "batch_size": 8, "tokenizer": "train", "vocab_size": zoo.BPE_VOCAB},
        "outer": {"sync_every_steps": 8},
        "eval": {"interval_s": 3.0, "batches": 2},
        "health": {"warm_spares": 0},
        "pools": [{"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "region": "us-east"},
                  {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "region": "eu-west"}],
    }


def test_gpt2_pretrains_on_its_own_tokenizer_through_the_api_stays_tied_and_samples(ray_cluster, tmp_path):
    """GPT-2 (head tied to the embedding) on two pools, its text tokenized by a BPE the run trains (saved as
    RUN_DIR/tokenizer.json); `diloco sample` decodes with it. A Llama pre-trains through the engine on two
    pools in the README's example (tests/api/test_readme_example.py) and in notebook 05 (Ray Data)."""
    pytest.importorskip("tokenizers")
    factory = zoo.tiny_gpt2_bpe
    result = DilocoTrainer(factory, run_config=build_config(two_pools()), run_dir=tmp_path / "run").fit()
    evals = result.metrics["evals"]
    assert evals[0]["tokens_processed"] == 0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5, [e["eval_loss"] for e in evals]
    assert {isl["pool"] for isl in result.metrics["islands"]} == {"a", "b"}
    assert result.checkpoint is not None and (result.checkpoint / "manifest.json").is_file()
    assert (result.path / "tokenizer.json").is_file() and f"vocab {zoo.BPE_VOCAB}" in result.metrics["corpus"]
    # The run directory names the factory by import path, so a resume or `diloco sample` can rebuild it.
    assert f"factory: {factory.__module__}:{factory.__qualname__}" in (result.path / "config.yaml").read_text()
    model = result.load_model()
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == zoo.BPE_VOCAB
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one tensor, still after training and loading
    x = torch.randint(0, zoo.BPE_VOCAB, (1, 8))
    assert torch.isfinite(model(x).logits).all()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sample", str(result.path), "--prompt", "def ",
                          "--tokens", "12", "--seed", "1"], capture_output=True, text=True, env=env, timeout=180)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("def ") and len(got.stdout.strip()) > len("def ")
