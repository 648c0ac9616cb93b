"""islands/corpus.py: corpora cut into units from metadata, and the reading of one unit, on real files."""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from islands.corpus import (
    CorpusFormat,
    CorpusIndex,
    Unit,
    UnitError,
    _split_largest,
    heldout_sample,
    index_parquet,
    index_stdlib,
    index_token_files,
    read_unit,
)
from islands.data import DataError, load_stdlib_corpus

NEVER = 1e-12  # a held-out fraction no row hash falls under


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


def write_parquet(path: Path, rows: int, *, row_group_size: int, first: int = 0) -> None:
    """Rows ``first..first+rows-1``: text "doc i: héllo" and tokens [3i, 3i+1, 3i+2] (an id names its row: id // 3)."""
    ids = range(first, first + rows)
    table = pa.table({
        "text": [f"doc {i}: héllo" for i in ids],
        "tokens": pa.array([[3 * i, 3 * i + 1, 3 * i + 2] for i in ids], type=pa.list_(pa.int32())),
    })
    pq.write_table(table, path, row_group_size=row_group_size)


def write_tokens(path: Path, n: int, dtype: str = "<u2") -> np.ndarray:
    ids = np.arange(n).astype(dtype)
    ids.tofile(path)
    return ids


def token_rows(ids: np.ndarray) -> set[int]:
    """The rows of :func:`write_parquet` a token unit's ids come from (each row whole)."""
    assert len(ids) % 3 == 0
    rows = ids.reshape(-1, 3) // 3
    assert (rows == rows[:, :1]).all()
    return set(rows[:, 0].tolist())


# --- Parquet: units from footers ----------------------------------------------------------------


def test_parquet_units_are_row_groups_of_the_data_files_in_sorted_path_order(tmp_path: Path) -> None:
    write_parquet(tmp_path / "b.parquet", 30, row_group_size=20, first=50)
    write_parquet(tmp_path / "a.parquet", 50, row_group_size=20)
    (tmp_path / "sub").mkdir()
    write_parquet(tmp_path / "sub" / "c.parquet", 5, row_group_size=20, first=80)
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / "README.txt").write_text("not data")
    root, units, rows = index_parquet(str(tmp_path), column="tokens", is_text=False)
    assert Path(root) == tmp_path and rows == 85
    assert [u.name for u in units] == ["a.parquet#0", "a.parquet#1", "a.parquet#2", "b.parquet#0", "b.parquet#1",
                                       "sub/c.parquet#0"]
    assert [(u.path, u.group, u.start, u.count) for u in units] == [
        ("a.parquet", 0, 0, 20), ("a.parquet", 1, 0, 20), ("a.parquet", 2, 0, 10),
        ("b.parquet", 0, 0, 20), ("b.parquet", 1, 0, 10), ("sub/c.parquet", 0, 0, 5)]
    assert [u.tokens for u in units] == [60, 60, 30, 60, 30, 15]  # list values in the footer
    assert all(u.heldout is None for u in units)  # rows are split, not units


def test_a_single_parquet_file_is_named_relative_to_its_directory(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 25, row_group_size=10)
    root, units, rows = index_parquet(str(tmp_path / "a.parquet"), column="text", is_text=True)
    assert Path(root) == tmp_path and rows == 25
    assert [u.name for u in units] == ["a.parquet#0", "a.parquet#1", "a.parquet#2"]
    assert all(u.tokens > 0 for u in units)  # text: the column chunk's uncompressed bytes


def test_too_few_row_groups_are_halved_largest_first_into_named_slices(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 50, row_group_size=20)  # groups of 20, 20, 10 rows
    _, units, rows = index_parquet(str(tmp_path), column="tokens", is_text=False, minimum_units=6)
    assert rows == 50
    assert [(u.name, u.group, u.start, u.count) for u in units] == [
        ("a.parquet#0:0+5", 0, 0, 5), ("a.parquet#0:5+5", 0, 5, 5), ("a.parquet#0:10+10", 0, 10, 10),
        ("a.parquet#1:0+10", 1, 0, 10), ("a.parquet#1:10+10", 1, 10, 10), ("a.parquet#2", 2, 0, 10)]
    assert sum(u.tokens for u in units) == 150


