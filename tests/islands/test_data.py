"""Tests for islands.data: corpora from the stdlib and real Parquet/Arrow files, shards, baselines."""

import math
import platform
import sysconfig
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from islands.data import (
    Corpus,
    DataError,
    ShardSampler,
    heldout_batches,
    load_parquet_corpus,
    load_stdlib_corpus,
    stdlib_corpus_files,
    unigram_bits_per_byte,
)

CAP = 300_000  # train bytes for stdlib tests: enough to exercise the cap, fast to read


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


# --- stdlib corpus -----------------------------------------------------------------------------


def test_stdlib_files_are_sorted_stdlib_sources_without_site_packages() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_corpus_files()
    relative = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100
    assert relative == sorted(relative)
    assert all(r.endswith(".py") for r in relative)
    assert not any("site-packages" in r or "dist-packages" in r for r in relative)
    assert "os.py" in relative and "json/__init__.py" in relative


@pytest.mark.parametrize("shuffle", [True, False])
def test_stdlib_corpus_matches_the_file_split_rule_and_is_deterministic(shuffle: bool) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    corpus = load_stdlib_corpus(heldout_fraction=0.05, max_bytes=CAP, shuffle_documents=shuffle)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    assert platform.python_version() in corpus.source and "standard library" in corpus.source
    assert ("files shuffled" if shuffle else "files sorted") in corpus.source
    # Independent reconstruction: a file is held out iff crc32(relative path)/2**32 < fraction;
    # shuffled order sorts each split by crc32(b"document-order\0" + path), then by path.
    train_files, heldout_files = [], []
    for f in stdlib_corpus_files():
        held = zlib.crc32(f.relative_to(root).as_posix().encode()) / 2**32 < 0.05
        (heldout_files if held else train_files).append(f)
    if shuffle:
        def key(f: Path) -> tuple[int, str]:
            rel = f.relative_to(root).as_posix()
            return zlib.crc32(b"document-order\0" + rel.encode()), rel
        train_files, heldout_files = sorted(train_files, key=key), sorted(heldout_files, key=key)
    assert heldout_files and not set(heldout_files) & set(train_files)
    train_text = b"\n".join(f.read_bytes() for f in train_files[:200])[:CAP]
    heldout_cap = max(math.ceil(CAP * 0.05 / 0.95), 64 * 1024)
    heldout_text = b"\n".join(f.read_bytes() for f in heldout_files)[:heldout_cap]
    assert len(train_text) == CAP and corpus.train.tobytes() == train_text
    assert corpus.heldout.tobytes() == heldout_text
    again = load_stdlib_corpus(heldout_fraction=0.05, max_bytes=CAP, shuffle_documents=shuffle)
    assert np.array_equal(again.train, corpus.train)
    assert np.array_equal(again.heldout, corpus.heldout)


def _bigram_tv(part: np.ndarray, whole: np.ndarray) -> float:
    """Total variation distance between the byte-bigram distributions of two byte arrays."""
    def dist(a: np.ndarray) -> np.ndarray:
        pairs = a[:-1].astype(np.int64) * 256 + a[1:]
        return np.bincount(pairs, minlength=65536) / len(pairs)
    return 0.5 * float(np.abs(dist(part) - dist(whole)).sum())


