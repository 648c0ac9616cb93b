"""The model a run trained: load it from the run directory, sample from it, evaluate it, export it.

A run's global parameters live in its checkpoints (orchestrator.core.checkpoint; `checkpoint.uri`, default
RUN_DIR/checkpoints), beside their moving average when the run kept one (`run.average_window`). `diloco
train` writes the last one after the final flush, so it holds exactly the model `summary.json`'s final
held-out loss was measured on (the average where there is one); `diloco baseline-dp` saves its final
parameters the same way. `--raw` loads the global parameters instead of the average. :func:`load_trained`
rebuilds the model from the run's `config.yaml` (the built-in byte transformer of `model.preset`, or the
user's model from the import path `model.factory`) and loads the newest (or a chosen) checkpoint into
it, refusing in one line anything that does not fit.

`diloco sample RUN_DIR --prompt "def "` prints a continuation (any causal LM: the built-in model or,
say, a Hugging Face one); `diloco evaluate RUN_DIR` scores the model on the run's held-out data or on
another corpus (`--set data.*`); `diloco export RUN_DIR --out PATH [--format torch|hf]` writes it out.
The three commands' argparse lives in orchestrator/cli/model.py.

Export formats (:func:`export_model`):

- `--format torch` (the default), one file that `torch.load(path, weights_only=True)` reads: a dict of
  tensors and plain values only. For the built-in model, format :data:`EXPORT_FORMAT`: `{"format",
  "model_config" (the ModelConfig fields), "state_dict", "mode", "step", "tokens_processed"}`. For a
  user's model, format :data:`MODULE_EXPORT_FORMAT`: `{"format", "factory" (the model factory's
  import path), "seed" (the run's seed the factory ran under), "state_dict" (the module's whole
  `state_dict()`: tied weights under every name the module gives them, all persistent buffers),
  "mode", "step", "tokens_processed"}`. :func:`load_exported` rebuilds either model (a user model from
  its factory, which must be importable) and loads the state dict strictly.
- `--format hf`, for a `transformers.PreTrainedModel` only: a Hugging Face folder written by
  `model.save_pretrained` (config.json, model.safetensors; transformers stores a tied weight once and
  ties it again on load), which `AutoModelForCausalLM.from_pretrained(folder)` reads. A run that kept
  a tokenizer (RUN_DIR/tokenizer.json, :data:`RUN_TOKENIZER_FILE`) gets it copied into the folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from islands.model import ModelConfig, build_model
from islands.model_api import ModelError, instantiate, resolve_callable, state_tensors
from islands.spec import ModelRecipe
from orchestrator.config import DATA_PARALLEL_MODE, ConfigError, RunConfig, apply_overrides, build_config
from orchestrator.core.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    checkpoint_dirname,
    run_checkpoint_uri,
)
from orchestrator.run.import_paths import import_path_of, is_main_path
from orchestrator.run.workload import TOKENIZER_FILE
from orchestrator.settings import model_recipe

__all__ = ["EXPORT_FORMAT", "EXPORT_FORMATS", "MODULE_EXPORT_FORMAT", "RUN_TOKENIZER_FILE", "TrainedModel",
           "TrainedModelError", "evaluate_trained", "export_model", "load_exported", "load_trained", "read_run_config",
           "run_text_codec"]

EXPORT_FORMAT = "decoupled-diloco/byte-transformer/1"
"""`format` of a `--format torch` file of the built-in ByteTransformer: its shape and state dict."""
MODULE_EXPORT_FORMAT = "decoupled-diloco/torch-module/1"
"""`format` of a `--format torch` file of a user's model: its factory's import path and its state dict."""
EXPORT_FORMATS = ("torch", "hf")
"""What `diloco export --format` takes: one PyTorch file, or a Hugging Face folder."""
RUN_TOKENIZER_FILE = TOKENIZER_FILE  # written by the run (orchestrator/run/workload.py)
"""A run directory's tokenizer, where the run tokenized its text (islands.tokenizer); absent: UTF-8 bytes."""


class TrainedModelError(RuntimeError):
    """A run's trained model cannot be loaded or exported; the message names what and the fix."""


