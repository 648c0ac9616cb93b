"""Token ids past 255 for the built-in model. (A run that trains its own tokenizer and samples with it:
tests/api/test_hf_models.py.)"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.config import build_config
from orchestrator.run.workload import prepare


def test_a_token_column_past_255_sets_the_built_in_model_vocabulary(tmp_path):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": [[1, 2, 999, 5] * 16] * 64}), path)
    cfg = build_config({"data": {"source": "parquet", "path": str(path), "token_column": "ids", "batch_size": 2},
                        "model": {"preset": "nano"}})
    prepared = prepare(cfg)
    assert prepared.data.vocab_size == 1000 and prepared.recipe.model.cfg.vocab_size == 1000
    assert tuple(prepared.initial["tok_emb.weight"].shape) == (1000, 32)