def test_shuffled_documents_make_every_shard_look_like_the_whole_corpus() -> None:
    # In sorted order the stdlib's quarters differ (encodings/ and idlelib/ in one, test/ in two);
    # shuffled, each island's shard should be a representative sample of the training text.
    worst = {}
    for shuffle in (True, False):
        train = load_stdlib_corpus(shuffle_documents=shuffle).train
        n = len(train)
        worst[shuffle] = max(_bigram_tv(train[i * n // 4 : (i + 1) * n // 4], train) for i in range(4))
    assert worst[True] < 0.6 * worst[False], worst


def test_full_stdlib_corpus_is_large_and_beats_nothing_trivially() -> None:
    corpus = load_stdlib_corpus()
    assert len(corpus.train) > 5_000_000 and len(corpus.heldout) > 64 * 1024
    # Source code is far from uniform bytes.
    assert unigram_bits_per_byte(corpus.train, corpus.heldout) < 6.0


def test_stdlib_corpus_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"heldout_fraction=1\.5 must be in \(0, 1\)"):
        load_stdlib_corpus(heldout_fraction=1.5)
    with pytest.raises(ValueError, match="max_bytes=0 must be a positive int"):
        load_stdlib_corpus(max_bytes=0)


# --- Parquet / Arrow corpora -------------------------------------------------------------------


def text_rows(n: int) -> list[str]:
    return [f"row {i:04d} says héllo" for i in range(n)]


def write_parquet(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_text_rows_split_disjointly_and_deterministically(tmp_path: Path) -> None:
    rows = text_rows(300)
    path = write_parquet(tmp_path / "text.parquet", text=rows, n=list(range(300)))
    corpus = load_parquet_corpus(str(path), text_column="text", heldout_fraction=0.2)
    assert corpus.vocab_size == 256 and corpus.train.dtype == np.uint8
    train_rows = corpus.train.tobytes().decode("utf-8").split("\n")
    heldout_rows = corpus.heldout.tobytes().decode("utf-8").split("\n")
    assert not set(train_rows) & set(heldout_rows)
    assert sorted(train_rows + heldout_rows) == sorted(rows)
    assert 20 <= len(heldout_rows) <= 100  # about 20% of 300
    # Shuffled by default: a fixed permutation of the rows, not the file's order.
    assert train_rows != [r for r in rows if r in set(train_rows)] and "rows shuffled" in corpus.source
    again = load_parquet_corpus(str(path), text_column="text", heldout_fraction=0.2)
    assert np.array_equal(again.train, corpus.train)
    assert "300 rows" in corpus.source
    kept = load_parquet_corpus(str(path), text_column="text", heldout_fraction=0.2, shuffle_documents=False)
    kept_rows = kept.train.tobytes().decode("utf-8").split("\n")
    assert kept_rows == [r for r in rows if r in set(train_rows)]  # same split, file order kept
    assert "rows in file order" in kept.source


def test_parquet_directory_and_file_uri_read_files_in_sorted_order(tmp_path: Path) -> None:
    rows = text_rows(200)
    write_parquet(tmp_path / "all.parquet", text=rows)
    (tmp_path / "dir").mkdir()
    write_parquet(tmp_path / "dir" / "part-1.parquet", text=rows[100:])
    write_parquet(tmp_path / "dir" / "part-0.parquet", text=rows[:100])
    (tmp_path / "dir" / "_SUCCESS").write_text("")
    whole = load_parquet_corpus(str(tmp_path / "all.parquet"), text_column="text")
    split = load_parquet_corpus((tmp_path / "dir").as_uri(), text_column="text")
    assert split.source.startswith("file://")
    assert np.array_equal(whole.train, split.train)
    assert np.array_equal(whole.heldout, split.heldout)


def test_arrow_stream_files_are_read(tmp_path: Path) -> None:
    rows = text_rows(100)
    table = pa.table({"text": rows})
    with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink:  # the Hugging Face cache format
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    corpus = load_parquet_corpus(str(tmp_path), text_column="text", heldout_fraction=0.1)
    combined = corpus.train.tobytes().decode() + "\n" + corpus.heldout.tobytes().decode()
    assert sorted(combined.split("\n")) == rows


def test_parquet_token_ids_keep_rows_whole(tmp_path: Path) -> None:
    rows = [[i, i + 1, i + 2, 999] for i in range(0, 600, 3)]
    path = write_parquet(tmp_path / "tokens.parquet", ids=pa.array(rows, pa.list_(pa.int32())))
    corpus = load_parquet_corpus(str(path), token_column="ids", vocab_size=1000,
                                 heldout_fraction=0.2)
    assert corpus.vocab_size == 1000 and corpus.train.dtype == np.int32
    # 999 ends every row, so splitting on it recovers whole rows.
    def split_rows(a: np.ndarray) -> list[tuple[int, ...]]:
        ends = np.flatnonzero(a == 999)
        return [tuple(a[s + 1 if s >= 0 else 0 : e + 1]) for s, e in zip(np.r_[-1, ends[:-1]], ends)]
    train_rows, heldout_rows = split_rows(corpus.train), split_rows(corpus.heldout)
    assert heldout_rows and not set(train_rows) & set(heldout_rows)
    assert sorted(train_rows + heldout_rows) == sorted(tuple(r) for r in rows)


def test_parquet_error_paths_say_what_and_how_to_fix(tmp_path: Path) -> None:
    text = write_parquet(tmp_path / "text.parquet", text=text_rows(50), n=list(range(50)))
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(tmp_path / "missing.parquet"), text_column="text")
    assert "missing.parquet' does not exist" in one_line(exc)
    empty = write_parquet(tmp_path / "empty.parquet", text=pa.array([], pa.string()))
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(empty), text_column="text")
    assert "has no rows" in one_line(exc)
    (tmp_path / "nodata").mkdir()
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(tmp_path / "nodata"), text_column="text")
    assert "has no .parquet" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text), text_column="body")
    assert "column 'body' not found" in one_line(exc) and "['text', 'n']" in str(exc.value)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text), text_column="n")
    assert "'n'" in one_line(exc) and "has type int64, not string" in str(exc.value)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text), token_column="text")
    assert "has type string, not list<int>" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text))
    assert "pass exactly one of them" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text), text_column="text", token_column="n")
    assert "pass exactly one of them" in one_line(exc)
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(text), text_column="text", seq_len=100_000)
    assert "fewer than seq_len+1=100001" in one_line(exc)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(tmp_path / "junk.parquet"), text_column="text")
    assert "cannot read" in one_line(exc) and "fix or remove" in str(exc.value)
    (tmp_path / "mixed").mkdir()
    write_parquet(tmp_path / "mixed" / "a.parquet", text=text_rows(10))
    write_parquet(tmp_path / "mixed" / "b.parquet", text=list(range(10)))
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(tmp_path / "mixed"), text_column="text")
    assert "with one schema" in one_line(exc)
    ids = write_parquet(tmp_path / "ids.parquet", ids=[[1, 2, 3]] * 20 + [[5, 300]])
    with pytest.raises(DataError) as exc:
        load_parquet_corpus(str(ids), token_column="ids", vocab_size=256)
    assert "max id 300" in one_line(exc) and "vocab_size=256" in str(exc.value)


