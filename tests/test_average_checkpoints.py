"""benchmarks/average_checkpoints.py: post-hoc averages of a run's checkpoints (no Ray)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from islands.model import build_model, model_config
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.run.trained import load_trained

_spec = importlib.util.spec_from_file_location("average_checkpoints", Path(__file__).parents[1] / "benchmarks" / "average_checkpoints.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TOKENS = [1000, 1500, 2000, 2500]  # tokens merged at each checkpoint


def write_run(run_dir: Path, *, dp: bool = False) -> list[dict[str, torch.Tensor]]:
    run_dir.mkdir(parents=True)
    cfg = build_config({"model": {"preset": "nano"}, "data": {"max_bytes": 1_000_000}, "eval": {"batches": 1, "batch_size": 4}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**cfg.model_dump(mode="json"), "mode": "data-parallel" if dp else "decoupled"}))
    base = dict(build_model(model_config("nano"), seed=0).named_parameters())
    store, saved = CheckpointStore(run_checkpoint_uri(None, run_dir), keep=10), []
    for step, tokens in enumerate(TOKENS):
        params = {n: p.detach() + 0.01 * step for n, p in base.items()}
        meta = {"mode": "data-parallel"} if dp else {"outer": {"tokens_merged": [tokens, tokens]}}
        store.save(step, {f"param/{n}": t for n, t in params.items()}, meta)
        saved.append(params)
    return saved


def test_uniform_and_replayed_averages_of_the_checkpoints(tmp_path):
    saved = write_run(tmp_path / "run")
    ckpts = bench.load_checkpoints(tmp_path / "run", load_trained(tmp_path / "run", raw=True))
    assert [t for _, t, _ in ckpts] == TOKENS
    avg, n = bench.uniform_average(ckpts, 0.4)  # tokens >= 1500: the last three
    assert n == 3
    torch.testing.assert_close(avg["lm_head.weight"], (saved[1]["lm_head.weight"] + saved[2]["lm_head.weight"]
                                                       + saved[3]["lm_head.weight"]) / 3)
    # Window 0.5: weights 500/(0.5*1500) = 2/3, 500/1000 = 1/2, 500/1250 = 2/5, from checkpoint 0.
    want = saved[0]["lm_head.weight"].clone()
    for params, w in zip(saved[1:], (2 / 3, 1 / 2, 2 / 5)):
        want = want + w * (params["lm_head.weight"] - want)
    torch.testing.assert_close(bench.replayed_average(ckpts, 0.5)["lm_head.weight"], want)


def test_the_command_prints_a_table_and_refuses_a_run_without_token_counts(tmp_path, capsys):
    write_run(tmp_path / "run")
    assert bench.main([str(tmp_path / "run"), "--batches", "1", "--uniform", "1", "--window", "0.5",
                       "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "4 checkpoints over the last 60.0% of 2,500 tokens merged" in out
    assert "| uniform, last 1 (4 checkpoints) |" in out and "| run.average_window=0.5 |" in out
    assert len(json.loads((tmp_path / "out.json").read_text())) == 3

    write_run(tmp_path / "dp", dp=True)
    assert bench.main([str(tmp_path / "dp"), "--batches", "1"]) == 2
    assert "records no tokens merged" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main([str(tmp_path / "run"), "--uniform", "0"])
