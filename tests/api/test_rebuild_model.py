"""A run directory records how to rebuild its model, and every command that reads one can be told (no Ray).

Whatever form `DilocoTrainer` was given the model in (an import path string, a function, a
`ModelFactory`, a function of a script run as `__main__`), config.yaml names a factory that rebuilds it
(orchestrator/run/import_paths.py); `diloco sample`, `evaluate` and `export` take `--model` in place of it,
importing from the current directory as `diloco train --model` does; where the model cannot be rebuilt,
the one-line error says what to pass. Run directories are written here as a run leaves them
(config.yaml through `recorded_config`, a checkpoint in orchestrator.core.checkpoint's format);
tests/api/test_readme_example.py does the same on a real run of the README's example.
"""

from __future__ import annotations

import functools
import os
import sys
import textwrap
import types

import pytest
import torch
import yaml

from islands.model_api import instantiate, resolve_factory, state_tensors
from orchestrator.api import Result
from orchestrator.cli.main import main as diloco
from orchestrator.config import RunConfig, build_config
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.run.import_paths import import_path_of, main_module_name
from orchestrator.run.trained import load_exported, load_trained
from orchestrator.run.workload import Workload, recorded_config
from tests.api import zoo

CNN = "tests.api.zoo:small_cnn"
# A user's module in the directory they work in: a small causal LM over bytes (plain torch, no extra needed).
MYMODELS = textwrap.dedent('''
    import torch.nn as nn


    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, 16)
            self.head = nn.Linear(16, 256)

        def forward(self, ids):
            return self.head(self.embed(ids))  # (B, T) -> (B, T, 256)


    def build():
        return TinyLM()
''')


def base_config() -> RunConfig:
    return build_config({"model": {"preset": "nano"}, "run": {"seed": 2}, "data": {"max_bytes": 200_000},
                         "eval": {"batches": 1, "batch_size": 4}})


def write_run(run_dir, cfg: RunConfig, factory) -> dict[str, torch.Tensor]:
    """A run directory as the driver leaves it: `cfg` as config.yaml, one checkpoint of `factory`'s model shifted
    away from its initial weights; returns the checkpoint's tensors."""
    run_dir.mkdir(parents=True)
    data = cfg.model_dump(mode="json")
    data["mode"] = "decoupled"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    trained = {n: t.detach() + 0.01 for n, t in state_tensors(instantiate(factory, cfg.run.seed)).items()}
    CheckpointStore(run_checkpoint_uri(None, run_dir)).save(
        3, {f"param/{n}": t for n, t in trained.items()},
        {"outer": {"versions": [3, 3]}, "epoch": 0, "extra": {"tokens_processed": 999}})
    return trained


class Builder:
    """A callable object: no import path rebuilds its argument."""

    def __init__(self, classes: int) -> None:
        self.classes = classes

    def __call__(self):
        return zoo.SmallCNN(self.classes)


@pytest.mark.parametrize("given", ["string", "function", "factory"])
def test_the_run_directory_records_the_model_in_whatever_form_it_was_given(tmp_path, given):
    """The bug: a model given as an import path string was recorded as `factory: null`, so sample, evaluate, export
    and Result.load_model() rebuilt the built-in model and refused the checkpoint."""
    model = {"string": f"  {CNN} ", "function": zoo.small_cnn, "factory": resolve_factory(CNN)}[given]
    cfg = recorded_config(base_config(), Workload(model=model, loss="tests.api.zoo:cnn_loss"))
    assert cfg.model.factory == CNN and cfg.model.loss == "tests.api.zoo:cnn_loss"
    saved = write_run(tmp_path / "run", cfg, CNN)
    t = load_trained(tmp_path / "run")
    assert isinstance(t.model, zoo.SmallCNN) and t.factory == CNN
    got = state_tensors(t.model)
    assert all(torch.equal(got[n], saved[n]) for n in saved)


def test_a_callable_object_records_no_path_and_its_run_says_what_to_pass(tmp_path, capsys):
    assert import_path_of(Builder(4)) is None and import_path_of(functools.partial(zoo.SmallCNN, 4)) is None
    cfg = recorded_config(base_config().model_copy(update={"model": base_config().model.model_copy(
        update={"factory": "tests.api.zoo:tiny_llama"})}), Workload(model=Builder(4)))
    assert cfg.model.factory is None, "the config's own path is not the model that trained"
    write_run(tmp_path / "run", cfg, Builder(4))
    assert diloco(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it names no model factory" in err and "--model PACKAGE.MODULE:" in err, err
    assert "Result.load_model(model=" in err
    t = Result(metrics={}, path=tmp_path / "run", checkpoint=None).load_model(model=Builder(4))
    assert isinstance(t, zoo.SmallCNN)


def script_module(tmp_path, name: str, body: str) -> types.SimpleNamespace:
    """What sys.modules['__main__'] is for `python NAME.py` run in tmp_path."""
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return types.SimpleNamespace(__file__=str(path), __spec__=None)


def test_a_function_of_a_script_is_recorded_as_the_scripts_module_when_importing_it_runs_nothing(tmp_path,
                                                                                                monkeypatch):
    guarded = "def build():\n    pass\n\n\nif __name__ == '__main__':\n    print('training')\n"
    assert main_module_name(script_module(tmp_path, "train_mine", guarded), tmp_path) == "train_mine"
    (tmp_path / "scripts").mkdir()
    nested = script_module(tmp_path / "scripts", "run_it", guarded)
    assert main_module_name(nested, tmp_path) == "scripts.run_it", "dotted from the working directory"
    assert main_module_name(nested, tmp_path / "elsewhere") == "run_it", "else from the script's own directory"
    # `python -m pkg.train`: the module it was run as.
    as_module = types.SimpleNamespace(__file__=nested.__file__, __spec__=types.SimpleNamespace(name="scripts.run_it"))
    assert main_module_name(as_module, tmp_path / "elsewhere") == "scripts.run_it"
    # Importing these would run their training, or find another module: no module name.
    assert main_module_name(script_module(tmp_path, "unguarded", "def build():\n    pass\nprint('training')\n"),
                            tmp_path) is None
    assert main_module_name(script_module(tmp_path, "code", guarded), tmp_path) is None, "stdlib `code` would win"
    assert main_module_name(types.SimpleNamespace(__spec__=None), tmp_path) is None, "a notebook has no file"

    def build():
        pass

    build.__module__ = "__main__"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "__main__", script_module(tmp_path, "train_mine", guarded))
    cfg = recorded_config(base_config(), Workload(model=build, loss=build))
    expected = f"train_mine:{build.__qualname__}"
    assert cfg.model.factory == expected and cfg.model.loss == expected
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=None))  # a notebook
    assert recorded_config(base_config(), Workload(model=build)).model.factory == f"__main__:{build.__qualname__}"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The user's working directory, holding mymodels.py, current and (as for the `diloco` console script) not on
    sys.path; sys.path and sys.modules are restored afterwards."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymodels.py").write_text(MYMODELS)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir, str(work))])
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    return work