@dataclass(frozen=True)
class TrainedModel:
    """A run's global model as loaded from one checkpoint."""

    model: torch.nn.Module
    """The model on the CPU in eval mode, float32, its state tensors (parameters, trained buffers) the checkpoint's."""
    run_config: RunConfig
    """The run's resolved config (its `config.yaml`)."""
    mode: str
    """decoupled | sync-diloco | streaming-diloco | data-parallel."""
    step: int
    """The checkpoint's number."""
    checkpoint: str
    """Where the checkpoint was read from."""
    versions: list[int] | None
    """Each fragment's version at the checkpoint (engine runs); None for data parallel."""
    tokens_processed: int | None
    """Tokens the run had processed when the checkpoint was written, where it recorded them."""
    averaged: bool = False
    """True when the parameters are the run's moving average of its global model (run.average_window)."""
    run_dir: Path | None = None
    """The run directory it was loaded from (where a tokenizer it used would be)."""
    rebuilt_by: Any = None
    """The model factory given to :func:`load_trained` in place of config.yaml's (a callable or an import path)."""

    @property
    def factory(self) -> str | None:
        """The import path of the user's model factory (config `model.factory`); None for the built-in model."""
        return self.run_config.model.factory

    @property
    def seq_len(self) -> int:
        """The run's context length in tokens (`model.seq_len`, the preset's unless overridden)."""
        return self.run_config.model.shape().seq_len