def test_split_largest_makes_at_least_minimum_units_unless_nothing_is_left_to_halve() -> None:
    units = [Unit("t.bin@0", "t.bin", -1, 0, 7, 7, False), Unit("t.bin@7", "t.bin", -1, 7, 2, 2, False)]
    for minimum in range(1, 10):
        split = _split_largest(units, minimum)
        assert len(split) == max(minimum, 2)
        assert sum(u.count for u in split) == 9 and sum(u.tokens for u in split) == 9
        # The pieces still tile the file in order.
        assert [u.start for u in split] == np.cumsum([0] + [u.count for u in split[:-1]]).tolist()
        assert len({u.name for u in split}) == len(split)
    assert len(_split_largest(units, 10)) == 9  # nine one-token units: nothing left to halve
    assert _split_largest(units, 1) == units


def test_halved_units_keep_file_names_that_hold_colons_and_at_signs(tmp_path: Path) -> None:
    # Timestamped and versioned file names: the halves must still name their file, and stay unique.
    for name in ("t@1.bin", "t@2.bin"):
        write_tokens(tmp_path / name, 100)
    _, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=1000, minimum_units=4)
    assert [u.name for u in units] == ["t@1.bin@0+50", "t@1.bin@50+50", "t@2.bin@0+50", "t@2.bin@50+50"]
    (tmp_path / "p").mkdir()
    for name in ("2024-01-01T00:00:00.parquet", "2024-01-01T00:30:00.parquet"):
        write_parquet(tmp_path / "p" / name, 10, row_group_size=10)
    _, units, _ = index_parquet(str(tmp_path / "p"), column="text", is_text=True, minimum_units=4)
    assert [u.name for u in units] == ["2024-01-01T00:00:00.parquet#0:0+5", "2024-01-01T00:00:00.parquet#0:5+5",
                                       "2024-01-01T00:30:00.parquet#0:0+5", "2024-01-01T00:30:00.parquet#0:5+5"]


# --- Parquet: the held-out rule and reading -----------------------------------------------------


def read_rows(fmt: CorpusFormat, root: str, units: list[Unit], *, heldout: bool) -> list[set[int]]:
    return [token_rows(read_unit(fmt, root, u, heldout=heldout)) for u in units]


def test_parquet_holds_out_the_same_rows_however_the_units_are_sliced(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 60, row_group_size=16)
    fmt = CorpusFormat("parquet", column="tokens", is_text=False, heldout_fraction=0.3)
    held_by_slicing = []
    for minimum in (1, 7, 13):
        root, units, _ = index_parquet(str(tmp_path), column="tokens", is_text=False, minimum_units=minimum)
        assert len(units) == max(minimum, 4)
        train = read_rows(fmt, root, units, heldout=False)
        held = read_rows(fmt, root, units, heldout=True)
        for unit, t, h in zip(units, train, held):
            # A unit's rows are split: disjoint, and together exactly its rows.
            first = 16 * unit.group + unit.start
            assert not t & h and t | h == set(range(first, first + unit.count)), unit
        held_by_slicing.append(set().union(*held))
    assert held_by_slicing[0] == held_by_slicing[1] == held_by_slicing[2]
    assert 5 < len(held_by_slicing[0]) < 35  # about 30% of 60 rows


def test_parquet_text_rows_are_utf8_bytes_each_followed_by_a_newline(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 50, row_group_size=20)
    root, units, _ = index_parquet(str(tmp_path), column="text", is_text=True)
    fmt = CorpusFormat("parquet", column="text", is_text=True, heldout_fraction=NEVER, shuffle_rows=False)
    assert fmt.separator == 10
    ids = read_unit(fmt, root, units[1])
    assert ids.dtype == np.uint8
    assert ids.tobytes() == b"".join(f"doc {i}: héllo".encode() + b"\n" for i in range(20, 40))
    assert len(read_unit(fmt, root, units[1], heldout=True)) == 0


def test_parquet_rows_shuffled_are_the_same_rows_in_a_fixed_order(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 50, row_group_size=20)
    root, units, _ = index_parquet(str(tmp_path), column="text", is_text=True)
    fmt = CorpusFormat("parquet", column="text", is_text=True, heldout_fraction=NEVER, shuffle_rows=True)
    lines = read_unit(fmt, root, units[0]).tobytes().split(b"\n")
    assert lines[-1] == b""
    expected = [f"doc {i}: héllo".encode() for i in range(20)]
    assert sorted(lines[:-1]) == sorted(expected) and lines[:-1] != expected
    assert np.array_equal(read_unit(fmt, root, units[0]), read_unit(fmt, root, units[0]))


