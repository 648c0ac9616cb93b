"""Tests for islands.ray_source on a real local Ray: a Parquet dataset read with Ray Data, viewed as
map-style examples, fetched block by block in the driver and in another process."""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from islands.data import DataError
from islands.examples import ExampleSampler
from islands.ray_source import RayDatasetExamples

pytestmark = [pytest.mark.ray, pytest.mark.extended]

ROWS, FILES = 1000, 4


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module, or the session's cluster when another test already started it."""
    import ray
    import ray.data

    started = not ray.is_initialized()
    if started:  # address="local": never join a cluster some other process left running
        ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
                 logging_level="WARNING")
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    # The classic Parquet reader: Ray 2.60's DataSource V2 starts a pool of footer-reading actors for every
    # read, which took 80-140 s per read here on 2 cores against about a second. What this module tests
    # starts after the read (the materialized blocks), so the reader does not change it.
    v2, context.use_datasource_v2 = context.use_datasource_v2, False
    yield ray
    context.enable_progress_bars, context.use_datasource_v2 = bars, v2
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> Path:
    """FILES Parquet files of ROWS rows in all; row i's columns all derive from i."""
    root = tmp_path_factory.mktemp("parquet")
    per_file = ROWS // FILES
    for f in range(FILES):
        i = np.arange(f * per_file, (f + 1) * per_file)
        pq.write_table(pa.table({
            "input_ids": pa.array([[k, k + 1, k + 2, k + 3] for k in i], pa.list_(pa.int32())),
            "label": i,
            "weight": (i / 2).astype(np.float32),
            "flag": i % 2 == 0,
            "text": [f"row {k}" for k in i],
            "grid": pa.array([[[k, k], [k, -k]] for k in i], pa.list_(pa.list_(pa.int16()))),
        }), root / f"part-{f}.parquet")
    return root


@pytest.fixture(scope="module")
def materialized(ray_local, parquet_dir):
    """The dataset materialized in order, in small blocks (several per file), so fetching is per block."""
    dataset = ray_local.data.read_parquet(str(parquet_dir))
    dataset.context.execution_options.preserve_order = True
    dataset.context.target_max_block_size = 8 << 10
    return dataset.materialize()


@pytest.fixture(scope="module")
def examples(materialized) -> RayDatasetExamples:
    return RayDatasetExamples.from_dataset(materialized)  # already materialized: kept as is


def test_rows_are_dicts_of_tensors_fetched_block_by_block(examples: RayDatasetExamples) -> None:
    assert len(examples) == ROWS and examples.num_blocks > FILES
    assert examples.cached_blocks == frozenset()
    row = examples[0]
    assert examples.cached_blocks == {0}  # only the block holding row 0
    assert row["input_ids"].dtype == torch.int32 and row["input_ids"].tolist() == [0, 1, 2, 3]
    assert row["label"].dim() == 0 and row["label"].dtype == torch.int64
    assert row["flag"].item() is True and row["text"] == "row 0"
    last = examples[-1]
    assert last["label"].item() == ROWS - 1 and last["weight"].item() == (ROWS - 1) / 2
    assert last["grid"].dtype == torch.int16 and last["grid"].tolist() == [[999, 999], [999, -999]]
    assert examples.cached_blocks == {0, examples.num_blocks - 1}
    with pytest.raises(IndexError, match=f"row {ROWS} is out of range for {ROWS} rows"):
        examples[ROWS]
    batch = ExampleSampler(examples, shard_index=0, num_shards=2, batch_size=8, seed=0).batch_at(0)
    assert batch["input_ids"].shape == (8, 4) and batch["grid"].shape == (8, 2, 2)
    assert batch["text"] == [f"row {k}" for k in batch["label"].tolist()]


def test_two_reads_of_the_same_parquet_number_rows_the_same(ray_local, parquet_dir, examples) -> None:
    # A fresh read: from_dataset must set preserve_order itself (without it Ray Data may emit the
    # files' rows in task-completion order), and must not leave it set on the user's dataset.
    dataset = ray_local.data.read_parquet(str(parquet_dir))
    again = RayDatasetExamples.from_dataset(dataset, columns=["label", "text"])
    assert dataset.context.execution_options.preserve_order is False
    assert again.columns == ["label", "text"] and set(again[5]) == {"label", "text"}
    assert [again[i]["label"].item() for i in range(ROWS)] == list(range(ROWS))
    assert [examples[i]["text"] for i in range(0, ROWS, 7)] == [again[i]["text"] for i in range(0, ROWS, 7)]