def read_run_config(run_dir: str | Path) -> tuple[RunConfig, str]:
    """(resolved config, mode) of a run directory written by `diloco train` or `diloco baseline-dp`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise TrainedModelError(f"{run_dir} is not a directory; pass a run directory written by `diloco train` "
                                "or `diloco baseline-dp`")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise TrainedModelError(f"{run_dir} has no config.yaml; pass a run directory written by `diloco train` "
                                "or `diloco baseline-dp`")
    try:
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"it holds a {type(data).__name__}, not a mapping")
        mode = data.get("mode", "decoupled")
        if mode == DATA_PARALLEL_MODE:  # not an engine mode: the rest of the config is the engine's
            data = {k: v for k, v in data.items() if k != "mode"}
        cfg = build_config(data, recorded=True)  # a run records what it resolved; no-effect rules are for input
    except (ConfigError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TrainedModelError(f"{path} is not a valid run config ({first}); was it edited by hand?") from None
    return cfg, mode if mode == DATA_PARALLEL_MODE else cfg.mode


def load_trained(run_dir: str | Path, *, step: int | None = None, raw: bool = False, model: Any = None) -> TrainedModel:
    """Rebuild the model of `run_dir` and load checkpoint `step` into it (None = the newest).

    The model is the run's served model: the moving average of its global parameters where the run
    kept one (`run.average_window`), else the global parameters; `raw=True` loads the global
    parameters either way. `model`: a zero-argument factory or its import path ``package.module:function``
    to rebuild it with, in place of the one config.yaml records (`--model` of sample, evaluate and export).

    The checkpoint's payload is verified against its checksum; a checkpoint whose parameters do not
    match the model of the run's config (a missing, extra or reshaped tensor) is refused, naming the
    first mismatch. A model that cannot be rebuilt (its factory does not import here, or config.yaml names
    none for a model of the user's) is refused in one line that says what to pass as `model`.
    A run still training can be read: its newest checkpoint is a consistent snapshot.
    """
    cfg, mode = read_run_config(run_dir)
    recorded = cfg.model.factory
    if model is not None:  # what export records and evaluate rebuilds from then on
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"factory": import_path_of(model)})})
    step, ckpt = _checkpoint(cfg, run_dir, step)
    recipe, built = _rebuild(cfg, ckpt, run_dir, model, recorded)
    average = {} if raw else ckpt.average_parameters()
    where = f"checkpoint {checkpoint_dirname(step)} of {run_dir}"
    _load_into(built, average or ckpt.parameters(), where, *_mismatch_words(cfg, recipe, built, model))
    built.eval()
    meta = ckpt.meta
    versions = meta.get("outer", {}).get("versions")
    tokens = meta.get("tokens_processed", meta.get("extra", {}).get("tokens_processed"))
    return TrainedModel(model=built, run_config=cfg, mode=mode, step=step, checkpoint=ckpt.path,
                        versions=None if versions is None else list(versions),
                        tokens_processed=None if tokens is None else int(tokens), averaged=bool(average),
                        run_dir=Path(run_dir), rebuilt_by=model)


def _checkpoint(cfg: RunConfig, run_dir: str | Path, step: int | None) -> tuple[int, Checkpoint]:
    """(step, checkpoint) of the run's checkpoint `step` (None = the newest), its payload verified. Raises
    TrainedModelError (one line) for a run without checkpoints, a step it does not hold, or a corrupt one."""
    uri = run_checkpoint_uri(cfg.checkpoint.uri, run_dir)
    if "://" not in uri and not Path(uri).is_dir():
        raise TrainedModelError(f"{run_dir} has no checkpoints at {uri}: the run failed before its first one, or it "
                                "is a data-parallel run from before `diloco baseline-dp` kept its model; train it again")
    store = CheckpointStore(uri)
    steps = store.list()
    if not steps:
        raise TrainedModelError(f"no complete checkpoint under {uri}; the run saved none yet")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise TrainedModelError(f"no checkpoint {step} under {uri}; it holds {', '.join(map(str, steps))} "
                                "(older ones are pruned: checkpoint.keep)")
    try:
        return step, store.load(step)
    except CheckpointError as err:
        raise TrainedModelError(str(err)) from None


def _rebuild(cfg: RunConfig, ckpt: Checkpoint, run_dir: str | Path, model: Any,
             recorded: str | None) -> tuple[ModelRecipe, torch.nn.Module]:
    """The run's model recipe and a fresh model built from it (`model`: the factory given in place of the one
    config.yaml records, `recorded`). Raises TrainedModelError (one line: what to pass) when it cannot be built."""
    shape = cfg.model.shape()
    rows = ckpt.parameters().get("tok_emb.weight")
    if model is None and cfg.model.factory is None and rows is not None:
        # The built-in model's vocabulary is the data's (a trained tokenizer's, a token column's): read it
        # from the checkpoint's token table rather than from the config, which names no vocabulary.
        shape = dataclasses.replace(shape, vocab_size=int(rows.shape[0]))
    recipe = model_recipe(cfg, shape=shape, model=model)
    try:
        return recipe, instantiate(recipe.model, recipe.seed)
    except ModelError as err:
        raise TrainedModelError(f"cannot rebuild the model of {run_dir}: {_unbuildable(model, recorded, err)}") from None


def _mismatch_words(cfg: RunConfig, recipe: ModelRecipe, built: torch.nn.Module, model: Any) -> tuple[str, str, str]:
    """What a checkpoint that does not fit the rebuilt model most likely means, and its fix: (the model it was
    checked against, that model named, the fix), for the model given or the one config.yaml names."""
    if model is not None:
        return "the model given to rebuild it", f"{recipe.name!r}, a {type(built).__name__}", \
            "pass the factory the run trained"
    named_as = recipe.name
    if cfg.model.factory is None:
        named_as += ", the built-in model: it names no model factory"
    fix = ("was config.yaml changed after the run? " + ("if the run trained a model of your own, " if
           cfg.model.factory is None else "else ") + _pass_model(cfg.model.factory))
    return "the model of its config.yaml", named_as, fix


def _load_into(built: torch.nn.Module, params: dict[str, torch.Tensor], where: str, cause: str, named_as: str,
               fix: str) -> None:
    """Copy `params` into `built`'s state tensors; raises TrainedModelError (one line, naming the first mismatch,
    `cause`, `named_as` and `fix`) for a missing, extra or reshaped tensor."""
    named = state_tensors(built)
    missing, extra = sorted(set(named) - set(params)), sorted(set(params) - set(named))
    if missing or extra:
        which = f"the model has {missing[0]!r}, the checkpoint not" if missing else \
            f"the checkpoint has {extra[0]!r}, the model not"
        raise TrainedModelError(f"{where} does not fit {cause} ({named_as}): {which}; {fix}")
    with torch.no_grad():
        for name, p in named.items():
            t = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise TrainedModelError(f"{where}: {name} has shape {tuple(t.shape)} but {cause} wants "
                                        f"{tuple(p.shape)}; {fix}")
            p.copy_(t)


def _pass_model(recorded: str | None) -> str:
    """What to pass to rebuild a run's model, in the command line's words and in Python's."""
    name = recorded.partition(":")[2] if recorded and ":" in recorded else "make_model"
    return (f"pass its factory: --model PACKAGE.MODULE:{name} (a module that defines it, importable from the current "
            f"directory), or in Python Result.load_model(model={name.split('.')[-1]})")


