"""What a run trains: its model recipe and its data, from the config's import paths or the public API's objects.

The config names everything by import path or built-in source (a run resumes and a Ray Job starts from
it alone); the public API (orchestrator/api.py) may pass Python objects instead: a model factory, a
loss, an optimizer factory and datasets. :class:`Workload` carries those objects; :func:`training_data`
and :func:`run_recipe` turn either into what the engine takes: a token array or a map-style dataset
per split, and an islands.spec.ModelRecipe.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from islands.data import Corpus, DataError, load_parquet_corpus, load_stdlib_corpus
from islands.spec import ModelRecipe
from orchestrator.config import RunConfig
from orchestrator.settings import model_recipe


@dataclass(frozen=True)
class Workload:
    """Python objects that take the place of the config's import paths and data source (None: the config's).

    `model`: a zero-argument factory returning a torch.nn.Module. `loss`: loss(model, batch) -> scalar
    tensor. `optimizer`: optimizer(parameters) -> torch.optim.Optimizer. `train` and `heldout`: a
    map-style dataset (``__len__`` and ``__getitem__``, e.g. a torch Dataset), a ``ray.data.Dataset``
    or a 1-D array of token ids.
    """

    model: Any = None
    loss: Any = None
    optimizer: Any = None
    train: Any = None
    heldout: Any = None


@dataclass
class TrainingData:
    """A run's training and held-out data: 1-D token arrays (a corpus) or map-style datasets of examples."""

    train: Any
    heldout: Any
    vocab_size: int | None  # token corpora: every id is below it; datasets: None (the model's own business)
    source: str  # where the data came from, for logs and reports

    @property
    def is_tokens(self) -> bool:
        """True for a token stream (windows of ``model.seq_len`` tokens), False for a dataset of examples."""
        return isinstance(self.train, np.ndarray)

    @classmethod
    def of_corpus(cls, corpus: Corpus) -> TrainingData:
        """A built-in or Parquet corpus as training data."""
        return cls(corpus.train, corpus.heldout, corpus.vocab_size, corpus.source)


def load_corpus(cfg: RunConfig) -> Corpus:
    """The training corpus named by the config (the embedded stdlib corpus by default)."""
    d = cfg.data
    if d.source == "stdlib":
        return load_stdlib_corpus(heldout_fraction=d.heldout_fraction, max_bytes=d.max_bytes,
                                  shuffle_documents=d.shuffle_documents)
    return load_parquet_corpus(d.path, text_column=d.text_column, token_column=d.token_column,
                               heldout_fraction=d.heldout_fraction, shuffle_documents=d.shuffle_documents)


def training_data(cfg: RunConfig, workload: Workload | None = None) -> TrainingData:
    """The run's data: the workload's datasets if it has them, else the config's corpus.

    A dataset without a held-out split gives up ``data.heldout_fraction`` of its examples (chosen by a
    stable hash of their index, the same in every process) for evaluation; they are never trained on.
    """
    if workload is None or workload.train is None:
        if workload is not None and workload.heldout is not None:
            raise DataError("a held-out dataset was given without a training dataset; pass datasets={'train': ...}")
        return TrainingData.of_corpus(load_corpus(cfg))
    train, heldout = as_examples(workload.train, "train"), workload.heldout
    if isinstance(train, np.ndarray):
        if heldout is None:
            raise DataError("a token-array training set needs a held-out token array too; pass "
                            "datasets={'train': ids, 'validation': heldout_ids}")
        heldout = np.asarray(heldout)
        vocab = int(max(train.max(initial=0), heldout.max(initial=0))) + 1
        return TrainingData(train, heldout, vocab, f"token array ({len(train):,} training tokens)")
    if heldout is None:
        train, heldout = split_examples(train, cfg.data.heldout_fraction)
    else:
        heldout = as_examples(heldout, "validation")
    return TrainingData(train, heldout, None, f"{type(workload.train).__name__} ({len(train):,} training examples, "
                                              f"{len(heldout):,} held out)")


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