def test_an_island_process_fetches_only_its_shards_blocks(ray_local, examples) -> None:
    @ray_local.remote(num_cpus=1)
    def island_batch(examples: RayDatasetExamples, cursor: int):
        sampler = ExampleSampler(examples, shard_index=3, num_shards=4, batch_size=16, seed=7)
        return os.getpid(), sampler.indices_at(cursor), sampler.batch_at(cursor), sorted(examples.cached_blocks)

    pid, indices, batch, fetched = ray_local.get(island_batch.remote(examples, 5))
    assert pid != os.getpid()
    assert all(750 <= i < ROWS for i in indices) and batch["label"].tolist() == indices
    local = ExampleSampler(examples, shard_index=3, num_shards=4, batch_size=16, seed=7).batch_at(5)
    assert torch.equal(local["input_ids"], batch["input_ids"])  # the same batch in either process
    # The remote copy started with no blocks and fetched only blocks holding rows of shard 3.
    starts = np.cumsum([0, *examples.block_rows])
    shard_blocks = {k for k in range(examples.num_blocks) if starts[k + 1] > 750}
    assert fetched and set(fetched) <= shard_blocks and len(fetched) < examples.num_blocks


def test_conversions_and_bad_inputs(ray_local, materialized) -> None:
    from ray.data.extensions import ArrowTensorArray

    table = pa.table({
        "wide": pa.array([1, 2], pa.uint32()),
        "tensor": ArrowTensorArray.from_numpy(np.arange(12, dtype=np.float32).reshape(2, 2, 3)),
        "maybe": pa.array(["a", None]),
        "missing": pa.array([1, None], pa.int64()),
        "ragged": pa.array([[[1], [2, 3]], [[4]]], pa.list_(pa.list_(pa.int64()))),
    })
    rows = RayDatasetExamples([ray_local.put(table)], [2], ["wide", "tensor", "maybe"])
    first, second = rows[0], rows[1]
    assert first["wide"].dtype == torch.int64  # torch has no full uint32 support
    assert second["tensor"].shape == (2, 3) and second["tensor"][1, 2].item() == 11.0
    assert first["maybe"] == "a" and second["maybe"] is None
    bad = RayDatasetExamples([ray_local.put(table)], [2], ["missing", "ragged"])
    with pytest.raises(DataError) as exc:
        bad[1]
    assert "column 'missing' is null" in one_line(exc) and "fill or drop" in str(exc.value)
    with pytest.raises(DataError) as exc:
        RayDatasetExamples([ray_local.put(table)], [2], ["ragged"])[0]
    assert "ragged nested lists" in one_line(exc)
    with pytest.raises(DataError) as exc:
        RayDatasetExamples.from_dataset([1, 2, 3])
    assert "got a list; pass a ray.data.Dataset" in one_line(exc)
    with pytest.raises(DataError) as exc:
        RayDatasetExamples.from_dataset(materialized, columns=["label", "nope"])
    assert "columns ['nope'] not in the dataset" in one_line(exc) and "'input_ids'" in str(exc.value)
    with pytest.raises(ValueError, match="2 block refs but 1 row counts"):
        RayDatasetExamples([ray_local.put(table)] * 2, [2], ["wide"])


def test_a_one_read_dataset_is_units_an_island_process_reads_itself(ray_local, parquet_dir) -> None:
    """ray.data.read_parquet is planned as ListFiles -> ReadFiles: its row groups become units (footers only), and
    another process runs its own units' reads, getting the files' rows; nothing is materialized."""
    import ray.data

    from islands.ray_source import RayDataReads
    from islands.stream import StreamSampler
    from orchestrator.config import build_config
    from orchestrator.run.streams import reads_stream

    context = ray.data.DataContext.get_current()
    saved = context.use_datasource_v2
    try:  # Ray 2.60's default Parquet plan (ListFiles -> ReadFiles): a unit per row group, rows from the footers
        context.use_datasource_v2 = True
        v2 = RayDataReads.of(ray.data.read_parquet(str(parquet_dir)), units=8)
    finally:
        context.use_datasource_v2 = saved
    assert v2 is not None and len(v2.tasks) == FILES and sum(v2.rows) == ROWS
    dataset = ray.data.read_parquet(str(parquet_dir))  # the classic plan (this module's): one Read of read tasks
    reads = RayDataReads.of(dataset, units=8)
    assert reads is not None and len(reads.tasks) == FILES and set(reads.columns) >= {"input_ids", "label"}
    assert RayDataReads.of(dataset.map(lambda row: row), units=8) is None, "a transform after the read: materialized"
    cfg = build_config({"run": {"seed": 1}, "data": {"batch_size": 5, "block_batches": 2},
                        "pools": [{"name": "p", "islands": 2}]})
    stream, held = reads_stream(cfg, reads, "reads", hold_out=True)
    assert held and all(int(e["input_ids"][0]) == int(e["label"]) for e in held)

    @ray_local.remote(num_cpus=0)
    def island_batches(stream) -> tuple[list[int], list[int]]:
        sampler = StreamSampler(stream, island=1, seq_len=1, batch_size=5, seed=1)
        labels = [int(x) for _ in range(6) for x in sampler.next_batch()["label"]]
        return labels, sorted(stream.examples._tables)  # the units this process read

    labels, read_here = ray_local.get(island_batches.remote(stream))
    own = {stream.units[u].start for u in stream.assignment[1]}
    assert set(read_here) <= own and len(set(labels)) == len(labels) == 30
    per_unit = ROWS // len(reads.tasks)
    assert {label // per_unit for label in labels} <= own, "rows of the island's own row groups only"
