"""What a run trains: its model recipe and its data, from the config's import paths or the public API's objects.

The config names everything by import path or built-in source (a run resumes and a Ray Job starts from
it alone); the public API (orchestrator/api.py) may pass Python objects instead: a model factory, a
loss, an optimizer factory and datasets. :class:`Workload` carries those objects; :func:`training_data`
and :func:`run_recipe` turn either into what the engine takes: a token array or a map-style dataset
per split, and an islands.spec.ModelRecipe.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from islands.data import Corpus, DataError
from islands.model_api import ModelError, check_loss, first_line
from islands.spec import ModelRecipe
from islands.stream import TokenStream
from orchestrator.config import RunConfig, given_setting
from orchestrator.run.import_paths import import_path_of
from orchestrator.run.streams import (
    DEFAULT_TRAINED_VOCAB,
    TOKENIZER_FILE,
    array_stream,
    corpus_stream,
    examples_stream,
    read_all_training,
    reads_stream,
)
from orchestrator.settings import model_recipe

log = logging.getLogger(__name__)

__all__ = ["CORPUS_FIELDS", "DEFAULT_TRAINED_VOCAB", "TOKENIZER_FILE", "Prepared", "TrainingData", "Workload", "load_corpus", "prepare",
           "corpus_settings_replaced", "recorded_config", "run_recipe", "training_data"]


@dataclass(frozen=True)
class Workload:
    """Python objects that take the place of the config's import paths and data source (None: the config's).

    `model`: a zero-argument factory returning a torch.nn.Module. `loss`: loss(model, batch) -> scalar
    tensor. `optimizer`: optimizer(parameters) -> torch.optim.Optimizer, the inner one. `outer_optimizer`: the
    same over one fragment's global parameters, the outer step (config: outer.optimizer). `train` and `heldout`: a
    map-style dataset (``__len__`` and ``__getitem__``, e.g. a torch Dataset), a ``ray.data.Dataset``
    or a 1-D array of token ids.
    """

    model: Any = None
    loss: Any = None
    optimizer: Any = None
    train: Any = None
    heldout: Any = None
    outer_optimizer: Any = None


@dataclass
class TrainingData:
    """A run's training and held-out data: a corpus streamed by the islands (an islands.stream.TokenStream, its
    held-out sample a 1-D token array), 1-D token arrays, or map-style datasets of examples."""

    train: Any
    heldout: Any
    vocab_size: int | None  # token corpora: every id is below it; datasets: None (the model's own business)
    source: str  # where the data came from, for logs and reports
    encoder: Any = None  # the islands.tokenizer.TextEncoder the text was encoded with (None: bytes or not text)

    @property
    def is_tokens(self) -> bool:
        """True for a token stream (windows of ``model.seq_len`` tokens), False for a dataset of examples."""
        return isinstance(self.train, np.ndarray) or (isinstance(self.train, TokenStream) and not self.train.of_examples)

    @property
    def is_streamed(self) -> bool:
        """True when the islands read the corpus themselves, unit by unit (islands/stream.py)."""
        return isinstance(self.train, TokenStream)

    @classmethod
    def of_corpus(cls, corpus: Corpus) -> TrainingData:
        """A corpus held in memory (the data-parallel baseline's) as training data."""
        return cls(corpus.train, corpus.heldout, corpus.vocab_size, corpus.source, getattr(corpus, "encoder", None))


def load_corpus(cfg: RunConfig, run_dir: str | Path | None = None) -> Corpus:
    """The config's corpus read whole into memory: every training unit and the held-out sample, through the same
    unit readers the islands stream with (islands/corpus.py). Only the data-parallel baseline takes it; a run's
    islands stream their units (:func:`training_data`)."""
    plan = corpus_stream(cfg, run_dir)
    corpus = Corpus(train=read_all_training(plan.index), heldout=plan.heldout, vocab_size=plan.vocab_size,
                    source=plan.source)
    corpus.encoder = plan.encoder  # type: ignore[attr-defined]
    return corpus


def training_data(cfg: RunConfig, workload: Workload | None = None, run_dir: str | Path | None = None) -> TrainingData:
    """The run's data: the workload's datasets if it has them, else the config's corpus.

    A dataset without a held-out split gives up ``data.heldout_fraction`` of its examples (chosen by a
    stable hash of their index, the same in every process) for evaluation; they are never trained on.
    """
    if workload is None or workload.train is None:
        if workload is not None and workload.heldout is not None:
            raise DataError("a held-out dataset was given without a training dataset; pass datasets={'train': ...}")
        plan = corpus_stream(cfg, run_dir)
        return TrainingData(plan.stream, plan.heldout, plan.vocab_size, plan.source, plan.encoder)
    reads = ray_data_reads(workload.train, cfg)
    if reads is not None:  # a Ray Data read: its read tasks are units the islands run themselves
        source = f"Ray Data read ({len(reads.tasks)} read tasks, columns {reads.columns})"
        given = as_examples(workload.heldout, "validation") if workload.heldout is not None else None
        stream, held = reads_stream(cfg, reads, source, hold_out=given is None)
        return TrainingData(stream, given if given is not None else held, None, source)
    train, heldout = as_examples(workload.train, "train"), workload.heldout
    if isinstance(train, np.ndarray):
        if heldout is None:
            raise DataError("a token-array training set needs a held-out token array too; pass "
                            "datasets={'train': ids, 'validation': heldout_ids}")
        heldout = np.asarray(heldout)
        vocab = int(max(train.max(initial=0), heldout.max(initial=0))) + 1
        source = f"token array ({len(train):,} training tokens)"
        return TrainingData(array_stream(cfg, train, source), heldout, vocab, source)
    if heldout is None:
        train, heldout = split_examples(train, cfg.data.heldout_fraction)
    else:
        heldout = as_examples(heldout, "validation")
    source = f"{type(workload.train).__name__} ({len(train):,} training examples, {len(heldout):,} held out)"
    return TrainingData(examples_stream(cfg, train, source), heldout, None, source)


def ray_data_reads(data: Any, cfg: RunConfig) -> Any:
    """`data` as islands.ray_source.RayDataReads when it is a ray.data.Dataset whose plan is one read with enough read
    tasks for the islands (and held-out data); None otherwise (a dataset with transforms is materialized instead)."""
    if not type(data).__module__.startswith("ray.data"):
        return None
    from islands.ray_source import RayDataReads

    reads = RayDataReads.of(data, units=max(8 * cfg.num_islands, 64))
    if reads is None or len(reads.tasks) <= cfg.num_islands:
        log.warning(
            "the Ray dataset is %s: materialized once in the object store (each island fetches only its blocks); a "
            "dataset that is one read with a read task per island and more streams instead (docs/data.md)",
            "more than one read" if reads is None else f"{len(reads.tasks)} read tasks")
        return None
    return reads


def as_examples(data: Any, split: str) -> Any:
    """`data` as something the islands can sample: a token array, or a map-style dataset of examples.

    A ``ray.data.Dataset`` is materialized once here (islands.ray_source.RayDatasetExamples); each
    island then fetches only the blocks of its own shard. Raises DataError for anything else, or empty data.
    """
    if isinstance(data, np.ndarray):
        if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer) or len(data) == 0:
            raise DataError(f"the {split} token array has shape {data.shape}, dtype {data.dtype}; pass a non-empty "
                            "1-D integer array of token ids")
        return data
    if type(data).__module__.startswith("ray.data"):
        from islands.ray_source import RayDatasetExamples

        data = RayDatasetExamples.from_dataset(data)
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise DataError(f"the {split} dataset is a {type(data).__name__}, which has no __len__ and __getitem__; pass a "
                        "map-style dataset (torch.utils.data.Dataset), a ray.data.Dataset or a token array")
    if len(data) == 0:
        raise DataError(f"the {split} dataset is empty; pass a dataset with examples")
    return data


