"""Data from the Python API goes the corpus's way (orchestrator/run/streams.py): a token array, a map-style dataset and
a Ray Data read become units, a plan and one stream per island, resumable from a DataCursor. No Ray here: a token
array's units stay arrays in process (a run puts each in the object store), and a stand-in for a Ray Data read
(islands.ray_source.RayDataReads) reads its "read tasks" in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from islands.data import DataError
from islands.stream import StreamSampler
from orchestrator.config import build_config
from orchestrator.run.streams import array_stream, examples_stream, reads_stream

SEED = 7


def config(islands: int = 2, **data) -> object:
    return build_config({"run": {"seed": SEED}, "data": {"batch_size": 4, "block_batches": 2, **data},
                         "pools": [{"name": "p", "islands": islands}]})


def test_a_token_array_is_cut_into_units_each_island_reads_only_its_own() -> None:
    ids = np.arange(10_000, dtype=np.int32)
    stream = array_stream(config(unit_tokens=1000), ids, "array")
    assert [u.name for u in stream.units][:2] == ["array@0", "array@1000"] and len(stream.units) == 10
    assert all(np.shares_memory(p, ids) for p in stream.payloads), "units are views until the run puts them"
    for island in range(2):
        sampler = StreamSampler(stream, island=island, seq_len=8, batch_size=4, seed=SEED)
        starts = []
        for _ in range(20):
            x, y = sampler.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 7, dtype=torch.long))
            starts += x[:, 0].tolist()
        own = {int(s) // 1000 for s in starts}
        assert own <= {stream.units[u].start // 1000 for u in stream.assignment[island]}, (island, own)
    # With refs put (a run's driver does this before the islands start), each unit is its own object.
    put = stream.with_refs(lambda array: ("ref", len(array)))
    assert put.payloads == tuple([("ref", 1000)] for _ in range(10)) and put.with_refs(lambda a: 1 / 0) == put


def test_a_map_style_dataset_streams_examples_once_per_epoch_and_resumes_exactly() -> None:
    data = [{"id": torch.tensor(i), "x": torch.full((3,), float(i))} for i in range(100)]
    stream = examples_stream(config(unit_examples=10), data, "list")
    assert len(stream.units) == 10 and stream.of_examples
    seen = {}
    for island in range(2):
        sampler = StreamSampler(stream, island=island, seq_len=1, batch_size=4, seed=SEED)
        share = stream.island_tokens(island)
        batches, cursors = [], []
        for _ in range(share // 4 * 2):  # two epochs of the island's examples
            cursors.append(sampler.data_cursor)
            batch = sampler.next_batch()
            assert torch.equal(batch["x"][:, 0].long(), batch["id"])  # collated by default_collate
            batches.append(batch["id"].tolist())
        first = [i for b in batches[: share // 4] for i in b]  # the first epoch's whole batches
        assert len(first) == len(set(first)) == share // 4 * 4, "no example twice within an epoch"
        seen[island] = {i for b in batches for i in b}
        assert len(seen[island]) == share, "two epochs cover the island's examples"
        resumed = StreamSampler(stream, island=island, seq_len=1, batch_size=4, seed=SEED)
        resumed.seek(cursors[7])
        assert [resumed.next_batch()["id"].tolist() for _ in range(len(batches) - 7)] == batches[7:]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 100


def test_a_dataset_smaller_than_the_islands_is_refused_in_one_line() -> None:
    with pytest.raises(DataError, match=r"has 2 examples, fewer than the 3 islands; .* train fewer islands"):
        examples_stream(config(islands=3), [{"a": 1}, {"a": 2}], "tiny")


class Reads:
    """Stands in for islands.ray_source.RayDataReads: `tasks` read tasks of `rows` rows each, read in process."""

    def __init__(self, tasks: int, rows: int) -> None:
        self.tasks, self.rows, self.columns, self.reads = [object()] * tasks, [rows] * tasks, ["id"], []

    def read_unit(self, k: int) -> int:
        self.reads.append(k)
        return self.rows[k]

    def __getitem__(self, index: int) -> dict:
        return {"id": torch.tensor((index >> 32) * 1000 + (index & 0xFFFFFFFF))}


def test_a_ray_data_read_is_units_of_read_tasks_that_islands_run_themselves() -> None:
    reads = Reads(tasks=12, rows=20)
    stream, heldout = reads_stream(config(), reads, "reads", hold_out=True)
    held = [u for u in range(12) if f"read@{u}" not in {x.name for x in stream.units}]
    assert len(held) >= 1 and len(stream.units) == 12 - len(held)
    assert heldout and {int(e["id"]) // 1000 for e in heldout} <= set(held), "held-out rows come from held-out tasks"
    reads.reads.clear()
    sampler = StreamSampler(stream, island=1, seq_len=1, batch_size=4, seed=SEED)
    ids = [i for _ in range(10) for i in sampler.next_batch()["id"].tolist()]
    own = {stream.units[u].start for u in stream.assignment[1]}
    assert {i // 1000 for i in ids} <= own and set(reads.reads) <= own, "an island runs only its own read tasks"
    given, none = reads_stream(config(), Reads(tasks=12, rows=20), "reads", hold_out=False)
    assert none is None and len(given.units) == 12
    with pytest.raises(DataError, match="too few for 2 islands"):
        reads_stream(config(), Reads(tasks=2, rows=20), "reads", hold_out=True)