def test_parquet_token_rows_are_the_ids_of_the_row_group(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 50, row_group_size=20)
    root, units, _ = index_parquet(str(tmp_path), column="tokens", is_text=False, minimum_units=4)
    fmt = CorpusFormat("parquet", column="tokens", is_text=False, heldout_fraction=NEVER, shuffle_rows=False)
    assert units[0].name == "a.parquet#0:0+10"
    assert read_unit(fmt, root, units[0]).tolist() == list(range(0, 30))
    assert read_unit(fmt, root, units[2]).tolist() == list(range(60, 120))  # a.parquet#1: rows 20..39
    assert read_unit(fmt, root, units[2]).dtype == np.int32


# --- token files --------------------------------------------------------------------------------


def test_token_file_units_are_fixed_ranges_named_by_their_start(tmp_path: Path) -> None:
    ids = write_tokens(tmp_path / "t.bin", 1000)
    root, units, total = index_token_files(str(tmp_path / "t.bin"), dtype="uint16", unit_tokens=128)
    assert Path(root) == tmp_path and total == 1000
    assert [u.name for u in units] == [f"t.bin@{s}" for s in range(0, 1000, 128)]
    assert [u.count for u in units] == [128] * 7 + [104]
    assert [u.tokens for u in units] == [u.count for u in units]
    fmt = CorpusFormat("tokens", is_text=False, dtype="uint16", vocab_size=1000)
    for u in units:
        got = read_unit(fmt, root, u, heldout=bool(u.heldout))
        assert got.dtype == np.dtype("<u2") and np.array_equal(got, ids[u.start:u.start + u.count]), u.name
        assert len(read_unit(fmt, root, u, heldout=not u.heldout)) == 0  # the other split holds nothing of it


def test_token_files_hold_out_whole_units_by_a_hash_of_the_name(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 3000)
    _, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=100, heldout_fraction=0.2)
    expected = [zlib.crc32(u.name.encode()) / 2**32 < 0.2 for u in units]
    assert any(expected) and not all(expected)
    assert [u.heldout for u in units] == expected
    index = CorpusIndex(CorpusFormat("tokens", is_text=False, dtype="uint16"), str(tmp_path), tuple(units), "t")
    assert index.heldout_units() == [i for i, h in enumerate(expected) if h]
    assert index.train_units() == [i for i, h in enumerate(expected) if not h]


def test_token_files_hold_out_the_last_unit_when_no_hash_falls_under_the_fraction(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 500)
    _, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=100, heldout_fraction=NEVER)
    assert [u.heldout for u in units] == [False] * 4 + [True]


def test_a_directory_of_token_files_is_read_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    b = np.arange(1000, 1070, dtype="<u4")
    b.tofile(tmp_path / "shards" / "b.u32")
    a = write_tokens(tmp_path / "a.bin", 50, "<u4")
    (tmp_path / "index.json").write_text("{}")
    root, units, total = index_token_files(str(tmp_path), dtype="uint32", unit_tokens=40)
    assert total == 120
    assert [u.name for u in units] == ["a.bin@0", "a.bin@40", "shards/b.u32@0", "shards/b.u32@40"]
    fmt = CorpusFormat("tokens", is_text=False, dtype="uint32")
    got = np.concatenate([read_unit(fmt, root, u, heldout=bool(u.heldout)) for u in units])
    assert np.array_equal(got, np.concatenate([a, b]))


def test_a_single_token_file_is_cut_into_two_units_so_one_can_be_held_out(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 100)
    _, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=1000)
    assert [(u.name, u.count, u.heldout) for u in units] == [("t.bin@0+50", 50, False), ("t.bin@50+50", 50, True)]
    _, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=1000, minimum_units=4)
    assert [u.name for u in units] == ["t.bin@0+25", "t.bin@25+25", "t.bin@50+25", "t.bin@75+25"]


# --- unreadable units ---------------------------------------------------------------------------


@pytest.fixture
def token_corpus(tmp_path: Path) -> tuple[CorpusFormat, str, list[Unit]]:
    write_tokens(tmp_path / "t.bin", 1000)
    root, units, _ = index_token_files(str(tmp_path / "t.bin"), dtype="uint16", unit_tokens=128,
                                       heldout_fraction=NEVER)
    return CorpusFormat("tokens", is_text=False, dtype="uint16", vocab_size=1000), root, units


def test_a_deleted_token_file_is_a_unit_error_naming_the_unit(token_corpus, tmp_path: Path) -> None:
    fmt, root, units = token_corpus
    os.remove(tmp_path / "t.bin")
    with pytest.raises(UnitError) as exc:
        read_unit(fmt, root, units[0])
    assert "'t.bin@0'" in one_line(exc)