class ExampleSubset:
    """The examples of `dataset` at `indices`, a map-style dataset itself (picklable, unlike a closure)."""

    def __init__(self, dataset: Any, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]


def split_examples(dataset: Any, heldout_fraction: float) -> tuple[ExampleSubset, ExampleSubset]:
    """(train, held-out) subsets of `dataset`: example i is held out iff crc32(i) / 2**32 < heldout_fraction.

    At least one example lands on each side; a stable hash, so every process agrees without a seed.
    """
    n = len(dataset)
    if n < 2:
        raise DataError(f"the dataset has {n} example(s); it needs at least 2 (one to train on, one to hold out)")
    held = [i for i in range(n) if zlib.crc32(str(i).encode()) / 2**32 < heldout_fraction] or [n - 1]
    held_set = set(held)
    train = [i for i in range(n) if i not in held_set]
    if not train:
        raise DataError(f"data.heldout_fraction={heldout_fraction} holds out all {n} examples; lower it")
    return ExampleSubset(dataset, train), ExampleSubset(dataset, held)


def run_recipe(cfg: RunConfig, data: TrainingData, workload: Workload | None = None) -> ModelRecipe:
    """The run's model recipe: the workload's objects over the config's import paths; the built-in model takes
    its vocabulary from the corpus (bytes: 256; token ids: the tokenizer's or the ids' range)."""
    w = workload or Workload()
    shape = cfg.model.shape()
    if data.vocab_size is not None and data.vocab_size != shape.vocab_size:
        shape = dataclasses.replace(shape, vocab_size=data.vocab_size)
    return model_recipe(cfg, shape=shape, model=w.model, loss=w.loss, optimizer=w.optimizer)