# --- Shards and held-out batches ---------------------------------------------------------------


def positions_sampler(n: int, shard_index: int, num_shards: int, **kwargs) -> ShardSampler:
    """A sampler over data[i] == i, so every token tells where it came from."""
    args = dict(seq_len=16, batch_size=8, seed=0) | kwargs
    return ShardSampler(np.arange(n, dtype=np.int32), shard_index=shard_index,
                        num_shards=num_shards, **args)


def test_shards_are_disjoint_and_windows_stay_inside_their_shard() -> None:
    n, num_shards = 10_003, 4
    seen: list[set[int]] = []
    for i in range(num_shards):
        sampler = positions_sampler(n, i, num_shards)
        assert (sampler.start, sampler.stop) == (i * n // num_shards, (i + 1) * n // num_shards)
        positions: set[int] = set()
        for _ in range(30):
            x, y = sampler.next_batch()
            assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
            assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
            assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))  # contiguous windows
            assert x.min() >= sampler.start and y.max() < sampler.stop
            positions |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        seen.append(positions)
        assert sampler.cursor == 30 and sampler.tokens_per_batch == 8 * 16
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not seen[i] & seen[j]


def test_every_window_offset_is_reachable_including_the_last() -> None:
    # Shard 1 of 2 over 40 tokens is [20, 40): with seq_len 16 the offsets 20..23 are all legal.
    sampler = positions_sampler(40, 1, 2, batch_size=64)
    x, y = sampler.next_batch()
    assert set(x[:, 0].tolist()) == {20, 21, 22, 23}
    assert y.max().item() == 39


