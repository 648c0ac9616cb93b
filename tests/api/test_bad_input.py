"""A bad --model, --loss, --optimizer or dataset is refused before Ray starts: one line naming the fix, exit code 2,
no run directory (tests/api/bad_input_cases.py holds the table; docs/bad-input.md is printed from it).

Every case runs in-process through the CLI's own steps (parse, config, preflight, prepare): fast, and the
text a Python caller gets. The cases marked `cli` also run as `python -m orchestrator.cli train` with Ray
unimportable (about 3 s each, mostly importing torch), which must print that same text as its one line.
"""

from __future__ import annotations

import pytest

from tests.api.bad_input_cases import CASES, cli_args, error_lines, in_process_error, run_cli, write_datasets


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    return write_datasets(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_the_fix_before_ray_with_no_run_directory(case, datasets, tmp_path):
    run_dir = tmp_path / "run"
    message = in_process_error(case, datasets, run_dir)
    assert case.fix in message and "\n" not in message, message
    assert not run_dir.exists()
    if not case.cli:
        return
    done, seconds = run_cli(cli_args(case, datasets, run_dir))
    assert done.returncode == 2, done.stderr
    # Only the lines printed before the torch checks (emulation note, first start-up stage) come before it.
    assert error_lines(done.stderr) == [f"diloco train: {message}"], done.stderr
    assert done.stdout == ""
    assert not run_dir.exists()


def test_a_factory_error_keeps_the_users_exception_as_its_cause(datasets, tmp_path):
    """The one line is for the console; a Python caller still reaches the user's own exception."""
    from orchestrator.config import ConfigError, build_config
    from orchestrator.run.workload import prepare

    with pytest.raises(ConfigError, match="raised RuntimeError: checkpoint weights.pt not found") as err:
        prepare(build_config({"model": {"factory": "tests.api.bad_models:raises"}}))
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_model_fsdp_cannot_shard_is_refused_before_ray_only_where_a_pool_shards():
    from orchestrator.config import ConfigError, build_config
    from orchestrator.run.workload import prepare

    fsdp = {"model": {"factory": "tests.api.bad_models:scaled_lm"}, "health": {"salvage_every_steps": 0},
            "data": {"max_bytes": 200_000},
            "pools": [{"name": "a"}, {"name": "big", "workers_per_island": 2, "shard": "fsdp"}]}
    with pytest.raises(ConfigError) as err:
        prepare(build_config(fsdp))
    assert str(err.value) == ("pools ['big'] shard 'fsdp', but the model has 0-dim parameters ['scale'], which FSDP "
                              "cannot cut along dim 0; give them shape [1], or set shard: none on those pools")
    assert "scale" in prepare(build_config({**fsdp, "pools": [{"name": "a"}]})).initial, "unsharded it trains"


def test_the_flags_set_the_model_section_like_set_does():
    """--model/--loss/--optimizer are --set model.factory/loss/optimizer, taken verbatim (not parsed as YAML)."""
    from orchestrator.cli.main import build_parser
    from orchestrator.cli.train import with_model_flags
    from orchestrator.config import load_config

    args = build_parser("train").parse_args(["train", "--model", "a.b:c", "--loss", "a.b:loss", "--optimizer", "on:off",
                                             "--set", "model.factory=x.y:z"])
    model = with_model_flags(load_config(None, args.set), args).model
    assert (model.factory, model.loss, model.optimizer) == ("a.b:c", "a.b:loss", "on:off")
    plain = build_parser("train").parse_args(["train", "--set", "model.factory=x.y:z"])
    assert with_model_flags(load_config(None, plain.set), plain).model.factory == "x.y:z"


def test_resume_rebuilds_the_model_its_config_yaml_names_and_refuses_another(tmp_path, capsys):
    """config.yaml records model.factory, so --resume builds the same model; a different --model is refused."""
    import yaml

    from orchestrator.cli.main import main
    from orchestrator.config import load_config
    from orchestrator.run.preflight import resume_config
    from orchestrator.run.workload import prepare

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, ["model.factory=tests.api.bad_models:tiny_lm"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))  # as setup writes it
    before = (run_dir / "config.yaml").read_text()
    assert set(prepare(resume_config(run_dir)).initial) == {"embed.weight", "head.weight", "head.bias"}  # TinyLM's
    assert main(["train", "--resume", str(run_dir), "--model", "tests.api.bad_models:small_vocab"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diloco train: --resume cannot change model.factory"), err
    assert (run_dir / "config.yaml").read_text() == before and [p.name for p in run_dir.iterdir()] == ["config.yaml"]
