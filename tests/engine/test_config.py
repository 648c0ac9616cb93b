"""Configuration: loaded once at the edge, one-line errors that name the field and the fix."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from islands.data import DataError
from orchestrator.cli import main
from orchestrator.config import ConfigError, RunConfig, load_config
from orchestrator.driver import load_corpus

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_default_yaml_equals_builtin_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == RunConfig()


def test_sync_diloco_preset_sets_the_degenerate_settings():
    cfg = load_config(ROOT / "configs" / "sync-diloco.yaml")
    o = cfg.outer
    assert cfg.min_quorum_count() == cfg.num_islands == 4
    assert (o.num_fragments, o.merge_rule, o.weighting, o.adoption, o.wait_for_round) == (1, "mean", "uniform", "overwrite", True)
    assert math.isinf(o.grace_gamma) and math.isinf(o.grace_cap_s)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["outer.min_quorm=2"], "unknown config field 'outer.min_quorm'; remove it or check the spelling"),
        (["outer.num_fragments=3"], "pick H = 39"),
        (["outer.merge_rule=median"], "unknown merge rule 'median'; use one of rda, mean"),
        (["outer.adoption=blend"], "config field 'outer.adoption'"),
        (["outer.compression=int2"], "unknown compression 'int2'; use one of none, bf16, int8, int4"),
        (["outer.min_quorum=9"], "exceeds the 4 islands"),
        (["run.token_budget=-5"], "config field 'run.token_budget'"),
        (["mode=sync-diloco", "outer.merge_rule=rda"], "conflicts with mode sync-diloco"),
        (["data.source=parquet"], "data.path is required"),
        (["pools=[]"], "pools is empty"),
        (["outer.min_quorum"], "is not key=value"),
    ],
)
def test_bad_config_gives_one_line_error_naming_field_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert expected in msg
    assert "\n" not in msg


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_config_error_in_one_line_and_exits_2(capsys, tmp_path):
    code = main(["train", "--run-dir", str(tmp_path / "r"), "--set", "outer.lr=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["diloco train: config field 'outer.lr': Input should be greater than 0"]
    assert not (tmp_path / "r").exists(), "a bad config changes nothing on disk"


def test_missing_and_empty_parquet_dataset_say_so(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    missing = load_config(None, ["data.source=parquet", f"data.path={tmp_path / 'none.parquet'}", "data.text_column=text"])
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(missing)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    cfg = load_config(None, ["data.source=parquet", f"data.path={empty}", "data.text_column=text"])
    with pytest.raises(DataError, match="no rows"):
        load_corpus(cfg)