def _unbuildable(given: Any, recorded: str | None, err: ModelError) -> str:
    """Why the model cannot be rebuilt, and what to pass instead, in one line."""
    if given is not None:  # the user's own --model: its own message says what is wrong with it
        return str(err)
    if is_main_path(recorded):
        return (f"its model factory {recorded!r} was defined in a notebook or in a script without an "
                f"`if __name__ == \"__main__\":` block, which no other process can import; {_pass_model(recorded)}")
    if isinstance(err.__cause__, ModuleNotFoundError):  # a module beside the user, looked for from elsewhere
        return (f"its model factory {recorded!r} does not import here ({err.__cause__}); run this from the directory "
                f"the run was trained from, or {_pass_model(recorded)}")
    return f"{err}; or {_pass_model(recorded)}"


def run_text_codec(run_dir: str | Path | None) -> Any:
    """How the run's text maps to token ids: an object with `encode(str) -> list[int]` and `decode(ids) -> str`.

    The tokenizer hook: a run that tokenized its text keeps RUN_DIR/tokenizer.json (:data:`RUN_TOKENIZER_FILE`),
    read by islands.tokenizer's `text_encoder`; any other run reads and writes UTF-8 bytes
    (islands.sampling.ByteText, vocabulary 256), as the byte corpora do.
    """
    from islands.sampling import ByteText

    file = Path(run_dir) / RUN_TOKENIZER_FILE if run_dir is not None else None
    if file is None or not file.is_file():
        return ByteText()
    from islands.tokenizer import text_encoder  # numpy only; `tokenizers` is imported by the loader if the file needs it

    try:
        return text_encoder(file)
    except Exception as err:  # noqa: BLE001 - a missing extra or a damaged file: one line either way
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TrainedModelError(f"cannot read the run's tokenizer {file} ({first})") from None


def evaluate_trained(trained: TrainedModel, overrides: list[str] | None = None, *, loss: Any = None) -> dict:
    """Held-out loss of `trained` on its run's held-out data, or on the data `overrides` name; `loss`: a
    loss(model, batch) or its import path in place of the run's (`diloco evaluate --loss`).

    `overrides` are `data.*` and `eval.*` fields (`--set` syntax) applied to the run's config: another
    corpus (`data.source=parquet`, `data.path=...`), more or fewer windows (`eval.batches`). The
    windows are the ones a run's own evaluations score (orchestrator.core.evaluation), with the run's model
    recipe (its factory and loss), so a user's model is scored as the run scored it. Returns
    {"eval_loss" (nats per token), "eval_bits_per_token", "unigram_bits_per_token", "tokens", "source",
    "unit"}: "unit" is "byte" where the corpus is text read as bytes (a token IS a byte), else "token".
    """
    from islands.data import DataError
    from islands.sampling import vocab_size
    from orchestrator.core.evaluation import Evaluator
    from orchestrator.run.streams import corpus_stream, heldout_unigram_bits, loss_unit

    overrides = list(overrides or [])
    for item in overrides:
        key = item.split("=", 1)[0]
        if not key.startswith(("data.", "eval.")):
            raise TrainedModelError(f"--set {item!r}: evaluation takes data.* and eval.* fields only "
                                    "(the model and everything else are the run's)")
    try:
        cfg = build_config(apply_overrides(trained.run_config.model_dump(mode="json"), overrides))
    except ConfigError as err:
        raise TrainedModelError(str(err).splitlines()[0]) from None
    if cfg.data.source == "python":  # the datasets were Python objects: nothing in the run directory names them
        raise TrainedModelError("the run trained on datasets passed to the Python API, which its directory cannot "
                                "name; evaluate on a corpus: --set data.source=parquet --set data.path=FILE "
                                "(or data.source=stdlib)")
    try:  # the held-out sample only, as the run's own evaluations read it: never the training units
        corpus = corpus_stream(cfg, trained.run_dir)
    except (ConfigError, DataError) as err:
        raise TrainedModelError(str(err).splitlines()[0]) from None
    vocab = vocab_size(trained.model)  # None: a user model that does not say; its loss will tell
    if vocab is not None and corpus.vocab_size > vocab:
        raise TrainedModelError(f"{corpus.source} has token ids up to {corpus.vocab_size - 1} but the model knows "
                                f"{vocab}; evaluate it on data of the run's vocabulary")
    # The run's recipe, so a user's model is scored with the run's loss exactly as the run's evaluations were.
    recipe = model_recipe(cfg, model=trained.rebuilt_by, loss=loss)
    try:
        resolve_callable(recipe.loss, "loss")
    except ModelError as err:
        if loss is not None:  # the user's own --loss: its message says what is wrong with it
            raise TrainedModelError(f"cannot evaluate the model of the run: {err}") from None
        why = (f"its loss {recipe.loss!r} was defined in a notebook or in a script without an `if __name__ == "
               f"\"__main__\":` block, which no other process can import" if is_main_path(recipe.loss) else str(err))
        name = str(recipe.loss).partition(":")[2] or "loss"
        raise TrainedModelError(f"cannot evaluate the model of the run: {why}; pass the loss: --loss "
                                f"PACKAGE.MODULE:{name} (a module that defines it)") from None
    try:
        evaluator = Evaluator(recipe, corpus.heldout, batches=cfg.eval.batches, batch_size=cfg.eval.batch_size)
        value, bits = evaluator.evaluate(state_tensors(trained.model))
    except ModelError as err:
        raise TrainedModelError(f"cannot evaluate the model of the run ({recipe.name}): {err}") from None
    return {"eval_loss": value, "eval_bits_per_token": bits,
            "unigram_bits_per_token": heldout_unigram_bits(corpus.heldout, corpus.vocab_size),
            "tokens": sum(x.numel() for x, _ in evaluator.batches), "source": corpus.source,
            "unit": loss_unit(corpus.heldout)}


