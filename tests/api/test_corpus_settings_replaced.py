"""Datasets from Python replace the corpus: a corpus setting given beside them does nothing, and the run says so
(warned before Ray, not refused: one config file may serve `diloco train` on a corpus and a script on its datasets)."""

from __future__ import annotations

import logging

import numpy as np

from orchestrator.config import build_config, load_config
from orchestrator.run.workload import Workload, corpus_settings_replaced, prepare


def test_each_corpus_setting_of_its_own_is_named_and_defaults_are_not():
    cfg = build_config({"data": {"source": "parquet", "path": "/data/text", "text_column": "text", "batch_size": 8}})
    lines = corpus_settings_replaced(cfg)
    assert [line.split("=")[0] for line in lines] == ["data.source", "data.path", "data.text_column"], lines
    assert all("has no effect: datasets= from Python replace the corpus" in line for line in lines)
    assert corpus_settings_replaced(build_config({"data": {"batch_size": 8}})) == []  # batch_size serves datasets too
    assert corpus_settings_replaced(load_config(None, [])) == []  # the default, written out in full, sets nothing


def test_prepare_warns_once_per_setting_before_ray(caplog):
    cfg = load_config(None, ["model.preset=nano", "data.max_bytes=2000000"])
    ids = np.arange(40_000, dtype=np.int64) % 256
    with caplog.at_level(logging.WARNING, logger="orchestrator.run.workload"):
        prepare(cfg, Workload(train=ids, heldout=ids[:5_000]))
    warned = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert warned == ["data.max_bytes=2000000 has no effect: datasets= from Python replace the corpus it configures; "
                      "drop it from the run config (or train without datasets= to use it)"], warned
