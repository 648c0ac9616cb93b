"""Hugging Face models through the public API on two pools of a real local Ray cluster (transformers extra)."""

from __future__ import annotations

import pytest
import torch

from orchestrator import DilocoTrainer
from orchestrator.config import build_config
from tests.api import zoo

pytest.importorskip("transformers")
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def two_pools(**run) -> dict:
    return {
        "run": {"token_budget": 60_000, "seed": 2, **run},
        "model": {"preset": "nano"},  # seq_len 32: the windows of the byte corpus
        "data": {"max_bytes": 1_000_000, "batch_size": 8},
        "outer": {"sync_every_steps": 8},
        "eval": {"interval_s": 3.0, "batches": 2},
        "health": {"warm_spares": 0},
        "pools": [{"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "region": "us-east"},
                  {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "region": "eu-west"}],
    }


# GPT-2 here; a Llama pre-trains through the engine on two pools in the README's example
# (tests/api/test_readme_example.py) and in notebook 05 (Ray Data, a trained tokenizer).
@pytest.mark.parametrize("factory", [zoo.tiny_gpt2], ids=["gpt2"])
def test_a_hugging_face_model_pretrains_through_the_api_and_its_loss_falls(ray_cluster, tmp_path, factory):
    result = DilocoTrainer(factory, run_config=build_config(two_pools()), run_dir=tmp_path / "run").fit()
    evals = result.metrics["evals"]
    assert evals[0]["tokens_processed"] == 0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5, [e["eval_loss"] for e in evals]
    assert {isl["pool"] for isl in result.metrics["islands"]} == {"a", "b"}
    assert result.checkpoint is not None and (result.checkpoint / "manifest.json").is_file()
    # The run directory names the factory by import path, so a resume or `diloco sample` can rebuild it.
    assert f"factory: {factory.__module__}:{factory.__qualname__}" in (result.path / "config.yaml").read_text()
    model = result.load_model()
    assert type(model) is type(factory())
    if factory is zoo.tiny_gpt2:  # tied: one tensor under two names, still after training and loading
        assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, zoo.VOCAB, (1, 8))
    assert torch.isfinite(model(x).logits).all()
