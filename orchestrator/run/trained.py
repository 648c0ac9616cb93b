"""The model a run trained: load it from the run directory, sample from it, export it as a PyTorch file.

A run's global parameters live in its checkpoints (orchestrator.core.checkpoint; `checkpoint.uri`, default
RUN_DIR/checkpoints), beside their moving average when the run kept one (`run.average_window`). `diloco
train` writes the last one after the final flush, so it holds exactly the model `summary.json`'s final
held-out loss was measured on (the average where there is one); `diloco baseline-dp` saves its final
parameters the same way. `--raw` loads the global parameters instead of the average. :func:`load_trained`
rebuilds the model from the run's `config.yaml` and loads
the newest (or a chosen) checkpoint into it, refusing in one line anything that does not fit.

`diloco sample RUN_DIR --prompt "def "` prints a continuation; `diloco evaluate RUN_DIR` scores the model
on the run's held-out data or on another corpus (`--set data.*`); `diloco export RUN_DIR --out model.pt`
writes a plain PyTorch file (a dict of the model's shape and state dict, loadable with
`torch.load(path, weights_only=True)`; :func:`load_exported` rebuilds the model from it).
The three commands' argparse lives in orchestrator/cli/model.py.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from islands.model import ByteTransformer, ModelConfig, build_model
from islands.model_api import ModelError, instantiate, state_tensors
from orchestrator.config import DATA_PARALLEL_MODE, ConfigError, RunConfig, apply_overrides, build_config
from orchestrator.core.checkpoint import CheckpointError, CheckpointStore, checkpoint_dirname, run_checkpoint_uri
from orchestrator.settings import model_recipe

__all__ = ["EXPORT_FORMAT", "TrainedModel", "TrainedModelError", "evaluate_trained", "export_model", "load_exported",
           "load_trained", "read_run_config"]

EXPORT_FORMAT = "decoupled-diloco/byte-transformer/1"


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
        cfg = build_config(data)
    except (ConfigError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TrainedModelError(f"{path} is not a valid run config ({first}); was it edited by hand?") from None
    return cfg, mode if mode == DATA_PARALLEL_MODE else cfg.mode


def load_trained(run_dir: str | Path, *, step: int | None = None, raw: bool = False) -> TrainedModel:
    """Rebuild the model of `run_dir` and load checkpoint `step` into it (None = the newest).

    The model is the run's served model: the moving average of its global parameters where the run
    kept one (`run.average_window`), else the global parameters; `raw=True` loads the global
    parameters either way.

    The checkpoint's payload is verified against its checksum; a checkpoint whose parameters do not
    match the model of the run's config (a missing, extra or reshaped tensor) is refused, naming the
    first mismatch. A run still training can be read: its newest checkpoint is a consistent snapshot.
    """
    cfg, mode = read_run_config(run_dir)
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
        ckpt = store.load(step)
    except CheckpointError as err:
        raise TrainedModelError(str(err)) from None

    shape = cfg.model.shape()
    recipe = model_recipe(cfg, shape=shape)
    try:
        model = instantiate(recipe.model, recipe.seed)
    except ModelError as err:
        raise TrainedModelError(f"cannot rebuild the model of {run_dir}: {err}") from None
    average = {} if raw else ckpt.average_parameters()
    averaged = bool(average)
    params = average or ckpt.parameters()
    named = state_tensors(model)
    where = f"checkpoint {checkpoint_dirname(step)} of {run_dir}"
    missing, extra = sorted(set(named) - set(params)), sorted(set(params) - set(named))
    if missing or extra:
        which = f"the model has {missing[0]!r}, the checkpoint not" if missing else \
            f"the checkpoint has {extra[0]!r}, the model not"
        raise TrainedModelError(f"{where} does not fit the model of its config.yaml ({recipe.name}): "
                                f"{which}; was config.yaml changed after the run?")
    with torch.no_grad():
        for name, p in named.items():
            t = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise TrainedModelError(f"{where}: {name} has shape {tuple(t.shape)} but the model of its config.yaml "
                                        f"wants {tuple(p.shape)}; was config.yaml changed after the run?")
            p.copy_(t)
    model.eval()
    meta = ckpt.meta
    versions = meta.get("outer", {}).get("versions")
    tokens = meta.get("tokens_processed", meta.get("extra", {}).get("tokens_processed"))
    return TrainedModel(model=model, run_config=cfg, mode=mode, step=step, checkpoint=ckpt.path,
                        versions=None if versions is None else list(versions),
                        tokens_processed=None if tokens is None else int(tokens), averaged=averaged)


def evaluate_trained(trained: TrainedModel, overrides: list[str] | None = None) -> dict:
    """Held-out loss of `trained` on its run's held-out data, or on the data `overrides` name.

    `overrides` are `data.*` and `eval.*` fields (`--set` syntax) applied to the run's config: another
    corpus (`data.source=parquet`, `data.path=...`), more or fewer windows (`eval.batches`). The
    windows are the ones a run's own evaluations score (orchestrator.core.evaluation). Returns
    {"eval_loss" (nats per token), "eval_bits_per_token", "unigram_bits_per_token", "tokens", "source",
    "unit"}: "unit" is "byte" where the corpus is text read as bytes (a token IS a byte), else "token".
    """
    from islands.data import DataError, unigram_bits_per_byte
    from orchestrator.core.evaluation import Evaluator
    from orchestrator.run.driver import load_corpus  # imports Ray; only evaluation needs the corpus loader

    overrides = list(overrides or [])
    for item in overrides:
        key = item.split("=", 1)[0]
        if not key.startswith(("data.", "eval.")):
            raise TrainedModelError(f"--set {item!r}: evaluation takes data.* and eval.* fields only "
                                    "(the model and everything else are the run's)")
    try:
        cfg = build_config(apply_overrides(trained.run_config.model_dump(mode="json"), overrides))
        corpus = load_corpus(cfg)
    except (ConfigError, DataError) as err:
        raise TrainedModelError(str(err).splitlines()[0]) from None
    shape = trained.model.cfg
    if corpus.vocab_size > shape.vocab_size:
        raise TrainedModelError(f"{corpus.source} has token ids up to {corpus.vocab_size - 1} but the model knows "
                                f"{shape.vocab_size}; evaluate it on data of the run's vocabulary")
    evaluator = Evaluator(shape, corpus.heldout, batches=cfg.eval.batches, batch_size=cfg.eval.batch_size)
    loss, bits = evaluator.evaluate(dict(trained.model.named_parameters()))
    return {"eval_loss": loss, "eval_bits_per_token": bits,
            "unigram_bits_per_token": unigram_bits_per_byte(corpus.train, corpus.heldout, vocab_size=corpus.vocab_size),
            "tokens": sum(x.numel() for x, _ in evaluator.batches), "source": corpus.source,
            "unit": "byte" if corpus.train.dtype.itemsize == 1 else "token"}  # uint8 = byte text (islands.data)


def export_model(trained: TrainedModel, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write `trained`'s model to `path` as a plain PyTorch file; return the path.

    The file holds a dict: `format` (:data:`EXPORT_FORMAT`), `model_config` (the shape's fields),
    `state_dict`, `mode`, `step` and `tokens_processed`; only tensors and plain values, so
    `torch.load(path, weights_only=True)` reads it. Written under a temporary name and renamed, so a
    failure leaves no half file; an existing file is kept unless `overwrite`.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise TrainedModelError(f"{path} already exists; pass another path, or overwrite it (--force)")
    if not path.parent.is_dir():
        raise TrainedModelError(f"{path.parent} is not a directory; create it or pass another --out")
    payload = {
        "format": EXPORT_FORMAT,
        "model_config": dataclasses.asdict(trained.model.cfg),
        "state_dict": {k: v.detach().cpu().clone() for k, v in trained.model.state_dict().items()},
        "mode": trained.mode,
        "step": trained.step,
        "tokens_processed": trained.tokens_processed,
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_exported(path: str | Path) -> ByteTransformer:
    """The model of a file written by :func:`export_model`, on the CPU in eval mode."""
    path = Path(path)
    if not path.is_file():
        raise TrainedModelError(f"{path} does not exist; pass a file written by `diloco export`")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one line
        raise TrainedModelError(f"{path} is not a readable PyTorch file ({type(err).__name__}); "
                                "pass a file written by `diloco export`") from None
    if not isinstance(payload, dict) or payload.get("format") != EXPORT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise TrainedModelError(f"{path} is not a `diloco export` file (format {found!r}, expected {EXPORT_FORMAT!r})")
    model = build_model(ModelConfig(**payload["model_config"]), seed=0)
    model.load_state_dict(payload["state_dict"])  # strict: any missing or extra tensor raises
    return model.eval()
