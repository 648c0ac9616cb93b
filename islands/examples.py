"""Training batches from one island's disjoint shard of a map-style dataset of examples.

:class:`ExampleSampler` is the example-level counterpart of :class:`islands.data.ShardSampler`:
any object with ``__len__`` and ``__getitem__`` (a ``torch.utils.data.Dataset``, a list, a
:class:`islands.ray_source.RayDatasetExamples`) is split into contiguous shards, one per island,
and batch ``c`` depends only on ``(seed, shard_index, c)``, so a restarted island resumes exactly
at its cursor. :func:`batch_tokens` counts the tokens a collated batch stands for, the weight of
an island's update in token-weighted merging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from islands.data import CursorSampler, DataError, _check_positive

# Epoch permutations kept: a batch spans at most two epochs when batch_size <= shard size.
_CACHED_EPOCHS = 2


def _check_map_style(dataset: Any) -> int:
    """``len(dataset)``, or a one-line DataError when ``dataset`` has no random access."""
    from torch.utils.data import IterableDataset  # lazily, as torch in islands.data

    kind = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        raise DataError(f"dataset is an IterableDataset ({kind}); ExampleSampler needs random access, so pass "
                        f"a map-style Dataset (with __len__ and __getitem__) or materialize it into a list")
    if isinstance(dataset, (Mapping, str, bytes)) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise DataError(f"dataset of type {kind} is not map-style; pass an object with __len__ and "
                        f"__getitem__(i) for i in range(len), e.g. a torch Dataset or a list")
    return len(dataset)


class ExampleSampler(CursorSampler):
    """Batches of examples from one island's contiguous shard of a map-style ``dataset``.

    Shard ``i`` of ``n`` holds the examples ``[i*N//n, (i+1)*N//n)``, so shards are disjoint and
    cover the dataset. The shard's stream is epoch after epoch of the shard, each epoch a
    permutation drawn by a numpy Generator seeded with ``(seed, shard_index, epoch)``: every example
    is seen once per epoch. Batch ``c`` is the stream's positions ``c*B .. c*B+B-1``, collated by
    ``collate`` (default ``torch.utils.data.default_collate``); it depends only on
    ``(seed, shard_index, c)``, so restoring the cursor resumes the exact sequence. The sampler
    holds one epoch's permutation (8 bytes per shard example) and nothing of the data.
    """

    def __init__(self, dataset: Any, *, shard_index: int, num_shards: int, batch_size: int, seed: int,
                 collate: Callable[[list], Any] | None = None, tokens_per_example: int | None = None) -> None:
        """``tokens_per_example``, if known (e.g. the sequence length), makes :attr:`tokens_per_batch`
        exact without reading a batch."""
        _check_positive(num_shards=num_shards, batch_size=batch_size)
        if tokens_per_example is not None:
            _check_positive(tokens_per_example=tokens_per_example)
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} must be in [0, num_shards={num_shards})")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative (numpy SeedSequence rule)")
        n = _check_map_style(dataset)
        if n == 0:
            raise DataError("dataset is empty (len 0); pass a dataset with at least batch_size examples per island")
        self.start = shard_index * n // num_shards
        """Index in ``dataset`` of this shard's first example."""
        self.stop = (shard_index + 1) * n // num_shards
        """One past the index of this shard's last example."""
        if self.stop - self.start < batch_size:
            raise DataError(f"dataset too small for one batch per island: {n} examples over {num_shards} islands "
                            f"leave shard {shard_index} {self.stop - self.start}, fewer than batch_size="
                            f"{batch_size}; use a smaller batch_size, fewer islands or at least "
                            f"{batch_size * num_shards} examples")
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.dataset, self.collate = dataset, collate
        self.shard_index, self.num_shards, self.seed, self.batch_size = shard_index, num_shards, seed, batch_size
        self._tokens_per_example = tokens_per_example
        self._tokens_per_batch: int | None = None
        self._epochs: dict[int, np.ndarray] = {}  # epoch -> permutation of range(shard size)
        self._cursor = 0

    @property
    def shard_size(self) -> int:
        """Number of examples in this shard (one epoch)."""
        return self.stop - self.start

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one batch: ``batch_size * tokens_per_example`` when that was given, else an
        estimate, :func:`batch_tokens` of batch 0 (exact for fixed-size examples; for variable
        lengths the true count is :func:`batch_tokens` of each batch). Reads batch 0 once."""
        if self._tokens_per_batch is None:
            if self._tokens_per_example is not None:
                self._tokens_per_batch = self.batch_size * self._tokens_per_example
            else:
                self._tokens_per_batch = batch_tokens(self.batch_at(0))
        return self._tokens_per_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        permutation = self._epochs.get(epoch)
        if permutation is None:
            permutation = np.random.default_rng([self.seed, self.shard_index, epoch]).permutation(self.shard_size)
            if len(self._epochs) >= _CACHED_EPOCHS:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = permutation
        return permutation

    def indices_at(self, cursor: int) -> list[int]:
        """Dataset indices of the examples in batch number ``cursor`` (global, not shard-relative)."""
        if not isinstance(cursor, (int, np.integer)) or cursor < 0:
            raise ValueError(f"cursor={cursor!r} must be a non-negative int")
        stream = np.arange(cursor * self.batch_size, (cursor + 1) * self.batch_size)  # positions in the stream
        epochs, positions = np.divmod(stream, self.shard_size)
        indices = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():  # one or two epochs
            where = epochs == epoch
            indices[where] = self._permutation(epoch)[positions[where]]
        return (self.start + indices).tolist()

    def batch_at(self, cursor: int) -> Any:
        """Batch number ``cursor``, collated; does not move the cursor."""
        return self.collate([self.dataset[i] for i in self.indices_at(cursor)])


# Mapping keys batch_tokens reads, in order of precedence.
_MASK_KEY, _LABELS_KEY, _INPUTS_KEY = "attention_mask", "labels", "input_ids"


def _first_tensor(batch: Any):
    """The first tensor in ``batch``, searching sequences and mapping values in order, or None."""
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    values: Iterable[Any]
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        values = batch
    else:
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def batch_tokens(batch: Any) -> int:
    """The number of tokens a collated batch counts for in token-weighted merging.

    - an ``(inputs, targets)`` pair of tensors: ``targets.numel()``, the predictions scored (the
      language-model batches of :class:`islands.data.ShardSampler`);
    - a mapping (Hugging Face style): ``attention_mask.sum()`` if present (padding does not
      count), else ``labels.numel()``, else ``input_ids.numel()``;
    - anything else: the leading dimension of the first tensor found (sequences and mapping
      values searched in order), i.e. the number of examples, for data without tokens.

    Raises :class:`DataError` when the batch holds no tensor.
    """
    import torch

    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return int(batch[1].numel())
    if isinstance(batch, Mapping):
        for key in (_MASK_KEY, _LABELS_KEY, _INPUTS_KEY):
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                return int(value.sum()) if key == _MASK_KEY else int(value.numel())
    tensor = _first_tensor(batch)
    if tensor is None:
        raise DataError(f"batch of type {type(batch).__name__} holds no tensor to count; make collate return "
                        f"tensors, e.g. (inputs, targets) or a dict with input_ids")
    return int(tensor.shape[0]) if tensor.dim() else 1