def recorded_config(cfg: RunConfig, workload: Workload | None) -> RunConfig:
    """`cfg` as the run directory records it: the workload's model, loss and optimizers as import paths, whatever
    form they were given in (orchestrator/run/import_paths.py), and data.source 'python' where the datasets came
    from Python (a resume must pass them again: the config cannot name them)."""
    if workload is None:
        return cfg
    # What the workload gives replaces the config's path, even with none: a callable object has no import path,
    # and the built-in model's shape travels in its ByteTransformerFactory (the config's preset names it).
    given = {"factory": workload.model, "loss": workload.loss, "optimizer": workload.optimizer}
    update = {key: import_path_of(obj) for key, obj in given.items() if obj is not None}
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=update)}) if update else cfg
    if workload.outer_optimizer is not None:  # the actor is given the object itself (outer_settings)
        outer = cfg.outer.model_copy(update={"optimizer": import_path_of(workload.outer_optimizer)})
        cfg = cfg.model_copy(update={"outer": outer})
    if workload.train is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": "python"})})
    return cfg


# The corpus's own settings: datasets from Python replace the corpus, so these do nothing beside them.
CORPUS_FIELDS = ("source", "path", "text_column", "token_column", "token_dtype", "tokenizer", "max_bytes",
                 "tokenizer_sample_bytes")


def corpus_settings_replaced(cfg: RunConfig) -> list[str]:
    """One line per corpus setting (CORPUS_FIELDS) that `cfg` gives a value of its own, for a run on datasets from
    Python, which replace the corpus: those settings do nothing. Warned, not refused: one config file may well
    serve `diloco train` on a corpus and a script on its own datasets."""
    skip = ("source",) if cfg.data.source == "python" else ()  # what a resumed run on datasets records, not a corpus
    return [f"data.{f}={getattr(cfg.data, f)!r} has no effect: datasets= from Python replace the corpus it configures; "
            f"drop it from the run config (or train without datasets= to use it)"
            for f in CORPUS_FIELDS if f not in skip and given_setting(cfg.data, f)]