def export_model(trained: TrainedModel, path: str | Path, *, format: str = "torch", overwrite: bool = False) -> Path:
    """Write `trained`'s model to `path` and return the path: one PyTorch file (`format="torch"`) or a
    Hugging Face folder (`format="hf"`); the module docstring lists what each holds.

    torch: a dict of tensors and plain values, so `torch.load(path, weights_only=True)` reads it; the
    built-in model as :data:`EXPORT_FORMAT` (its shape), a user's model as :data:`MODULE_EXPORT_FORMAT`
    (its factory's import path). hf: `save_pretrained` of a `transformers.PreTrainedModel` (safetensors),
    plus the run's tokenizer where it kept one; any other model is refused, naming `--format torch`.

    Written under a temporary name and renamed, so a failure leaves no half file or folder; an existing
    file or folder is kept unless `overwrite` (a folder only if it is empty or a model folder).
    """
    if format not in EXPORT_FORMATS:
        raise TrainedModelError(f"unknown export format {format!r}; pass --format torch or --format hf")
    path = Path(path)
    if not path.parent.is_dir():
        raise TrainedModelError(f"{path.parent} is not a directory; create it or pass another --out")
    if format == "hf":
        return _export_hf(trained, path, overwrite=overwrite)
    if path.is_dir():
        raise TrainedModelError(f"{path} is a folder; --format torch writes one file: pass a file name (model.pt)")
    if path.exists() and not overwrite:
        raise TrainedModelError(f"{path} already exists; pass another path, or overwrite it (--force)")
    model = trained.model
    if trained.factory is None and trained.rebuilt_by is not None:
        raise TrainedModelError(f"the model was rebuilt by {trained.rebuilt_by!r}, which has no import path for the "
                                "file to record; pass the factory as a function or 'package.module:function'")
    if trained.factory is None:  # the built-in model: the format files have had since the first export
        payload: dict[str, Any] = {"format": EXPORT_FORMAT, "model_config": dataclasses.asdict(model.cfg),
                                   "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
    else:
        # No clone: a tied weight is one storage under two names, and torch.save writes a storage once.
        payload = {"format": MODULE_EXPORT_FORMAT, "factory": trained.factory, "seed": trained.run_config.run.seed,
                   "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    payload.update(mode=trained.mode, step=trained.step, tokens_processed=trained.tokens_processed)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _export_hf(trained: TrainedModel, folder: Path, *, overwrite: bool) -> Path:
    """`diloco export --format hf`: `save_pretrained` into a temporary folder, the run's tokenizer beside it,
    then renamed into place."""
    model = trained.model
    # A PreTrainedModel's class comes from transformers, so it is imported already when the model is one;
    # anything else is refused without paying for the import.
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        raise TrainedModelError(f"the run's model ({type(model).__name__}) is not a Hugging Face "
                                "transformers.PreTrainedModel, so it has no Hugging Face folder; export it with "
                                "--format torch")
    if folder.is_file() or folder.is_symlink():
        raise TrainedModelError(f"{folder} is a file; --format hf writes a folder: pass a folder name")
    replaced = folder.is_dir() and any(folder.iterdir())
    if replaced and not overwrite:
        raise TrainedModelError(f"{folder} already exists; pass another path, or overwrite it (--force)")
    if replaced and not (folder / "config.json").is_file():  # --force replaces a model folder, nothing else
        raise TrainedModelError(f"{folder} holds files but no config.json, so it is not a model folder to "
                                "overwrite; pass another --out")
    from transformers.utils import logging as hf_logging

    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one line of output per export, not a shard-writing progress bar
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        _copy_run_tokenizer(trained.run_dir, tmp)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return folder


def _copy_run_tokenizer(run_dir: Path | None, folder: Path) -> None:
    """The tokenizer hook of `--format hf`: RUN_DIR/tokenizer.json, where the run kept one, goes into the folder.

    Only a Hugging Face `tokenizers` file: one written by islands.tokenizer for UTF-8 bytes or a Python
    function (a JSON object with a "text_encoder" key) means nothing to transformers and stays behind.
    """
    if run_dir is None or not (run_dir / RUN_TOKENIZER_FILE).is_file():
        return
    source = run_dir / RUN_TOKENIZER_FILE
    try:
        spec = json.loads(source.read_text())
    except (ValueError, UnicodeDecodeError):
        raise TrainedModelError(f"{source} is not a JSON tokenizer file; remove it or write it again") from None
    if isinstance(spec, dict) and "text_encoder" not in spec:
        shutil.copyfile(source, folder / RUN_TOKENIZER_FILE)


def load_exported(path: str | Path) -> torch.nn.Module:
    """The model of a `--format torch` file written by :func:`export_model`, on the CPU in eval mode.

    The built-in model is rebuilt from its shape; a user's model from its factory's import path (importable
    here) under the run's seed, then its state dict is loaded strictly: a missing, extra or reshaped
    tensor is refused in one line.
    """
    path = Path(path)
    if path.is_dir():
        raise TrainedModelError(f"{path} is a folder (a `--format hf` export?); load it with transformers' "
                                "AutoModelForCausalLM.from_pretrained(folder), or pass a `--format torch` file")
    if not path.is_file():
        raise TrainedModelError(f"{path} does not exist; pass a file written by `diloco export`")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        raise TrainedModelError(f"{path} is not a readable PyTorch file ({type(err).__name__}); "
                                "pass a file written by `diloco export`") from None
    found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
    if found == EXPORT_FORMAT:
        model = build_model(ModelConfig(**payload["model_config"]), seed=0)
        model.load_state_dict(payload["state_dict"])  # strict: any missing or extra tensor raises
        return model.eval()
    if found != MODULE_EXPORT_FORMAT:
        raise TrainedModelError(f"{path} is not a `diloco export` file (format {found!r}, expected "
                                f"{EXPORT_FORMAT!r} or {MODULE_EXPORT_FORMAT!r})")
    try:
        model = instantiate(payload["factory"], int(payload.get("seed", 0)))
    except ModelError as err:
        raise TrainedModelError(f"cannot rebuild the model of {path}: {err}") from None
    try:
        model.load_state_dict(payload["state_dict"])  # strict: tied names and buffers included
    except RuntimeError as err:
        detail = " ".join(str(err).split())  # torch lists the mismatches over several lines
        raise TrainedModelError(f"{path} does not fit the model its factory {payload['factory']!r} builds now "
                                f"({detail[:300]}); was the factory changed since the export?") from None
    return model.eval()