def test_a_token_file_truncated_after_indexing_is_a_unit_error_for_the_units_past_its_end(token_corpus, tmp_path: Path) -> None:
    fmt, root, units = token_corpus
    os.truncate(tmp_path / "t.bin", 2 * 300)  # 300 tokens left: units @0 and @128 whole, @256 cut
    assert len(read_unit(fmt, root, units[1])) == 128
    for u in units[2:5]:
        with pytest.raises(UnitError) as exc:
            read_unit(fmt, root, u, heldout=bool(u.heldout))
        assert repr(u.name) in one_line(exc)
    os.truncate(tmp_path / "t.bin", 2 * 300 + 1)  # half an id at the end
    with pytest.raises(UnitError, match="t.bin@256"):
        read_unit(fmt, root, units[2])


def test_token_ids_past_the_vocabulary_are_a_unit_error(token_corpus) -> None:
    fmt, root, units = token_corpus
    small = CorpusFormat("tokens", is_text=False, dtype="uint16", vocab_size=200)
    assert len(read_unit(small, root, units[0])) == 128  # ids 0..127 fit
    with pytest.raises(UnitError) as exc:
        read_unit(small, root, units[1])  # ids 128..255
    message = one_line(exc)
    assert "'t.bin@128'" in message and "255" in message and "vocab_size=200" in message


def test_a_deleted_or_corrupt_parquet_file_is_a_unit_error(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 30, row_group_size=10)
    write_parquet(tmp_path / "b.parquet", 30, row_group_size=10)
    root, units, _ = index_parquet(str(tmp_path), column="text", is_text=True)
    fmt = CorpusFormat("parquet", column="text", is_text=True)
    (tmp_path / "a.parquet").write_bytes(b"this is not a parquet file at all")
    os.remove(tmp_path / "b.parquet")
    for u in (units[1], units[4]):
        with pytest.raises(UnitError) as exc:
            read_unit(fmt, root, u)
        assert repr(u.name) in one_line(exc)


def test_parquet_token_ids_past_the_vocabulary_are_a_unit_error(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 30, row_group_size=10)  # ids 0..89
    root, units, _ = index_parquet(str(tmp_path), column="tokens", is_text=False)
    fmt = CorpusFormat("parquet", column="tokens", is_text=False, vocab_size=60, heldout_fraction=NEVER)
    assert len(read_unit(fmt, root, units[1])) == 30  # ids 30..59
    with pytest.raises(UnitError, match="a.parquet#2"):
        read_unit(fmt, root, units[2])


# --- errors in the index ------------------------------------------------------------------------


def assert_data_error(call, *words: str) -> None:
    with pytest.raises(DataError) as exc:
        call()
    assert not isinstance(exc.value, UnitError)
    message = one_line(exc)
    for word in words:
        assert word in message, message


def test_a_missing_path_is_a_data_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert_data_error(lambda: index_parquet(missing, column="text", is_text=True), "does not exist")
    assert_data_error(lambda: index_token_files(missing, dtype="uint16", unit_tokens=10), "does not exist")


def test_a_directory_without_data_files_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no data here")
    (tmp_path / "_tmp.parquet").write_bytes(b"")  # job droppings are not data files either
    assert_data_error(lambda: index_parquet(str(tmp_path), column="text", is_text=True), "has no")
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="uint16", unit_tokens=10), "has no")


def test_a_token_file_that_is_not_whole_ids_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(bytes(range(7)))
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="uint16", unit_tokens=10), "7 bytes", "uint16")
    (tmp_path / "t.bin").write_bytes(bytes(range(10)))
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="uint32", unit_tokens=10), "10 bytes", "uint32")
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="int8", unit_tokens=10), "int8")


def test_a_token_corpus_too_small_to_hold_out_a_unit_is_a_data_error(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 1)
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="uint16", unit_tokens=10), "held out")
    (tmp_path / "t.bin").write_bytes(b"")
    assert_data_error(lambda: index_token_files(str(tmp_path), dtype="uint16", unit_tokens=10), "empty")


def test_a_missing_or_mistyped_column_is_a_data_error(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 10, row_group_size=5)
    assert_data_error(lambda: index_parquet(str(tmp_path), column="body", is_text=True), "'body'", "text", "tokens")
    assert_data_error(lambda: index_parquet(str(tmp_path), column="tokens", is_text=True), "'tokens'", "string")