@dataclass
class Prepared:
    """A workload checked before Ray work starts: its data, recipe, a built model and its state tensors' roles."""

    data: TrainingData
    recipe: ModelRecipe
    initial: dict[str, Any]  # name -> initial state tensor (parameters, then trained buffers)
    embedding_names: frozenset[str]
    buffer_names: frozenset[str]


def prepare(cfg: RunConfig, workload: Workload | None = None, run_dir: str | Path | None = None) -> Prepared:
    """Load the data and build the model once, checking everything that can fail without Ray.

    Raises ConfigError (one line naming the fix) for: an import path that does not resolve, a factory
    that raises or does not return an ``nn.Module``, a model with no trainable parameters, a loss that
    raises or is not a scalar with a gradient on a real batch, an optimizer factory (inner or outer) that raises
    or does not return an optimizer (the outer one also: that holds other tensors or cannot step), a merge rule or
    compressor plug-in that does not load (outer.merge_rule, outer.compression), outer.lr or
    momentum given beside the API's outer optimizer, an empty dataset, a dataset too small for one batch per island (or for one
    held-out window), token ids at or past the model's embedding rows, and a 0-dim parameter in a model
    that a pool shards (`shard: fsdp`). The user's own exceptions
    are chained to the ConfigError (``__cause__``) for a caller that wants the traceback.
    """
    from orchestrator.config import ConfigError

    try:
        return _prepare(cfg, workload, run_dir)
    except (ModelError, DataError) as err:
        # The ModelError's own cause (the user's exception, if any) is kept; the ModelError itself adds nothing.
        raise ConfigError(str(err)) from err.__cause__


def _prepare(cfg: RunConfig, workload: Workload | None, run_dir: str | Path | None) -> Prepared:
    import torch

    from islands.data import heldout_batches
    from islands.model_api import (
        buffer_names,
        build_optimizer,
        embedding_parameter_names,
        instantiate,
        state_tensors,
    )
    from islands.trainer import make_sampler, resolve_loss
    from orchestrator.core.evaluation import example_batches

    if cfg.data.source == "python" and (workload is None or workload.train is None):
        raise DataError("this run trained on datasets passed from Python (data.source 'python'); resume it from "
                        "Python with DilocoTrainer(..., datasets=..., resume=True)")
    if workload is not None and workload.train is not None:
        for line in corpus_settings_replaced(cfg):
            log.warning("%s", line)
    data = training_data(cfg, workload, run_dir)
    recipe = run_recipe(cfg, data, workload)
    model = instantiate(recipe.model, recipe.seed)
    _check_shardable(cfg, model)
    state = state_tensors(model)
    islands = cfg.num_islands
    _check_sizes(data, islands=islands, seq_len=recipe.seq_len, batch_size=cfg.data.batch_size)
    # The driver reads no training data: the first held-out batch stands in for it.
    if data.is_streamed and data.is_tokens:
        first = heldout_batches(data.heldout, seq_len=recipe.seq_len, batch_size=cfg.data.batch_size, num_batches=1)[0]
    elif data.is_streamed:
        first = example_batches(data.heldout, batch_size=cfg.data.batch_size, num_batches=1)[0]
    else:
        first = make_sampler(data.train, shard_index=0, num_shards=islands, seq_len=recipe.seq_len,
                             batch_size=cfg.data.batch_size, seed=recipe.seed).batch_at(0)
    _check_token_ids(model, data, first)
    loss_fn = resolve_loss(recipe.loss)
    origin = f"the loss {_name_of(recipe.loss, loss_fn)!r}"
    model.train()
    with torch.enable_grad():
        try:
            value = loss_fn(model, first)
        except ModelError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's model or loss failed: one line, the traceback chained
            raise ModelError(f"{origin} raised {type(err).__name__} on the first batch ({describe_batch(first)}): "
                             f"{first_line(err)}; make the model and loss take this data's batches") from err
        check_loss(value, f"{origin} on the first batch")
    if recipe.optimizer is not None:  # the user's: built once here so a bad one fails before Ray, not in an island
        inner = cfg.inner
        build_optimizer(recipe.optimizer, model, lr=inner.lr, weight_decay=inner.weight_decay,
                        betas=(inner.beta1, inner.beta2))
    _check_outer_optimizer(cfg, workload, model)
    _check_plugins(cfg)
    return Prepared(data, recipe, {n: t.detach().clone() for n, t in state.items()},
                    embedding_parameter_names(model), frozenset(buffer_names(model)))


