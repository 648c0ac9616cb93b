"""Tests for islands.examples: disjoint example shards, epochs, resumable cursors, collation, token counts."""

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from islands.data import DataError
from islands.examples import ExampleSampler, batch_tokens


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


class Squares(Dataset):
    """A map-style torch Dataset: example i is {"input_ids": [i, i, i], "label": i * i}."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.full((3,), i), "label": i * i}


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


def sampler(dataset, shard_index: int = 0, num_shards: int = 1, **kwargs) -> ExampleSampler:
    args = dict(batch_size=4, seed=0) | kwargs
    return ExampleSampler(dataset, shard_index=shard_index, num_shards=num_shards, **args)


def test_shards_are_disjoint_contiguous_and_cover_the_dataset() -> None:
    n, num_shards = 103, 4
    shards = []
    for i in range(num_shards):
        s = sampler(list(range(n)), i, num_shards)
        assert (s.start, s.stop) == (i * n // num_shards, (i + 1) * n // num_shards)
        seen = {j for c in range(s.shard_size // 4 + 2) for j in s.indices_at(c)}
        assert seen == set(range(s.start, s.stop))  # a little over one epoch reaches every example
        shards.append(seen)
    assert sorted(j for shard in shards for j in shard) == list(range(n))


def test_every_example_once_per_epoch_in_a_new_order_each_epoch() -> None:
    s = sampler(list(range(100)), 1, 4, batch_size=7)  # shard [25, 50): 25 examples, batches straddle epochs
    stream = [j for c in range(40) for j in s.indices_at(c)]  # 280 positions: 11 epochs and 5 over
    epochs = [stream[e * 25 : (e + 1) * 25] for e in range(11)]
    for epoch in epochs:
        assert Counter(epoch) == Counter(range(25, 50))
    assert len({tuple(epoch) for epoch in epochs}) == 11  # each epoch its own permutation
    # The examples are the batches' contents, collated: a list dataset of ints gives a tensor.
    assert s.batch_at(3).tolist() == s.indices_at(3)


def test_resuming_from_a_loaded_state_replays_the_same_batches() -> None:
    first = sampler(Squares(60), 2, 3, seed=5)
    batches, state = [], None
    for c in range(9):  # 20 examples per shard: 9 batches of 4 span two epochs
        if c == 4:
            state = first.state_dict()
        batches.append(first.next_batch())
    resumed = sampler(Squares(60), 2, 3, seed=5)
    resumed.load_state_dict(state)
    assert resumed.cursor == 4
    for c in range(4, 9):
        batch = resumed.next_batch()
        assert torch.equal(batch["input_ids"], batches[c]["input_ids"])
        assert torch.equal(batch["label"], batches[c]["label"])
    fresh = sampler(Squares(60), 2, 3, seed=5)
    assert fresh.indices_at(7) == first.indices_at(7)  # random access, no history needed
    assert sampler(Squares(60), 2, 3, seed=6).indices_at(0) != first.indices_at(0)


def test_default_collate_stacks_dict_examples_and_a_custom_collate_is_used() -> None:
    s = sampler(Squares(8), batch_size=4)
    batch = s.batch_at(0)
    ids = s.indices_at(0)
    assert batch["input_ids"].shape == (4, 3) and batch["input_ids"][:, 0].tolist() == ids
    assert batch["label"].tolist() == [i * i for i in ids]
    custom = sampler(Squares(8), batch_size=4, collate=lambda examples: [e["label"] for e in examples])
    assert custom.batch_at(0) == [i * i for i in ids]


def test_tokens_per_batch_is_given_or_estimated_from_the_first_batch() -> None:
    assert sampler(Squares(8), tokens_per_example=3).tokens_per_batch == 12
    pairs = [(torch.arange(5), torch.arange(1, 6)) for _ in range(8)]
    assert sampler(pairs).tokens_per_batch == 4 * 5  # targets of (inputs, targets) pairs
    assert sampler(Squares(8)).tokens_per_batch == 12  # input_ids of dict examples


def test_state_from_another_shard_and_bad_arguments_are_refused() -> None:
    state = sampler(list(range(40)), 0, 2).state_dict()
    with pytest.raises(ValueError, match="state is for shard 0 of 2 but this is shard 1 of 2"):
        sampler(list(range(40)), 1, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="cursor=-1 must be a non-negative int"):
        sampler(list(range(40)), 0, 2).load_state_dict(state | {"cursor": -1})
    with pytest.raises(ValueError, match=r"shard_index=2 must be in \[0, num_shards=2\)"):
        sampler(list(range(40)), 2, 2)
    with pytest.raises(ValueError, match="batch_size=0 must be a positive int"):
        sampler(list(range(40)), batch_size=0)


def test_bad_datasets_get_one_line_errors_that_name_the_fix() -> None:
    with pytest.raises(DataError) as exc:
        sampler([])
    assert "dataset is empty" in one_line(exc)
    with pytest.raises(DataError) as exc:
        sampler(list(range(10)), 0, 4)
    message = one_line(exc)
    assert message.startswith("dataset too small for one batch per island: 10 examples over 4 islands")
    assert "shard 0 2, fewer than batch_size=4" in message
    assert "smaller batch_size, fewer islands or at least 16 examples" in message
    for bad, words in ((Stream(), "is an IterableDataset"), ((i for i in range(10)), "is not map-style"),
                       ({0: "a", 1: "b"}, "type dict is not map-style")):
        with pytest.raises(DataError) as exc:
            sampler(bad, batch_size=1)
        assert words in one_line(exc) and "__getitem__" in str(exc.value)


def test_batch_tokens_follows_each_documented_rule() -> None:
    inputs, targets = torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)
    assert batch_tokens((inputs, targets)) == 64
    assert batch_tokens([inputs, targets[:, :8]]) == 32  # the targets, not the inputs
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ids = torch.zeros(2, 4, dtype=torch.long)
    assert batch_tokens({"input_ids": ids, "attention_mask": mask, "labels": ids}) == 5  # padding does not count
    assert batch_tokens({"input_ids": ids, "labels": torch.zeros(2, 3)}) == 6
    assert batch_tokens({"input_ids": ids}) == 8
    images, classes = torch.zeros(6, 3, 8, 8), torch.zeros(6)
    assert batch_tokens({"pixels": images, "class": classes}) == 6  # no token keys: examples
    assert batch_tokens([[images], "name"]) == 6  # nested, searched in order
    assert batch_tokens((images, classes, classes)) == 6  # three items: not an (inputs, targets) pair
    with pytest.raises(DataError) as exc:
        batch_tokens({"text": ["a", "b"]})
    assert "holds no tensor" in one_line(exc)