def test_restoring_the_cursor_replays_the_same_batches() -> None:
    first = positions_sampler(50_000, 2, 3, seed=5)
    batches, state = [], None
    for c in range(7):
        if c == 3:
            state = first.state_dict()
        batches.append(first.next_batch())
    assert len({tuple(x[:, 0].tolist()) for x, _ in batches}) == 7  # every batch is new
    resumed = positions_sampler(50_000, 2, 3, seed=5)
    resumed.load_state_dict(state)
    assert resumed.cursor == 3
    for c in range(3, 7):
        x, y = resumed.next_batch()
        assert torch.equal(x, batches[c][0]) and torch.equal(y, batches[c][1])
        assert torch.equal(first.batch_at(c)[0], x)
    other_seed = positions_sampler(50_000, 2, 3, seed=6)
    assert not torch.equal(other_seed.next_batch()[0], batches[0][0])


def test_state_from_another_shard_is_refused() -> None:
    state = positions_sampler(1000, 0, 2).state_dict()
    with pytest.raises(ValueError, match="state is for shard 0 of 2 but this is shard 1 of 2"):
        positions_sampler(1000, 1, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="cursor=-1 must be a non-negative int"):
        positions_sampler(1000, 0, 2).load_state_dict(state | {"cursor": -1})


def test_too_short_shard_says_how_long_it_is_and_what_to_do() -> None:
    with pytest.raises(DataError) as exc:
        positions_sampler(100, 0, 10, seq_len=16)
    message = one_line(exc)
    assert "shard 0 of 10 has 10 tokens" in message and "fewer shards" in message
    with pytest.raises(ValueError, match=r"shard_index=3 must be in \[0, num_shards=3\)"):
        positions_sampler(100, 3, 3)


def test_heldout_batches_are_fixed_and_evenly_spaced() -> None:
    heldout = np.arange(1000, dtype=np.int32)
    batches = heldout_batches(heldout, seq_len=10, batch_size=4, num_batches=5)
    assert len(batches) == 5 and all(x.shape == y.shape == (4, 10) for x, y in batches)
    starts = np.concatenate([x[:, 0].numpy() for x, _ in batches])
    assert starts[0] == 0 and batches[-1][1][-1, -1].item() == 999  # spans the whole split
    # 20 windows over offsets 0..989 (the last that fits): steps of 989/19 = 52.05, rounded.
    assert set(np.diff(starts).tolist()) <= {52, 53}
    again = heldout_batches(heldout, seq_len=10, batch_size=4, num_batches=5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    with pytest.raises(DataError, match="held-out data has 5 tokens, fewer than seq_len"):
        heldout_batches(heldout[:5], seq_len=10, batch_size=1, num_batches=1)


# --- Unigram baseline --------------------------------------------------------------------------


def reference_unigram_bits(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    counts = Counter(train.tolist())
    total = len(train) + vocab_size
    return -sum(math.log2((counts[t] + 1) / total) for t in heldout.tolist()) / len(heldout)


def test_unigram_baseline_is_8_bits_on_uniform_bytes_and_lower_on_skewed_data() -> None:
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 256, size=400_000).astype(np.uint8)
    assert unigram_bits_per_byte(uniform[:300_000], uniform[300_000:]) == pytest.approx(8.0, abs=0.01)
    skewed = rng.choice(256, size=20_000, p=np.r_[0.5, np.full(255, 0.5 / 255)]).astype(np.uint8)
    bits = unigram_bits_per_byte(skewed[:15_000], skewed[15_000:])
    assert bits == pytest.approx(reference_unigram_bits(skewed[:15_000], skewed[15_000:], 256),
                                 rel=1e-12)
    assert bits < 7.5
    tokens = rng.integers(0, 10, size=500)
    assert unigram_bits_per_byte(tokens[:400], tokens[400:], vocab_size=10) == pytest.approx(
        reference_unigram_bits(tokens[:400], tokens[400:], 10), rel=1e-12)
    with pytest.raises(DataError, match=r"outside \[0, vocab_size=5\)"):
        unigram_bits_per_byte(tokens, tokens, vocab_size=5)


def test_corpus_rejects_non_1d_arrays() -> None:
    with pytest.raises(DataError, match=r"Corpus.train has shape \(2, 2\)"):
        Corpus(train=np.zeros((2, 2), np.uint8), heldout=np.zeros(4, np.uint8), vocab_size=256,
               source="test")
