"""Configuration: loaded once at the edge, one-line errors that name the field and the fix."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from islands.data import DataError
from orchestrator.cli.main import main
from orchestrator.config import ConfigError, RunConfig, load_config, resume_conflict
from orchestrator.run.driver import load_corpus
from orchestrator.settings import island_specs, outer_settings

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_default_yaml_equals_builtin_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == RunConfig()


def test_shipped_default_yaml_writes_out_every_field():
    # Equality alone passes when a field is missing (it takes its default): the file is the defaults written out.
    written = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())

    def missing(model: type, section: dict, prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            if name not in section:
                out.append(prefix + name)
            elif isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
                out += missing(field.annotation, section[name] or {}, f"{prefix}{name}.")
        return out

    assert missing(RunConfig, written) == []


def test_a_data_parallel_run_config_loads_again_only_where_that_mode_is_allowed(tmp_path):
    # `diloco baseline-dp --config RUN_DIR/config.yaml` reruns a data-parallel run; the engine refuses it.
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**RunConfig().model_dump(mode="json"), "mode": "data-parallel"}))
    cfg = load_config(path, ["inner.lr=0.004"], also_mode="data-parallel")
    assert cfg.inner.lr == 0.004 and cfg.mode == "decoupled"
    with pytest.raises(ConfigError, match="config field 'mode'") as err:
        load_config(path)
    assert "\n" not in str(err.value)


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
        (["outer.compression=int3"], "unknown compression 'int3'; use one of none, bf16, int8, int4, int2, sign, topk"),
        (["outer.min_quorum=9"], "exceeds the 4 islands"),
        (["run.token_budget=-5"], "config field 'run.token_budget'"),
        (["mode=sync-diloco", "outer.merge_rule=rda"], "conflicts with mode sync-diloco"),
        (["data.source=parquet"], "data.path is required"),
        (["pools=[]"], "pools is empty"),
        (["outer.min_quorum"], "is not key=value"),
        (["pools=[{name: a, accelerator: H100}]"], "pool 'a': accelerator 'H100' trains on a GPU but gpus_per_worker is 0"),
        (["pools=[{name: a, accelerator: H100, workers_per_island: 2, gpus_per_worker: 0.5}]"],
         "pool 'a': 2 workers per island on GPUs need a whole GPU each (NCCL refuses two ranks on one card)"),
        (["pools.fast.shard=fsdp"], "pool 'fast': shard 'fsdp' splits an island's model over its workers, but "
                                    "workers_per_island is 1; set workers_per_island: 2 or more, or shard: none"),
        (["pools=[{name: a, workers_per_island: 2, shard: fsdp}]"],
         "shard 'fsdp' but health.salvage_every_steps is 5: a progress snapshot covers every fragment, the whole model "
         "on one worker; set health.salvage_every_steps: 0 or shard: none"),
        (["pools=[{name: a, workers_per_island: 2, shard: fsdp}]", "health.salvage_every_steps=0", "outer.compression=int2"],
         "outer.compression 'int2' keeps an error-feedback residual of every fragment on the leader; use none, bf16, "
         "int8 or int4, or shard: none"),
        (["pools.0.shard=zero3"], "config field 'pools.0.shard': Input should be 'none' or 'fsdp'"),
        (["network.step_concurrency=0"], "config field 'network.step_concurrency'"),
        (["inner.precision=fp16"], "config field 'inner.precision': Input should be 'fp32', 'tf32' or 'bf16'"),
        (["pools.0.precision=fp8"], "config field 'pools.0.precision': Input should be 'fp32', 'tf32' or 'bf16'"),
        (["outer.publish_to=some"], "config field 'outer.publish_to': Input should be 'all' or 'participants'"),
        (["pools.2.islands=1"], "pools has 2 entries, so index 2 does not exist; use 0..1 or a name (fast, slow)"),
        (["pools.medium.islands=1"], "pools has no entry named 'medium'; use one of fast, slow or an index 0..1"),
        (["pools.slow=1"], "pools.slow is a whole entry of a list; set one of its fields"),
        (["pools.0.islands=-1"], "config field 'pools.0.islands'"),
        (["outer.sync_every_schedule=[[0.1, 41]]"], "sync_every_schedule[0] has H = 41, not a multiple of num_fragments "
                                                    "(P=2); pick H = 40"),
        (["outer.sync_every_schedule=[[0.5, 40], [0.2, 20]]"], "sync_every_schedule[1] ends at 0.2; each until_fraction"),
        (["outer.sync_every_schedule=[[0.5]]"], "sync_every_schedule[0] is [0.5]; give [until_fraction, H] pairs"),
    ],
)
def test_bad_config_gives_one_line_error_naming_field_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    msg = str(err.value)
    assert expected in msg
    assert "\n" not in msg


def test_fsdp_pool_with_what_it_supports_loads():
    cfg = load_config(None, ["pools=[{name: a, workers_per_island: 2, shard: fsdp}]", "health.salvage_every_steps=0",
                             "outer.compression=int4"])
    assert cfg.pools[0].shard == "fsdp" and RunConfig().pools[0].shard == "none"


def test_set_addresses_one_pool_by_index_or_name_and_leaves_the_others(tmp_path):
    default = RunConfig().pools
    cfg = load_config(None, ["pools.0.islands=3", "pools.slow.emulated_slowdown=2.5"])
    assert [(p.name, p.islands, p.emulated_slowdown) for p in cfg.pools] == [
        (default[0].name, 3, default[0].emulated_slowdown), (default[1].name, default[1].islands, 2.5)]
    path = tmp_path / "c.yaml"
    path.write_text("pools: [{name: a, islands: 1}, {name: b, islands: 1}, {name: c, islands: 1}]\n")
    assert [p.islands for p in load_config(path, ["pools.c.islands=4", "pools.1.islands=2"]).pools] == [1, 2, 4]


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_config_error_in_one_line_and_exits_2(capsys, tmp_path):
    code = main(["train", "--run-dir", str(tmp_path / "r"), "--set", "outer.lr=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == ["diloco train: config field 'outer.lr': Input should be greater than 0"]
    assert not (tmp_path / "r").exists(), "a bad config changes nothing on disk"


def test_resume_refuses_changes_to_what_the_checkpoints_and_cursors_depend_on(capsys, tmp_path):
    saved = load_config(None, ["pools=[{name: a, islands: 2}, {name: b, islands: 1, workers_per_island: 2}]"])
    same = lambda *o: load_config(None, ["pools=[{name: a, islands: 2}, {name: b, islands: 1, workers_per_island: 2}]", *o])  # noqa: E731
    # What may change: budget, evaluation, health, network, outer hyperparameters.
    assert resume_conflict(saved, same("run.token_budget=9000000", "eval.interval_s=5", "outer.lr=0.5",
                                       "health.hang_factor=10", "network.scenario=lan")) is None
    msg = resume_conflict(saved, same("model.preset=nano"))
    assert msg.startswith("--resume cannot change model.preset (the run has tiny, asked for nano)") and "\n" not in msg
    assert "data.batch_size (the run has 16, asked for 8)" in resume_conflict(saved, same("data.batch_size=8"))
    assert "run.seed" in resume_conflict(saved, same("run.seed=1"))
    assert "outer.num_fragments" in resume_conflict(saved, same("outer.num_fragments=4"))
    changed = load_config(None, ["pools=[{name: a, islands: 2}, {name: b, islands: 1, workers_per_island: 1}]"])
    assert "['a: 2 islands x 1 workers', 'b: 1 islands x 2 workers']" in resume_conflict(saved, changed)

    # The CLI says so in one line and touches nothing: no Ray, the run directory as it was.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved.model_dump(mode="json"), sort_keys=False))
    before = (run_dir / "config.yaml").read_text()
    code = main(["train", "--resume", str(run_dir), "--set", "pools=[{name: a, islands: 3}, {name: b, islands: 1, workers_per_island: 2}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("diloco train: --resume cannot change pools")
    assert (run_dir / "config.yaml").read_text() == before and sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


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


def test_sync_every_schedule_reaches_islands_and_the_outer_grace_tau():
    cfg = load_config(None, ["outer.sync_every_steps=186", "outer.sync_every_schedule=[[0.1, 40], [0.5, 100]]"])
    assert cfg.outer.sync_every_schedule == [(0.1, 40), (0.5, 100)]
    assert cfg.outer.tau_schedule() == ((0.1, 20), (0.5, 50))  # H/P per phase, P = 2
    assert load_config(None, ["outer.sync_every_schedule=[[0.1, 40]]", "outer.tau_steps=7"]).outer.tau_schedule() == ()
    assert {s.sync_every_schedule for s in island_specs(cfg, None, None)} == {((0.1, 40), (0.5, 100))}
    assert outer_settings(cfg).tau_schedule == ((0.1, 20), (0.5, 50))