def _check_outer_optimizer(cfg: RunConfig, workload: Workload | None, model: Any) -> None:
    """The outer optimizer plug-in (the API's, else outer.optimizer) built once over two of the model's smallest
    parameters and stepped, and no outer.lr, momentum or partial_momentum given beside the API's: they would do
    nothing (the config's own are refused at load, orchestrator.config.INERT_RULES)."""
    from orchestrator.config import ConfigError, inert_setting
    from orchestrator.core.fragment_optimizers import check_outer_optimizer, factory_name

    given = workload.outer_optimizer if workload is not None else None
    spec = given if given is not None else cfg.outer.optimizer
    if spec is None:
        return
    if given is not None:
        named = cfg.model_copy(update={"outer": cfg.outer.model_copy(update={"optimizer": factory_name(given)})})
        inert = inert_setting(named, only=(("outer", "lr"), ("outer", "momentum"), ("outer", "partial_momentum")))
        if inert:
            raise ConfigError(inert.replace("outer.optimizer ", "outer_optimizer=", 1).replace(
                "drop outer.optimizer", "drop outer_optimizer="))
    tiny = sorted((p for p in model.parameters() if p.requires_grad), key=lambda p: p.numel())[:2]
    try:
        check_outer_optimizer(spec, tiny)
    except ModelError as err:
        raise ConfigError(str(err)) from err.__cause__


def _check_plugins(cfg: RunConfig) -> None:
    """The merge rule and compressor the config names, loaded here as every process of the run will: a config
    read back from a run directory (``--resume``) was not made to import them (orchestrator.config), and one that
    no longer loads should fail before Ray, not in the outer optimizer's actor. A ModelError line if not."""
    from islands.plugins import load_compressor, load_merge_rule

    load_merge_rule(cfg.outer.merge_rule)
    load_compressor(cfg.outer.compression)


def _check_shardable(cfg: RunConfig, model: Any) -> None:
    """A pool with shard 'fsdp' cuts every parameter along dim 0 (islands/fsdp.py); FSDP refuses a 0-dim one."""
    fsdp = [p.name for p in cfg.pools if p.shard == "fsdp"]
    scalars = [n for n, p in model.named_parameters() if p.dim() == 0]
    if fsdp and scalars:
        raise ModelError(f"pools {fsdp} shard 'fsdp', but the model has 0-dim parameters {scalars[:3]}, which FSDP "
                         "cannot cut along dim 0; give them shape [1], or set shard: none on those pools")


def _name_of(spec: Any, resolved: Any) -> str:
    """How messages name a recipe part: the import path it was given as, else the callable's qualified name."""
    return spec if isinstance(spec, str) else getattr(resolved, "__qualname__", repr(resolved))


def describe_batch(batch: Any) -> str:
    """A short description of a batch for messages, e.g. ``tuple of int64[8, 128], int64[8, 128]``."""
    import torch

    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
        return type(value).__name__

    if isinstance(batch, dict):
        return "dict of " + ", ".join(f"{k}: {one(v)}" for k, v in batch.items())
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__} of " + ", ".join(one(v) for v in batch)
    return one(batch)


