"""Config mistakes a run would not notice: settings that do nothing under the others, fields of a union, misspelt keys.

No Ray, no torch: each case is a config load. A setting given a value of its own where the other settings leave
it nothing to do is refused in one line naming it, why, and the fix (orchestrator.config.INERT_RULES); a default
value, written out or not, is never refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.main import main
from orchestrator.config import INERT_RULES, ConfigError, RunConfig, apply_overrides, build_config, load_config

ROOT = Path(__file__).resolve().parents[2]
PARQUET = ["data.source=parquet", "data.path=/corpus", "data.text_column=text"]
TOKENS = ["data.source=tokens", "data.path=/corpus", "data.vocab_size=50257"]

# (field, overrides that give it where it does nothing, overrides that give it where it acts)
CASES = [
    ("data.path", ["data.path=/nope"], PARQUET),
    ("data.text_column", ["data.text_column=text"], PARQUET),
    ("data.token_column", [*TOKENS, "data.token_column=ids"],
     ["data.source=parquet", "data.path=/corpus", "data.token_column=ids"]),
    ("data.tokenizer", [*TOKENS, "data.tokenizer=train"], [*PARQUET, "data.tokenizer=train"]),
    ("data.token_dtype", ["data.token_dtype=uint32"], [*TOKENS, "data.token_dtype=uint32"]),
    ("data.max_bytes", [*PARQUET, "data.max_bytes=1000000"], ["data.max_bytes=1000000"]),
    ("data.unit_tokens", [*PARQUET, "data.unit_tokens=4096"], [*TOKENS, "data.unit_tokens=4096"]),
    ("data.unit_examples", [*TOKENS, "data.unit_examples=64"], ["data.unit_examples=64"]),
    ("data.vocab_size", ["data.vocab_size=500"], ["data.tokenizer=train", "data.vocab_size=500"]),
    ("data.tokenizer_sample_bytes", ["data.tokenizer_sample_bytes=1000000"],
     ["data.tokenizer=train", "data.tokenizer_sample_bytes=1000000"]),
    ("pools.slow.data_path", ["pools.slow.data_path=/copy"], [*PARQUET, "pools.slow.data_path=/copy"]),
    ("inner.lr_final_ratio", ["inner.lr_final_ratio=0.2"], ["inner.lr_schedule=cosine", "inner.lr_final_ratio=0.2"]),
    ("outer.compression_block_size", ["outer.compression=topk", "outer.compression_block_size=128"],
     ["outer.downlink=int8", "outer.compression_block_size=128"]),
    ("outer.topk_density", ["outer.compression=int8", "outer.topk_density=0.1"],
     ["outer.downlink_delta=topk", "outer.topk_density=0.1"]),
    ("outer.feedback_decay", ["outer.feedback_decay=0.9"], ["outer.compression=sign", "outer.feedback_decay=0.9"]),
    ("outer.partial_momentum", ["outer.step_scale=participation", "outer.partial_momentum=0.5"],
     ["outer.partial_momentum=0.5"]),
    ("outer.partial_momentum", ["outer.optimizer=torch.optim:Adam", "outer.partial_momentum=0.5"],
     ["outer.partial_momentum=0.5"]),
    ("outer.lr", ["outer.optimizer=torch.optim:Adam", "outer.lr=0.5"], ["outer.lr=0.5"]),
    ("outer.momentum", ["outer.optimizer=torch.optim:Adam", "outer.momentum=0.5"], ["outer.momentum=0.5"]),
    ("chaos.horizon_s", ["chaos.mode=fixed", "chaos.params={failures_per_island: 2}", "chaos.horizon_s=60"],
     ["chaos.mode=poisson", "chaos.params={mtbf_s: 30}", "chaos.horizon_s=60"]),
    ("chaos.params", ["chaos.params={mtbf_s: 30}"], ["chaos.mode=poisson", "chaos.params={mtbf_s: 30}"]),
    ("network.local_step_s", ["network.local_step_s=0.5"],
     ["network.scenario=wan-4-regions", "pools.fast.region=us-east", "pools.slow.region=us-west",
      "network.local_step_s=0.5"]),
    ("network.step_concurrency", ["network.step_concurrency=2"], ["network.scenario=lan", "network.step_concurrency=2"]),
]


@pytest.mark.parametrize("field, inert, acts", CASES, ids=[c[0] for c in CASES])
def test_a_setting_with_no_effect_is_refused_in_one_line_and_loads_where_it_acts(field, inert, acts):
    with pytest.raises(ConfigError) as err:
        load_config(None, inert)
    msg = str(err.value)
    assert msg.startswith(f"{field}=") and " has no effect: " in msg and "\n" not in msg, msg
    assert re.search(r"; (set|drop|use) ", msg), f"no fix named: {msg}"
    load_config(None, acts)


def test_every_rule_has_a_case_and_a_row_in_docs_config():
    cased = {re.sub(r"^pools\.[a-z]+\.", "pools.", c[0]) for c in CASES}
    assert {r.field for r in INERT_RULES} == cased
    doc = (ROOT / "docs" / "config.md").read_text().split("## Settings that have no effect", 1)[1]
    for rule in INERT_RULES:
        shown = rule.field.replace("pools.", "pools[].")
        assert f"`{shown}`" in doc, f"docs/config.md's 'Settings that have no effect' lacks {shown}"


def test_a_default_value_is_never_set_written_out_or_resolved():
    # configs/default.yaml writes every field out; a dump of any loaded config does too (run directories, --resume).
    load_config(ROOT / "configs" / "default.yaml")
    for shipped in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(shipped)
    cfg = load_config(None, [*PARQUET, "data.tokenizer=train", "outer.compression=int2", "chaos.mode=fixed",
                             "chaos.params={failures_per_island: 1}", "mode=sync-diloco"])
    assert build_config(cfg.model_dump(mode="json")) == cfg
    assert load_config(None, ["chaos.horizon_s=180", "data.token_dtype=uint16", "outer.compression_block_size=256"])


def test_a_run_directorys_recorded_config_loads_as_it_was_written():
    # What the engine records (datasets from Python as source 'python') or an older version wrote.
    recorded = {"data": {"source": "python", "max_bytes": 200_000, "token_dtype": "uint32"},
                "outer": {"compression_block_size": 128}}
    with pytest.raises(ConfigError, match="compression_block_size=128 has no effect"):
        build_config(recorded)
    assert build_config(recorded, recorded=True).outer.compression_block_size == 128


def test_overrides_on_a_runs_config_are_checked_alone():
    # `diloco evaluate RUN --set ...` and `--resume RUN --set ...` apply overrides to the run's config: another corpus
    # leaves the run's own stdlib cap alone (it does nothing there, but the user did not give it), while a setting
    # the overrides add where it does nothing is refused, a pool by name or by index.
    run = load_config(None, ["data.max_bytes=1000000"]).model_dump(mode="json")
    assert build_config(apply_overrides(run, PARQUET)).data.source == "parquet"
    with pytest.raises(ConfigError, match=r"^data\.path='/x' has no effect: data\.source is 'stdlib'"):
        build_config(apply_overrides(run, ["data.path=/x"]))
    for key in ("pools.slow.data_path", "pools.1.data_path"):
        with pytest.raises(ConfigError, match=r"^pools\.slow\.data_path='/c' has no effect"):
            build_config(apply_overrides(run, [f"{key}=/c"]))
    with pytest.raises(ConfigError, match="max_bytes=1000000 has no effect"):  # the same, all the caller's own
        load_config(None, ["data.max_bytes=1000000", *PARQUET])


def test_chaos_flag_is_checked_with_the_config_before_anything_starts(monkeypatch, capsys):
    import orchestrator.run.preflight as preflight

    def reached(*a, **k):
        raise AssertionError("the config should have been refused before preflight")

    monkeypatch.setattr(preflight, "preflight", reached)
    assert main(["train", "--chaos", "fixed:failures=3", "--set", "chaos.horizon_s=60"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["diloco train: chaos.horizon_s=60.0 has no effect: only chaos mode poisson draws faults over a horizon, "
                   "and it is 'fixed' (fixed spreads its faults over the token budget); drop chaos.horizon_s, or use "
                   "chaos mode poisson"]


# ------------------------------------------------------------------ how a validation error reads


@pytest.mark.parametrize("overrides, expected", [
    (["outer.min_quorum=two"], "config field 'outer.min_quorum': Input should be a valid integer or 'all', got 'two'"),
    (["outer.min_quorum=1.5"], "config field 'outer.min_quorum': Input should be a valid integer or 'all', got 1.5"),
    (["outer.min_quorum=0"], "config field 'outer.min_quorum': min_quorum must be >= 1 or 'all', got 0"),
    (["inner.grad_clip=abc"], "config field 'inner.grad_clip': Input should be a valid number"),
    (["outer.downlink_delta=int9"], "config field 'outer.downlink_delta': Input should be 'bf16', 'int8', 'int4', 'int2', "
                                    "'sign' or 'topk'"),
])
def test_a_union_fields_error_names_the_field_and_every_member(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert msg.startswith(expected), msg
    assert ".int'" not in msg and "literal[" not in msg and "\n" not in msg


@pytest.mark.parametrize("overrides, where, suggestion", [
    (["outr.lr=0.5"], "outr", "outer"),
    (["outer.min_quorm=2"], "outer.min_quorm", "outer.min_quorum"),
    (["data.tokenzier=train"], "data.tokenzier", "data.tokenizer"),
    (["pools.slow.islandz=3"], "pools.1.islandz", "pools.1.islands"),
    (["pools=[{name: a, emulated_slowdwn: 2}]"], "pools.0.emulated_slowdwn", "pools.0.emulated_slowdown"),
])
def test_an_unknown_key_at_any_depth_gets_the_nearest_field(overrides, where, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == (f"unknown config field '{where}'; remove it or check the spelling: did you mean "
                              f"'{suggestion}'? (see configs/default.yaml)")


def test_an_unknown_key_in_a_file_gets_the_nearest_field_and_a_far_one_none(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"health": {"warm_spare": 0}}))
    with pytest.raises(ConfigError, match=re.escape("did you mean 'health.warm_spares'?")):
        load_config(path)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run.zzzz=1"])
    assert str(err.value) == "unknown config field 'run.zzzz'; remove it or check the spelling (see configs/default.yaml)"


def test_the_default_config_is_untouched_by_the_rules():
    assert RunConfig() == build_config({})


def test_overrides_still_write_out_as_plain_yaml(tmp_path):
    data = apply_overrides({}, ["run.seed=3", "pools.fast.islands=1"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_config(path).run.seed == 3