# --- the held-out sample ------------------------------------------------------------------------


def test_heldout_sample_reads_at_most_max_tokens_of_the_heldout_units(tmp_path: Path) -> None:
    ids = write_tokens(tmp_path / "t.bin", 3000)
    root, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=100, heldout_fraction=0.2)
    index = CorpusIndex(CorpusFormat("tokens", is_text=False, dtype="uint16"), root, tuple(units), "t")
    held = np.concatenate([ids[u.start:u.start + u.count] for u in units if u.heldout])
    assert len(held) > 150
    assert np.array_equal(heldout_sample(index, max_tokens=150), held[:150])
    assert np.array_equal(heldout_sample(index, max_tokens=10**6), held)


def test_heldout_sample_of_parquet_reads_only_heldout_rows(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", 60, row_group_size=16)
    root, units, _ = index_parquet(str(tmp_path), column="tokens", is_text=False)
    fmt = CorpusFormat("parquet", column="tokens", is_text=False, heldout_fraction=0.3)
    index = CorpusIndex(fmt, root, tuple(units), "p")
    train_rows = set().union(*read_rows(fmt, root, units, heldout=False))
    sample = heldout_sample(index, max_tokens=12)
    assert len(sample) == 12 and not token_rows(sample) & train_rows
    everything = heldout_sample(index, max_tokens=10**6)
    assert token_rows(everything) == set(range(60)) - train_rows


def test_heldout_sample_without_a_readable_heldout_unit_is_a_data_error(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", 500)
    root, units, _ = index_token_files(str(tmp_path), dtype="uint16", unit_tokens=100, heldout_fraction=NEVER)
    index = CorpusIndex(CorpusFormat("tokens", is_text=False, dtype="uint16"), root, tuple(units), "t")
    os.truncate(tmp_path / "t.bin", 2 * 450)  # the held-out unit @400 is cut short
    assert_data_error(lambda: heldout_sample(index, max_tokens=50), "no held-out tokens", "t.bin@400")


# --- the standard library -----------------------------------------------------------------------

STDLIB_CAP = 200_000


def test_stdlib_units_are_training_files_then_heldout_files_flagged_by_the_file_rule() -> None:
    root, units, files = index_stdlib(heldout_fraction=0.05, max_bytes=STDLIB_CAP)
    assert root == sysconfig.get_paths()["stdlib"] and files == len(units)
    flags = [u.heldout for u in units]
    first_held = flags.index(True)
    assert not any(flags[:first_held]) and all(flags[first_held:])
    for u in units:
        assert u.name.endswith(".py") and u.path == u.name and u.start == 0
        assert (zlib.crc32(u.name.encode()) / 2**32 < 0.05) == u.heldout, u.name
        assert u.tokens == u.count + 1  # its bytes and the separator
    # Files are kept until their bytes and separators reach the cap; the last one is cut to end at it.
    assert STDLIB_CAP <= sum(u.count + 1 for u in units[:first_held]) <= STDLIB_CAP + 1
    heldout_cap = max(math.ceil(STDLIB_CAP * 0.05 / 0.95), 64 * 1024)
    assert heldout_cap <= sum(u.count + 1 for u in units[first_held:]) <= heldout_cap + 1


def test_stdlib_training_units_read_as_the_byte_corpus(tmp_path: Path) -> None:
    root, units, _ = index_stdlib(heldout_fraction=0.05, max_bytes=STDLIB_CAP)
    fmt = CorpusFormat("stdlib", is_text=True, heldout_fraction=0.05)
    first = read_unit(fmt, root, units[0])
    assert first.tobytes() == Path(root, units[0].path).read_bytes()[:units[0].count] + b"\n"
    assert len(read_unit(fmt, root, units[0], heldout=True)) == 0
    stream = b"".join(read_unit(fmt, root, u).tobytes() for u in units if not u.heldout)
    assert stream[:STDLIB_CAP] == load_stdlib_corpus(heldout_fraction=0.05, max_bytes=STDLIB_CAP).train.tobytes()


def test_stdlib_training_files_are_halved_until_there_are_minimum_units() -> None:
    _, units, files = index_stdlib(heldout_fraction=0.05, max_bytes=20_000, minimum_units=40)
    train = [u for u in units if not u.heldout]
    assert len(train) >= 40 and files < len(units)
    assert len({u.name for u in units}) == len(units)
    assert sum(u.count for u in train) <= 20_000