def _check_sizes(data: TrainingData, *, islands: int, seq_len: int, batch_size: int = 1) -> None:
    """A token stream with a window for every island and one held-out window, else a one-line DataError.

    A token stream is cut into one contiguous shard per island (islands.data.ShardSampler), the smallest
    ``len // islands`` tokens; each must hold one window of ``seq_len + 1`` tokens (windows are drawn with
    replacement, so one is enough). Checked here with the config's names for the fix, before the samplers
    say the same in their own terms (and before the evaluator would, after Ray started). A dataset of
    examples is left to islands.examples.ExampleSampler, which asks for a batch per island and says so.
    """
    window = seq_len + 1
    if data.is_streamed and data.is_tokens:
        stream = data.train
        small = min(range(islands), key=stream.island_tokens)
        # Units' token counts are exact for token files, token lists and the stdlib's bytes; a Parquet text
        # column's (its encoded size) can be far below the text (dictionary encoding), so it is not judged here:
        # an island's stream runs on across epochs, and one whose units hold nothing stops with a DataError.
        exact = not (stream.fmt.kind == "parquet" and stream.fmt.is_text)
        if exact and stream.island_tokens(small) < window:
            raise DataError(f"the data plan gives island {small} about {stream.island_tokens(small):,} tokens, fewer than one "
                            f"window of model.seq_len+1={window}; add data, train fewer islands (pools.NAME.islands) or "
                            f"shorten model.seq_len")
        if len(data.heldout) < window:
            raise DataError(f"the held-out data has {len(data.heldout):,} tokens, fewer than one window of "
                            f"model.seq_len+1={window}; add data, raise data.heldout_fraction or shorten model.seq_len")
    elif data.is_streamed:  # examples: every island reads at least one batch's worth of its own
        stream = data.train
        small = min(range(islands), key=stream.island_tokens)
        have, batch = stream.island_tokens(small), batch_size
        if all(u.count >= 0 for u in stream.units) and have < batch:
            n = sum(u.count for u in stream.units)
            raise DataError(f"dataset too small for one batch per island: {n} examples over {islands} islands leave island "
                            f"{small} {have}, fewer than batch_size={batch}; use a smaller batch_size, fewer islands or at "
                            f"least {batch * islands} examples")
    elif data.is_tokens:
        n = len(data.train)
        if n // islands < window:
            raise DataError(f"the training data has {n:,} tokens (bytes for text): over {islands} islands the smallest "
                            f"shard gets {n // islands:,}, fewer than one window of model.seq_len+1={window}; add "
                            "data, train fewer islands (pools.NAME.islands) or shorten model.seq_len")
        if len(data.heldout) < window:
            raise DataError(f"the held-out data has {len(data.heldout):,} tokens, fewer than one window of "
                            f"model.seq_len+1={window}; add data, raise data.heldout_fraction or shorten model.seq_len")


def _check_token_ids(model: Any, data: TrainingData, batch: Any) -> None:
    """Token ids at or past the rows of the model's input embedding (its first ``nn.Embedding``) are refused:
    for a token stream every id of both splits; for a dataset the ``input_ids`` of the first batch."""
    import torch

    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if not embeddings:
        return  # not a token model (a CNN): nothing to check
    rows = embeddings[0].num_embeddings
    if data.is_streamed and data.is_tokens:  # the held-out sample's ids, and the vocabulary units are checked against
        high = max(int(data.heldout.max(initial=0)), (data.vocab_size or 0) - 1)
    elif data.is_tokens:
        high = int(max(data.train.max(initial=0), data.heldout.max(initial=0)))
    else:
        ids = batch.get("input_ids") if isinstance(batch, dict) else batch[0] if isinstance(batch, (tuple, list)) else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
            return
        high = int(ids.max())
    if high >= rows:
        raise DataError(f"the data has token id {high} but the model's embedding has {rows} rows (ids 0..{rows - 1}); "
                        f"build the model with a vocabulary of at least {high + 1}, or use the tokenizer it was made for")