def notebook_run(user_dir):
    """A run whose model was a notebook's function: config.yaml records `__main__:build`."""
    module = types.ModuleType("notebook")  # the notebook's namespace: the run's processes had its function
    exec(compile(MYMODELS, "notebook", "exec"), module.__dict__)
    cfg = base_config()
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"factory": "__main__:build"})})
    run = user_dir / "runs" / "nb"
    saved = write_run(run, cfg, module.build)
    return run, saved


def test_sample_evaluate_and_export_take_model_and_import_it_from_the_current_directory(user_dir, capsys):
    run, saved = notebook_run(user_dir)
    # Without --model: one line that says what to pass, for the command line and for Python.
    for command in (["sample", str(run)], ["evaluate", str(run)], ["export", str(run), "--out", "x.pt"]):
        assert diloco(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert "'__main__:build' was defined in a notebook or in a script without an `if __name__" in err, err
        assert "--model PACKAGE.MODULE:build" in err and "Result.load_model(model=build)" in err, err

    assert diloco(["sample", str(run), "--model", "mymodels:build", "--prompt", "ab", "--bytes", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab") and "checkpoint 3 (decoupled" in err
    assert diloco(["evaluate", str(run), "--model", "mymodels:build"]) == 0
    out = capsys.readouterr().out
    assert "held-out loss " in out and " nats/byte" in out
    assert diloco(["export", str(run), "--model", "mymodels:build", "--out", "m.pt"]) == 0
    capsys.readouterr()
    payload = torch.load(user_dir / "m.pt", weights_only=True)
    assert payload["factory"] == "mymodels:build", "the export records the factory that rebuilt it"
    again = load_exported(user_dir / "m.pt")
    assert all(torch.equal(again.state_dict()[n], saved[n]) for n in saved)

    # A --model of another model: refused, naming both sides.
    assert diloco(["sample", str(run), "--model", CNN]) == 2
    err = capsys.readouterr().err
    assert "does not fit the model given to rebuild it ('tests.api.zoo:small_cnn', a SmallCNN)" in err, err

    # A run of a model in the user's module: rebuilt from the directory it was trained from, and only there.
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["factory"] = "mymodels:build"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    sys.modules.pop("mymodels")
    sys.path.remove(str(user_dir))  # appended by the commands above, as the console script would
    assert diloco(["sample", str(run), "--bytes", "3"]) == 0
    capsys.readouterr()
    sys.modules.pop("mymodels")
    sys.path.remove(str(user_dir))
    os.chdir(user_dir.parent)
    assert diloco(["sample", str(run), "--bytes", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its model factory 'mymodels:build' does not import here (No module named " \
        "'mymodels'); run this from the directory the run was trained from, or pass its factory: --model" in err, err
    os.chdir(user_dir)

    # The run's loss was the notebook's too: evaluate says to pass it, and takes it.
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["loss"] = "__main__:my_loss"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (user_dir / "mymodels.py").write_text(MYMODELS + "\nfrom islands.model_api import default_loss as my_loss\n")
    assert diloco(["evaluate", str(run), "--model", "mymodels:build"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its loss '__main__:my_loss' was defined in a notebook" in err, err
    assert "pass the loss: --loss PACKAGE.MODULE:my_loss" in err, err
    sys.modules.pop("mymodels")  # imported before my_loss was added
    assert diloco(["evaluate", str(run), "--model", "mymodels:build", "--loss", "mymodels:my_loss"]) == 0
    assert "held-out loss " in capsys.readouterr().out


def test_result_load_model_rebuilds_with_the_factory_fit_was_given_or_the_one_passed(user_dir):
    run, saved = notebook_run(user_dir)
    sys.path.append(str(user_dir))
    import mymodels

    for result, kwargs in ((Result(metrics={}, path=run, checkpoint=None), {"model": "mymodels:build"}),
                           (Result(metrics={}, path=run, checkpoint=None, factory=mymodels.build), {})):
        model = result.load_model(**kwargs)
        assert type(model).__name__ == "TinyLM" and not model.training
        assert all(torch.equal(state_tensors(model)[n], saved[n]) for n in saved)
