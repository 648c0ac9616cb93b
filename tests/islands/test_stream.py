"""islands/stream.py: each island streams its own units; windows, blocks, exact resumes, read-ahead, bad units.

The corpus is one token file of unique ids (``np.arange``), so every token names its place in the file and a
batch says exactly which stream tokens it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from islands.corpus import CorpusFormat, Unit, UnitError, index_parquet, index_token_files, read_unit
from islands.cursor import DataCursor
from islands.data import DataError
from islands.stream import StreamSampler, TokenStream
from policies.data_plan import assign_units, epoch_order


def build_stream(tmp_path: Path, *, units: int, unit_tokens: int, islands: int, shuffle: bool = True,
                 block_batches: int = 2, readahead: int = 2, seed: int = 0) -> TokenStream:
    """``units`` training units of ``unit_tokens`` unique ids each, planned for ``islands`` (as corpus_stream does)."""
    n = (units + 1) * unit_tokens
    np.arange(n, dtype="<u4").tofile(tmp_path / "ids.bin")
    root, index, _ = index_token_files(str(tmp_path / "ids.bin"), dtype="uint32", unit_tokens=unit_tokens,
                                       heldout_fraction=1e-12)
    train = [u for u in index if not u.heldout]
    assert len(train) == units and index[-1].heldout  # the last unit is the held-out one
    fmt = CorpusFormat("tokens", is_text=False, dtype="uint32", vocab_size=n)
    plan = assign_units([u.tokens for u in train], islands, seed=seed, shuffle=shuffle)
    return TokenStream(fmt=fmt, root=root, units=tuple(train), assignment=tuple(tuple(a) for a in plan),
                       shuffle=shuffle, block_batches=block_batches, readahead=readahead, source="test")


@pytest.fixture
def sampler() -> Iterator[Callable[..., StreamSampler]]:
    """A factory of StreamSamplers, closed after the test."""
    made: list[StreamSampler] = []

    def make(stream: TokenStream, **kwargs) -> StreamSampler:
        kwargs = dict(island=0, seq_len=4, batch_size=2, seed=7) | kwargs
        made.append(StreamSampler(stream, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


class Recorder:
    """A ``read=`` that reads units for real, records their names, can fail some, and keeps weak references
    to what it returned (to count the units the sampler still holds). Past ``limit`` reads it raises
    RuntimeError, which the sampler does not catch: a sampler reading in circles fails instead of hanging."""

    def __init__(self, fail: set[str] = frozenset(), limit: int = 1000) -> None:
        self.fail = set(fail)
        self.limit = limit
        self.names: list[str] = []
        self.arrays: list[weakref.ref] = []

    def __call__(self, fmt: CorpusFormat, root: str, unit: Unit) -> np.ndarray:
        self.names.append(unit.name)
        if len(self.names) > self.limit:
            raise RuntimeError(f"{len(self.names)} units read: the sampler reads in circles")
        if unit.name in self.fail:
            raise UnitError(f"unit {unit.name!r} of {root} could not be read: injected")
        ids = read_unit(fmt, root, unit)
        self.arrays.append(weakref.ref(ids))
        return ids

    def alive(self) -> int:
        return sum(r() is not None for r in self.arrays)


def ids_of(unit: Unit) -> np.ndarray:
    return np.arange(unit.start, unit.start + unit.count)


def island_stream(stream: TokenStream, island: int, seed: int, epochs: int, skip: frozenset = frozenset()) -> np.ndarray:
    """The island's units in the plan's epoch order, epoch after epoch: what its windows must be cut from."""
    units = stream.assignment[island]
    pieces = []
    for e in range(epochs):
        for p in epoch_order(len(units), seed=seed, island=island, epoch=e, shuffle=stream.shuffle):
            unit = stream.units[units[p]]
            if unit.name not in skip:
                pieces.append(ids_of(unit))
    return np.concatenate(pieces)


def draw(s: StreamSampler, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [s.next_batch() for _ in range(n)]


def windows(batch: tuple[torch.Tensor, torch.Tensor]) -> np.ndarray:
    """(B, T+1) windows of a batch: its inputs and the last target."""
    x, y = batch
    return torch.cat([x, y[:, -1:]], dim=1).numpy()


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


# --- windows ------------------------------------------------------------------------------------


def test_windows_are_slices_of_the_islands_stream_at_stride_seq_len(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=6, unit_tokens=23, islands=2)
    s = sampler(stream, island=1, seq_len=4, batch_size=3)
    ref = island_stream(stream, 1, seed=7, epochs=6)
    where = {}
    for p in range(0, len(ref) - 4, 4):
        where.setdefault(int(ref[p]), []).append(p)
    for batch in draw(s, 30):  # 360 tokens: past three epochs of the island's 69
        x, y = batch
        assert x.shape == y.shape == (3, 4) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for w in windows(batch):
            assert any(np.array_equal(ref[p:p + 5], w) for p in where[int(w[0])]), w


def test_one_epoch_of_windows_covers_every_token_of_the_island_once_and_islands_are_disjoint(tmp_path: Path, sampler) -> None:
    # 6 units of 40 tokens, 3 per island: 120 tokens = 4 blocks of 2 batches of 3 windows of 5 tokens.
    stream = build_stream(tmp_path, units=6, unit_tokens=40, islands=2, block_batches=2)
    assert [len(a) for a in stream.assignment] == [3, 3]
    inputs = []
    for island in (0, 1):
        s = sampler(stream, island=island, seq_len=5, batch_size=3)
        x = torch.cat([b[0] for b in draw(s, 8)]).numpy()  # (24, 5)
        starts = x[:, 0]
        assert len(set(starts.tolist())) == len(starts)  # no window start repeated
        mine = np.concatenate([ids_of(stream.units[u]) for u in stream.assignment[island]])
        assert np.array_equal(np.sort(x.ravel()), np.sort(mine))  # inputs tile the island's tokens exactly
        inputs.append(set(x.ravel().tolist()))
        # Block b (batches 2b, 2b + 1) holds the stream's windows 6b..6b+5, each block in its own shuffled order.
        position = {int(v): p for p, v in enumerate(island_stream(stream, island, seed=7, epochs=1))}
        window = np.array([position[int(v)] for v in starts]) // 5  # (24,) window numbers in the stream
        orders = [tuple((window[6 * b:6 * b + 6] - 6 * b).tolist()) for b in range(4)]
        assert all(sorted(o) == list(range(6)) for o in orders), orders
        assert len(set(orders)) > 1 and tuple(range(6)) not in orders[:2], orders
    assert not inputs[0] & inputs[1]
    assert inputs[0] | inputs[1] == set(range(240))


def test_an_island_reads_only_its_own_units(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=9, unit_tokens=17, islands=3)
    for island in range(3):
        recorder = Recorder()
        s = sampler(stream, island=island, read=recorder)
        draw(s, 40)  # 320 tokens: several epochs of the island's 51
        own = {stream.units[u].name for u in stream.assignment[island]}
        assert set(recorder.names) == own
        assert s.bytes_read == 4 * 17 * len(recorder.arrays)  # uint32 ids of every unit read


def test_without_shuffle_units_and_windows_are_read_in_order(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=6, unit_tokens=10, islands=2, shuffle=False)
    assert stream.assignment == ((0, 1, 2), (3, 4, 5))
    recorder = Recorder()
    s = sampler(stream, island=1, seq_len=4, batch_size=2, read=recorder)
    batches = draw(s, 10)  # 80 tokens of a 30-token island: it wraps
    ref = np.tile(np.arange(30, 60), 4)
    for n, batch in enumerate(batches):
        for r, w in enumerate(windows(batch)):
            start = (n * 2 + r) * 4
            assert np.array_equal(w, ref[start:start + 5]), (n, r)
    assert recorder.names[:6] == ["ids.bin@30", "ids.bin@40", "ids.bin@50"] * 2


# --- resuming from a cursor ---------------------------------------------------------------------


def test_seeking_to_a_cursor_replays_the_same_batches(tmp_path: Path, sampler) -> None:
    # Island 0 has 2 units of 23 tokens (46 a epoch); a block is 3 batches of 2 windows of 4 tokens (24): blocks
    # straddle units and epochs.
    stream = build_stream(tmp_path, units=4, unit_tokens=23, islands=2, block_batches=3)
    original = sampler(stream)
    cursors, batches = [], []
    for _ in range(24):
        cursors.append(original.data_cursor)
        batches.append(original.next_batch())
    assert [c.batch for c in cursors] == list(range(24))
    assert max(c.unit for c in cursors) >= 6  # the cursors reach the fourth epoch
    assert any(c.offset for c in cursors)  # blocks start inside units
    # Inside a block (1, 4, 8), at block boundaries (0, 3, 9) and in blocks that cross epochs (5, 11, 13).
    for k in (0, 1, 3, 4, 5, 8, 9, 11, 13, 17, 21, 23):
        recorder = Recorder()
        resumed = sampler(stream, read=recorder)
        resumed.seek(cursors[k])
        assert resumed.data_cursor == cursors[k]
        assert same(draw(resumed, 24 - k), batches[k:]), k
        # Nothing before the block is read again: the first unit read is the one the cursor names.
        assert recorder.names[0] == original.unit_at(cursors[k].unit).name


def test_data_cursor_names_where_the_block_starts(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=2, unit_tokens=30, islands=1, shuffle=False, block_batches=2)
    s = sampler(stream, seq_len=4, batch_size=2)  # 16 tokens a block in a 60-token epoch
    seen = []
    for _ in range(9):
        seen.append(s.data_cursor)
        s.next_batch()
    # Block b starts at stream token 16 b: units of 30 tokens, epochs of 60.
    assert seen == [DataCursor(0, 0, 0), DataCursor(1, 0, 0), DataCursor(2, 0, 16), DataCursor(3, 0, 16),
                    DataCursor(4, 1, 2), DataCursor(5, 1, 2), DataCursor(6, 1, 18), DataCursor(7, 1, 18),
                    DataCursor(8, 2, 4)]


def test_state_dict_round_trips_and_belongs_to_its_island(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=4, unit_tokens=23, islands=2, block_batches=3)
    original = sampler(stream, island=1)
    draw(original, 5)
    state = original.state_dict()
    rest = draw(original, 6)
    resumed = sampler(stream, island=1)
    resumed.load_state_dict(state)
    assert resumed.cursor == 5 and same(draw(resumed, 6), rest)
    with pytest.raises(ValueError, match="island 1"):
        sampler(stream, island=0).load_state_dict(state)


def test_several_workers_of_an_island_split_its_stream_batches(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=4, unit_tokens=23, islands=2, block_batches=3)
    alone = sampler(stream)
    expected = draw(alone, 20)
    workers = [sampler(stream, world=2, rank=r) for r in (0, 1)]
    cursors = []
    for step in range(10):
        cursors.append(workers[0].data_cursor)
        assert workers[1].data_cursor == cursors[-1]
        b0, b1 = workers[0].next_batch(), workers[1].next_batch()
        assert not torch.equal(b0[0], b1[0])
        assert same([b0, b1], expected[2 * step:2 * step + 2]), step
    # A worker resumes from the island's cursor: step c is stream batches 2c and 2c + 1 (blocks of 3 batches).
    for step in (1, 4, 7):
        resumed = sampler(stream, world=2, rank=1)
        resumed.seek(cursors[step])
        assert same(draw(resumed, 10 - step), expected[2 * step + 1::2]), step


def test_bad_sampler_arguments_are_rejected(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=4, unit_tokens=10, islands=2, block_batches=2)
    with pytest.raises(ValueError, match="island=2"):
        sampler(stream, island=2)
    with pytest.raises(ValueError, match="block_batches"):
        sampler(stream, world=3, rank=0)
    with pytest.raises(ValueError, match="rank=2"):
        sampler(stream, world=2, rank=2)
    with pytest.raises(ValueError):
        sampler(stream, seq_len=0)
    with pytest.raises(TypeError):
        sampler(stream).batch_at(0)


# --- read-ahead ---------------------------------------------------------------------------------


@pytest.mark.parametrize("readahead", [0, 1, 3])
def test_read_ahead_holds_at_most_readahead_plus_one_units(tmp_path: Path, sampler, readahead: int) -> None:
    stream = build_stream(tmp_path, units=12, unit_tokens=10, islands=1, shuffle=False, readahead=readahead)
    recorder = Recorder()
    s = sampler(stream, seq_len=4, batch_size=1, read=recorder)  # blocks of 2 batches: 8 tokens
    for n in range(60):  # 480 tokens: four epochs of 120
        s.next_batch()
        block = n // 2
        needed = (block + 1) * 8 // 10 + 1  # units up to the one holding the block's last token
        assert needed <= len(recorder.names) <= needed + readahead, n
        assert recorder.alive() <= readahead + 1, n
    assert recorder.names[:13] == [f"ids.bin@{10 * k}" for k in range(12)] + ["ids.bin@0"]


# --- unreadable units ---------------------------------------------------------------------------


def test_an_unreadable_unit_is_skipped_and_counted_once(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=5, unit_tokens=12, islands=1, block_batches=2)
    bad = stream.units[2]
    recorder = Recorder(fail={bad.name})
    s = sampler(stream, seq_len=4, batch_size=2, read=recorder)
    # The stream leaves the unit out: 48 tokens an epoch, 6 batches of 8 tokens.
    batches = draw(s, 6)
    x = torch.cat([b[0] for b in batches]).numpy()
    assert np.array_equal(np.sort(x.ravel()), np.setdiff1d(np.arange(60), ids_of(bad)))
    assert s.skipped == {f"{bad.name}/0": 12}
    draw(s, 20)  # training goes on, epoch after epoch
    assert set(s.skipped) == {f"{bad.name}/{e}" for e in range(len(s.skipped))} and len(s.skipped) >= 3
    assert set(s.skipped.values()) == {12}
    skipped = dict(s.skipped)
    s.seek(DataCursor())  # reading the unit again does not count it again
    draw(s, 6)
    assert s.skipped == skipped


def test_seeking_past_or_before_an_unreadable_unit_is_deterministic(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=5, unit_tokens=12, islands=1, block_batches=2)
    fail = {stream.units[2].name}
    original = sampler(stream, seq_len=4, batch_size=2, read=Recorder(fail))
    ref = island_stream(stream, 0, seed=7, epochs=5, skip=frozenset(fail))
    cursors, batches = [], []
    for _ in range(16):
        cursors.append(original.data_cursor)
        batches.append(original.next_batch())
    for n, batch in enumerate(batches[:6]):  # the first epoch's windows, in some order, are the stream's
        assert set(windows(batch)[:, 0].tolist()) <= set(ref[n // 2 * 16:(n // 2 + 1) * 16:4].tolist())
    for k in range(16):
        resumed = sampler(stream, seq_len=4, batch_size=2, read=Recorder(fail))
        resumed.seek(cursors[k])
        assert same(draw(resumed, 16 - k), batches[k:]), k


def test_an_island_whose_units_all_fail_raises_instead_of_looping(tmp_path: Path, sampler) -> None:
    stream = build_stream(tmp_path, units=6, unit_tokens=10, islands=2)
    names = {stream.units[u].name for u in stream.assignment[1]}
    s = sampler(stream, island=1, read=Recorder(fail=names, limit=100))
    with pytest.raises(DataError, match="island 1") as exc:
        s.next_batch()
    assert not isinstance(exc.value, UnitError) and "\n" not in str(exc.value)
    # The other island's units are readable: it trains.
    assert sampler(stream, island=0, read=Recorder(fail=names)).next_batch()[0].shape == (2, 4)


# --- a Parquet corpus ---------------------------------------------------------------------------


def test_a_parquet_stream_never_yields_heldout_rows(tmp_path: Path, sampler) -> None:
    rows = 60  # row i holds ids [4i, 4i + 4)
    table = pa.table({"tokens": pa.array([list(range(4 * i, 4 * i + 4)) for i in range(rows)], type=pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    root, units, _ = index_parquet(str(tmp_path), column="tokens", is_text=False)
    fmt = CorpusFormat("parquet", column="tokens", is_text=False, heldout_fraction=0.25, vocab_size=4 * rows)
    held = set().union(*({int(v) // 4 for v in read_unit(fmt, root, u, heldout=True)} for u in units))
    assert 0 < len(held) < rows
    plan = assign_units([u.tokens for u in units], 2, seed=0)
    stream = TokenStream(fmt=fmt, root=root, units=tuple(units), assignment=tuple(tuple(a) for a in plan), block_batches=2)
    seen: set[int] = set()
    for island in (0, 1):
        s = sampler(stream, island=island, seq_len=4, batch_size=2)
        for x, y in draw(s, 30):
            seen |= {int(v) // 4 for v in torch.cat([x, y], dim=1).ravel()}
    assert seen == set(range(rows)) - held
