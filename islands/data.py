"""Training data for islands: corpora, disjoint shards with resumable cursors, a held-out split.

A :class:`Corpus` holds ``train`` and ``heldout`` token ids, split so that no held-out text is ever
trained on. Sources: :func:`load_stdlib_corpus`, the embedded default (the running Python's
standard-library source as bytes, split by file, no download), and :func:`load_parquet_corpus`
(user text or token ids from Parquet/Arrow files, split by row). To tokenize text with something
other than bytes, :func:`stdlib_texts` and :func:`parquet_texts` return the same splits as documents
and :func:`tokenize_corpus` encodes them with an :class:`islands.tokenizer.TextEncoder`.

Each island samples its own contiguous shard of ``train`` with a :class:`ShardSampler`; batch
``c`` depends only on ``(seed, shard_index, c)``, so a restarted island resumes at its cursor.

Both loaders put documents (files, rows) in a fixed pseudo-random order by default
(``shuffle_documents=True``), so that every contiguous shard is a representative sample of the
corpus, as a pre-training pipeline that shuffles documents before sharding gives. In source order
the stdlib's shards differ sharply (one island gets ``encodings/`` and ``idlelib/``, two get mostly
``test/``): islands then train on different distributions, which data parallel averages away every
step and DiLoCo only every H steps. ``shuffle_documents=False`` keeps that source order, for
studying such non-IID islands.
"""

from __future__ import annotations

import math
import os
import pathlib
import platform
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from islands.cursor import DataCursor
from islands.data_defaults import HELDOUT_FRACTION, SHUFFLE_DOCUMENTS

if TYPE_CHECKING:  # torch is imported where batches are built: the preflight reads schemas without it
    import torch

# Installed third-party code is not the standard library, and its size varies by machine.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
# With max_bytes set, the held-out split keeps at least this much text so evaluation is not noise.
_MIN_HELDOUT_BYTES = 64 * 1024
_PARQUET_SUFFIXES = (".parquet", ".pq")
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_STRING_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)


class DataError(ValueError):
    """A dataset is missing, empty or malformed; the message names the path/column and the fix."""


@dataclass
class Corpus:
    """A tokenized corpus split into training and held-out token ids."""

    train: np.ndarray
    """1-D token ids to train on (uint8 for byte text, int32 for token-id corpora)."""
    heldout: np.ndarray
    """1-D token ids for evaluation only, never trained on; same dtype as ``train``."""
    vocab_size: int
    """Every id is in ``[0, vocab_size)``; 256 for byte text."""
    source: str
    """Human description of where the data came from, for logs and reports."""

    def __post_init__(self) -> None:
        for name, array in (("train", self.train), ("heldout", self.heldout)):
            if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
                raise DataError(f"Corpus.{name} has shape {array.shape}, dtype {array.dtype}; "
                                f"it must be a 1-D integer array of token ids")


def stdlib_corpus_files() -> list[pathlib.Path]:
    """The stdlib's ``*.py`` files, without site-/dist-packages, sorted by relative posix path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for filename in filenames:
            if filename.endswith(".py"):
                path = pathlib.Path(dirpath, filename)
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def _is_heldout_file(relative_posix: str, heldout_fraction: float) -> bool:
    # crc32 of the path, not hash(): stable across processes and Python versions.
    return zlib.crc32(relative_posix.encode("utf-8")) / 2**32 < heldout_fraction


# Salt for the document order, so the order does not correlate with the held-out rule's hash.
_ORDER_SALT = b"document-order\0"


def _file_order_key(relative_posix: str) -> tuple[int, str]:
    """Sort key of the shuffled file order: a salted crc32 of the path, ties broken by the path."""
    return zlib.crc32(_ORDER_SALT + relative_posix.encode("utf-8")), relative_posix


def _read_files(paths: list[pathlib.Path], cap: int | None) -> list[bytes]:
    """The files' bytes, in order, until their b"\\n"-joined size reaches ``cap`` (if given).

    Whole files are read: the last one may run past the cap (the byte loader truncates the join).
    """
    parts: list[bytes] = []
    total = 0  # bytes joined so far, separators included
    for path in paths:
        if cap is not None and total >= cap:
            break
        data = path.read_bytes()
        parts.append(data)
        total += len(data) + 1
    return parts


def _join_files(paths: list[pathlib.Path], cap: int | None) -> tuple[np.ndarray, int]:
    """Join files with b"\\n" up to ``cap`` bytes (if given); return (uint8 array, files read)."""
    parts = _read_files(paths, cap)
    joined = bytearray(b"\n").join(parts)  # bytearray, so the numpy view is writable
    if cap is not None:
        del joined[cap:]
    return np.frombuffer(joined, dtype=np.uint8), len(parts)


def _stdlib_split(heldout_fraction: float, max_bytes: int | None,
                  shuffle_documents: bool) -> tuple[list[pathlib.Path], list[pathlib.Path], int | None]:
    """Check the arguments; return (train files, held-out files, held-out byte cap), each split in
    corpus order. The one split rule of :func:`load_stdlib_corpus` and :func:`stdlib_texts`."""
    _check_fraction(heldout_fraction)
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive int or None (no cap)")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_corpus_files()
    if not files:
        raise DataError(f"no *.py files under the stdlib at {root}; this Python ships no source, "
                        f"so load a dataset with load_parquet_corpus instead")
    train_files: list[pathlib.Path] = []
    heldout_files: list[pathlib.Path] = []
    for path in files:
        is_heldout = _is_heldout_file(path.relative_to(root).as_posix(), heldout_fraction)
        (heldout_files if is_heldout else train_files).append(path)
    if shuffle_documents:
        for split in (train_files, heldout_files):
            split.sort(key=lambda path: _file_order_key(path.relative_to(root).as_posix()))
    heldout_cap = None
    if max_bytes is not None:
        proportional = math.ceil(max_bytes * heldout_fraction / (1 - heldout_fraction))
        heldout_cap = max(proportional, _MIN_HELDOUT_BYTES)
    return train_files, heldout_files, heldout_cap


def _stdlib_source(n_train: int, n_heldout: int, n_bytes: int, shuffle_documents: bool) -> str:
    order = "shuffled" if shuffle_documents else "sorted"
    return (f"Python {platform.python_version()} standard library source "
            f"({n_train + n_heldout} files, {n_bytes / 1e6:.1f} MB; {n_heldout} files held out; "
            f"files {order})")


def _empty_split_error(n_train: int, n_heldout: int, heldout_fraction: float) -> DataError:
    return DataError(f"stdlib split at heldout_fraction={heldout_fraction} left {n_train} "
                     f"train and {n_heldout} held-out bytes; use a fraction near 0.02")


def load_stdlib_corpus(*, heldout_fraction: float = HELDOUT_FRACTION, max_bytes: int | None = None,
                       shuffle_documents: bool = SHUFFLE_DOCUMENTS) -> Corpus:
    """The running Python's standard-library source as a byte corpus (vocab 256).

    A file is held out iff ``crc32(relative path) / 2**32 < heldout_fraction``, so the split is the
    same on every machine with the same Python and held-out text is never trained on. Each split's
    files are joined with b"\\n", ordered by a salted crc32 of their path if ``shuffle_documents``
    (the default: contiguous shards are then representative samples), else sorted by path.
    ``max_bytes`` caps ``train`` (files are read in that order until the cap) and ``heldout`` in
    proportion, keeping at least 64 KiB of held-out text if available.
    """
    train_files, heldout_files, heldout_cap = _stdlib_split(heldout_fraction, max_bytes, shuffle_documents)
    train, n_train = _join_files(train_files, max_bytes)
    heldout, n_heldout = _join_files(heldout_files, heldout_cap)
    if len(train) == 0 or len(heldout) == 0:
        raise _empty_split_error(len(train), len(heldout), heldout_fraction)
    source = _stdlib_source(n_train, n_heldout, len(train) + len(heldout), shuffle_documents)
    return Corpus(train=train, heldout=heldout, vocab_size=256, source=source)


def stdlib_texts(*, heldout_fraction: float = HELDOUT_FRACTION, max_bytes: int | None = None,
                 shuffle_documents: bool = SHUFFLE_DOCUMENTS) -> tuple[list[str], list[str], str]:
    """The stdlib's files as text documents: ``(train_docs, heldout_docs, source)``.

    The same files, split and order as :func:`load_stdlib_corpus` (one document per file), for
    :func:`tokenize_corpus`. Files are decoded as UTF-8 with ``errors="replace"`` (a few stdlib
    test files are Latin-1 or deliberately invalid). ``max_bytes`` caps the text read per split
    as there, except that whole files are kept: the last file read may run past the cap.
    """
    train_files, heldout_files, heldout_cap = _stdlib_split(heldout_fraction, max_bytes, shuffle_documents)
    train_bytes = _read_files(train_files, max_bytes)
    heldout_bytes = _read_files(heldout_files, heldout_cap)
    n_train, n_heldout = (sum(map(len, parts)) for parts in (train_bytes, heldout_bytes))
    if n_train == 0 or n_heldout == 0:
        raise _empty_split_error(n_train, n_heldout, heldout_fraction)
    source = _stdlib_source(len(train_bytes), len(heldout_bytes), n_train + n_heldout, shuffle_documents)
    train_docs = [data.decode("utf-8", errors="replace") for data in train_bytes]
    heldout_docs = [data.decode("utf-8", errors="replace") for data in heldout_bytes]
    return train_docs, heldout_docs, source


def _check_fraction(heldout_fraction: float) -> None:
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction!r} must be in (0, 1); pass e.g. 0.02")


def _resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and inner path for a local path or a pyarrow.fs URI ("file:///...", "s3://")."""
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, ValueError) as exc:
            raise DataError(f"cannot open dataset URI {path!r} ({exc}); check the scheme") from exc
    return pafs.LocalFileSystem(), str(pathlib.Path(path).expanduser().absolute())


def _dataset_files(fs: pafs.FileSystem, inner: str, path: str) -> list[str]:
    kind = fs.get_file_info(inner).type
    if kind == pafs.FileType.NotFound:
        raise DataError(f"dataset path {path!r} does not exist; pass a Parquet file or a "
                        f"directory of Parquet/Arrow files")
    if kind == pafs.FileType.File:
        return [inner]
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File
                   and not i.base_name.startswith((".", "_"))  # _SUCCESS, .crc: job droppings
                   and i.base_name.endswith(_PARQUET_SUFFIXES + _ARROW_SUFFIXES))
    if not files:
        suffixes = "/".join(_PARQUET_SUFFIXES + _ARROW_SUFFIXES)
        raise DataError(f"directory {path!r} has no {suffixes} files; point at the directory "
                        f"that holds the data files")
    return files


def _open_file(fs: pafs.FileSystem, file: str):
    # pyarrow.dataset pulls in pandas (~0.5 s): imported only when a user dataset is read, not in
    # every island process.
    import pyarrow.dataset as ds

    if not file.endswith(_ARROW_SUFFIXES):
        return ds.dataset(file, filesystem=fs, format="parquet")
    try:
        return ds.dataset(file, filesystem=fs, format="ipc")
    except pa.ArrowInvalid:
        # Hugging Face `datasets` caches write the IPC *stream* format, which ds cannot scan.
        with fs.open_input_stream(file) as stream:
            return ds.dataset(pa.ipc.open_stream(stream).read_all())


def _read_column(fs: pafs.FileSystem, files: list[str], column: str, path: str,
                 arg: str) -> pa.ChunkedArray:
    """One column of all ``files``, rows in file order, as a single dataset with one schema."""
    import pyarrow.dataset as ds  # lazily, as in _open_file

    try:
        parts = [_open_file(fs, file) for file in files]
        dataset = parts[0] if len(parts) == 1 else ds.dataset(parts)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise DataError(f"cannot read {path!r} as Parquet/Arrow files with one schema "
                        f"({str(exc).splitlines()[0]}); fix or remove the odd file") from exc
    if column not in dataset.schema.names:
        raise DataError(f"column {column!r} not found in {path!r}; columns are "
                        f"{dataset.schema.names}; pass {arg}= one of them")
    return dataset.to_table(columns=[column]).column(column)


def dataset_schema(path: str) -> pa.Schema:
    """The schema of the dataset at ``path`` (its first file's, as :func:`load_parquet_corpus` reads
    it), from the Parquet footer or Arrow header only: no rows are read. Raises :class:`DataError` for
    a path that does not exist, a directory without data files or a file that is not Parquet/Arrow."""
    import pyarrow.parquet as pq  # lazily, as pyarrow.dataset in _open_file

    fs, inner = _resolve(path)
    first = _dataset_files(fs, inner, path)[0]
    try:
        if not first.endswith(_ARROW_SUFFIXES):
            return pq.read_schema(first, filesystem=fs)
        try:
            return pa.ipc.open_file(fs.open_input_file(first)).schema
        except pa.ArrowInvalid:  # the IPC stream format (Hugging Face caches)
            with fs.open_input_stream(first) as stream:
                return pa.ipc.open_stream(stream).schema
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read {first!r} as a Parquet/Arrow file ({str(exc).splitlines()[0]}); "
                        f"fix or remove it") from exc


def token_id_range(path: str, column: str, *, max_files: int = 16) -> tuple[int, int] | None:
    """Smallest and largest token id of list<int> ``column`` from the Parquet row-group statistics of
    the dataset's first ``max_files`` files (footers only; no rows are read), or None when a file is
    Arrow or lacks the statistics: then only loading the data tells."""
    import pyarrow.parquet as pq

    fs, inner = _resolve(path)
    low = high = None
    for file in _dataset_files(fs, inner, path)[:max_files]:
        if file.endswith(_ARROW_SUFFIXES):
            return None
        meta = pq.read_metadata(file, filesystem=fs)
        leaves = [j for j in range(meta.num_columns) if meta.schema.column(j).path.startswith(column + ".")]
        if len(leaves) != 1:
            return None
        for g in range(meta.num_row_groups):
            chunk = meta.row_group(g).column(leaves[0])
            if chunk.num_values == 0:
                continue
            stats = chunk.statistics
            if stats is None or not stats.has_min_max:
                return None
            low = stats.min if low is None else min(low, stats.min)
            high = stats.max if high is None else max(high, stats.max)
    return None if low is None or high is None else (int(low), int(high))  # set together: high is None iff low is


def _row_hash_unit(n_rows: int, salt: int = 0) -> np.ndarray:
    """A stable pseudo-random float in [0, 1) per row index (splitmix64 finalizer).

    Each ``salt`` gives an independent-looking sequence; salt 0 is the held-out rule's.
    """
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point of the hash
        z = np.arange(n_rows, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(salt + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


def _tokens(rows: pa.ChunkedArray, name: str, is_text: bool, vocab_size: int) -> np.ndarray:
    """Text rows as UTF-8 bytes joined by b"\\n" (uint8), or token rows concatenated (int32)."""
    if is_text:
        encoded = (s.encode("utf-8") for s in rows.to_pylist() if s is not None)  # nulls skipped
        return np.frombuffer(bytearray(b"\n").join(encoded), dtype=np.uint8)
    flat = pc.list_flatten(rows)  # null rows are dropped
    if flat.null_count:
        raise DataError(f"token_column {name!r} has {flat.null_count} null ids; drop or fill them")
    ids = flat.to_numpy().astype(np.int64, copy=False)
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if low < 0 or high >= vocab_size:
        raise DataError(f"token ids in {name!r} span [{low}, {high}] (max id {high}) but must lie "
                        f"in [0, vocab_size={vocab_size}); pass vocab_size={high + 1} or fix ids")
    return ids.astype(np.int32)


def _check_column_type(kind: pa.DataType, name: str, is_text: bool, path: str) -> None:
    if is_text:
        ok = any(is_type(kind) for is_type in _STRING_TYPES)
        wanted, other = "string", "token_column for lists of token ids"
    else:
        is_list = any(is_type(kind) for is_type in _LIST_TYPES)
        ok = is_list and pa.types.is_integer(kind.value_type)
        wanted, other = "list<int>", "text_column for strings"
    if not ok:
        raise DataError(f"column {name!r} in {path!r} has type {kind}, not {wanted}; pass a "
                        f"{wanted} column, or {other}")


def load_parquet_corpus(path: str, *, text_column: str | None = None,
                        token_column: str | None = None, heldout_fraction: float = HELDOUT_FRACTION,
                        vocab_size: int = 256, seq_len: int = 1,
                        shuffle_documents: bool = SHUFFLE_DOCUMENTS) -> Corpus:
    """Load a corpus from a Parquet file, a directory of Parquet/Arrow files, or a pyarrow.fs URI.

    Give exactly one of ``text_column`` (strings, encoded UTF-8, rows joined with b"\\n"; vocab 256)
    or ``token_column`` (lists of ints in ``[0, vocab_size)``, rows concatenated as they are, so put
    your own end-of-document id in each row). Row ``i`` is held out iff a stable hash of ``i`` falls
    under ``heldout_fraction``; directory files are read in sorted path order. With
    ``shuffle_documents`` (the default) each split's rows are then put in a fixed pseudo-random
    order (a second, salted hash of the row index), so contiguous shards are representative samples;
    without it rows keep the dataset's order. Each split must hold at least one window of
    ``seq_len + 1`` tokens, else :class:`DataError`.
    """
    _check_fraction(heldout_fraction)
    if (text_column is None) == (token_column is None):
        raise DataError(f"got text_column={text_column!r} and token_column={token_column!r}; "
                        f"pass exactly one of them")
    is_text = text_column is not None
    if is_text and vocab_size != 256:
        raise DataError(f"vocab_size={vocab_size} with text_column={text_column!r}; text is "
                        f"encoded as bytes, so leave vocab_size=256")
    if not 0 < vocab_size <= 2**31 - 1:
        raise DataError(f"vocab_size={vocab_size} must be in [1, 2**31 - 1] to fit int32 ids")
    name = text_column if is_text else token_column
    assert name is not None  # exactly one of the two columns was given (checked above)
    train_rows, heldout_rows, n_rows = _parquet_split(path, name, is_text, heldout_fraction, shuffle_documents)
    train = _tokens(train_rows, name, is_text, vocab_size)
    heldout = _tokens(heldout_rows, name, is_text, vocab_size)
    for split, tokens in (("train", train), ("held-out", heldout)):
        if len(tokens) < seq_len + 1:
            raise DataError(f"{split} split of {path!r} has {len(tokens)} tokens from "
                            f"{n_rows} rows at heldout_fraction={heldout_fraction}, fewer "
                            f"than seq_len+1={seq_len + 1}; add rows, change heldout_fraction "
                            f"or seq_len")
    megabytes = (train.nbytes + heldout.nbytes) / 1e6
    order = "shuffled" if shuffle_documents else "in file order"
    source = f"{path} column {name!r} ({n_rows} rows, {megabytes:.1f} MB; rows {order})"
    return Corpus(train=train, heldout=heldout, vocab_size=vocab_size, source=source)


def _parquet_split(path: str, name: str, is_text: bool, heldout_fraction: float,
                   shuffle_documents: bool) -> tuple[pa.ChunkedArray, pa.ChunkedArray, int]:
    """Column ``name`` of the dataset split into (train rows, held-out rows, rows in all), each split
    in corpus order. The one split rule of :func:`load_parquet_corpus` and :func:`parquet_texts`."""
    fs, inner = _resolve(path)
    column = _read_column(fs, _dataset_files(fs, inner, path), name, path,
                          "text_column" if is_text else "token_column")
    if len(column) == 0:
        raise DataError(f"dataset {path!r} has no rows; point at a non-empty dataset")
    _check_column_type(column.type, name, is_text, path)
    is_heldout = pa.array(_row_hash_unit(len(column)) < heldout_fraction)
    if shuffle_documents:
        order = pa.array(np.argsort(_row_hash_unit(len(column), salt=1), kind="stable"))
        column, is_heldout = column.take(order), is_heldout.take(order)
    return column.filter(pc.invert(is_heldout)), column.filter(is_heldout), len(column)


def parquet_texts(path: str, *, text_column: str, heldout_fraction: float = HELDOUT_FRACTION,
                  shuffle_documents: bool = SHUFFLE_DOCUMENTS) -> tuple[list[str], list[str], str]:
    """The rows of string ``text_column`` as documents: ``(train_docs, heldout_docs, source)``.

    The same held-out rule and row order as :func:`load_parquet_corpus` with ``text_column``, for
    :func:`tokenize_corpus`; null rows are skipped, as there.
    """
    _check_fraction(heldout_fraction)
    train_rows, heldout_rows, n_rows = _parquet_split(path, text_column, True, heldout_fraction, shuffle_documents)
    train_docs = [text for text in train_rows.to_pylist() if text is not None]
    heldout_docs = [text for text in heldout_rows.to_pylist() if text is not None]
    if not train_docs or not heldout_docs:
        raise DataError(f"{path!r} split at heldout_fraction={heldout_fraction} left {len(train_docs)} "
                        f"train and {len(heldout_docs)} held-out rows of {n_rows}; add rows or change "
                        f"heldout_fraction")
    n_bytes = sum(len(text.encode("utf-8")) for text in train_docs + heldout_docs)
    order = "shuffled" if shuffle_documents else "in file order"
    source = f"{path} column {text_column!r} ({n_rows} rows, {n_bytes / 1e6:.1f} MB; rows {order})"
    return train_docs, heldout_docs, source


def tokenize_corpus(train_docs: Sequence[str], heldout_docs: Sequence[str], encoder: Any,
                    source: str, *, seq_len: int = 1) -> Corpus:
    """Encode each split's documents with ``encoder`` (an islands.tokenizer.TextEncoder) into a :class:`Corpus`.

    ``encoder`` is typed loosely: islands.tokenizer imports this module (DataError), and this one
    must not import it back (tests/test_layout.py refuses import circles).

    Each split's ids are joined with ``encoder.eos_id`` between documents, in the given order (pass
    the output of :func:`stdlib_texts` or :func:`parquet_texts`); ``vocab_size`` is the encoder's and
    ids are uint8 for a vocabulary of at most 256, else int32. With the byte encoder this is the byte
    corpus (documents joined by b"\\n"). Each split must hold at least ``seq_len + 1`` tokens, and
    ids outside ``[0, vocab_size)`` (from a user function) raise :class:`DataError`.
    """
    vocab_size = encoder.vocab_size
    dtype = np.uint8 if vocab_size <= 256 else np.int32
    splits = {}
    for split, docs in (("train", train_docs), ("held-out", heldout_docs)):
        if isinstance(docs, str):
            raise DataError(f"{split} documents are one string; pass a list of documents, e.g. [text]")
        ids = encoder.encode_documents(docs)
        if len(ids) < seq_len + 1:
            raise DataError(f"{split} split has {len(ids)} tokens from {len(docs)} documents, fewer than "
                            f"seq_len+1={seq_len + 1}; add documents or change heldout_fraction or seq_len")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            raise DataError(f"{encoder.name} gave ids in [{low}, {high}] but vocab_size={vocab_size}; "
                            f"return ids in [0, {vocab_size}) or pass vocab_size={high + 1}")
        splits[split] = ids.astype(dtype, copy=False)
    return Corpus(train=splits["train"], heldout=splits["held-out"], vocab_size=vocab_size,
                  source=f"{source}; tokenized with {encoder.name} (vocab {vocab_size})")


def _windows(data: np.ndarray, offsets: np.ndarray, seq_len: int):
    """Inputs and next-token targets, each (B, T), from (T+1)-token windows at ``offsets`` (B,)."""
    import torch  # lazily: see the imports

    index = offsets[:, None] + np.arange(seq_len + 1)  # (B, T+1)
    tokens = torch.from_numpy(data[index].astype(np.int64))  # (B, T+1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # (B, T), (B, T)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")


class CursorSampler:
    """Batches of one island's shard, numbered by a cursor: batch ``c`` is a pure function of
    ``(seed, shard_index, c)`` (subclasses define :meth:`batch_at`), so restoring the cursor resumes
    the exact sequence. Subclasses set ``shard_index``, ``num_shards`` and ``_cursor = 0``."""

    shard_index: int
    num_shards: int
    _cursor: int

    @property
    def cursor(self) -> int:
        """Number of batches drawn so far, which is also the number of the next batch."""
        return self._cursor

    @property
    def data_cursor(self) -> DataCursor:
        """The cursor as a DataCursor (no position: batch ``c`` is a pure function of ``c``)."""
        return DataCursor(self._cursor)

    def seek(self, cursor: DataCursor | int) -> None:
        """Resume at ``cursor``'s batch."""
        self.load_state_dict({**self.state_dict(), "cursor": DataCursor.of(cursor).batch})

    def batch_at(self, cursor: int) -> Any:
        """Batch number ``cursor``; does not move the cursor."""
        raise NotImplementedError

    def next_batch(self) -> Any:
        """The batch at the cursor; advances the cursor."""
        batch = self.batch_at(self._cursor)
        self._cursor += 1
        return batch

    def state_dict(self) -> dict:
        """The cursor, with the shard identity it belongs to."""
        return dict(cursor=self._cursor, shard_index=self.shard_index, num_shards=self.num_shards)

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor from :meth:`state_dict` output taken on the same shard."""
        mine = (self.shard_index, self.num_shards)
        theirs = (state.get("shard_index"), state.get("num_shards"))
        if theirs != mine:
            raise ValueError(f"sampler state is for shard {theirs[0]} of {theirs[1]} but this is "
                             f"shard {mine[0]} of {mine[1]}; load it into that shard's sampler")
        cursor = state.get("cursor")
        if not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"sampler state cursor={cursor!r} must be a non-negative int")
        self._cursor = cursor


class ShardSampler(CursorSampler):
    """Random training batches from one island's contiguous shard of a token array.

    Shard ``i`` of ``n`` is ``data[i*N//n : (i+1)*N//n]``, so shards are disjoint. Batch number
    ``c`` holds ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn uniformly inside
    the shard by a numpy Generator seeded with ``(seed, shard_index, c)``: it does not depend on
    earlier batches, so restoring the cursor resumes the exact sequence.
    """

    def __init__(self, data: np.ndarray, *, shard_index: int, num_shards: int, seq_len: int,
                 batch_size: int, seed: int) -> None:
        _check_positive(num_shards=num_shards, seq_len=seq_len, batch_size=batch_size)
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index={shard_index} must be in [0, num_shards={num_shards})")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative (numpy SeedSequence rule)")
        if data.ndim != 1:
            raise DataError(f"data has shape {data.shape}; pass a 1-D token array")
        self.start = shard_index * len(data) // num_shards
        """First index of this shard in ``data``."""
        self.stop = (shard_index + 1) * len(data) // num_shards
        """One past the last index of this shard in ``data``."""
        if self.stop - self.start < seq_len + 1:
            raise DataError(f"shard {shard_index} of {num_shards} has {self.stop - self.start} "
                            f"tokens (bytes for text), fewer than seq_len+1={seq_len + 1}; use "
                            f"fewer shards, a shorter seq_len or more data")
        self._shard = data[self.start : self.stop]
        self.shard_index, self.num_shards, self.seed = shard_index, num_shards, seed
        self.seq_len, self.batch_size = seq_len, batch_size
        self._cursor = 0

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens in one batch: ``batch_size * seq_len``."""
        return self.batch_size * self.seq_len

    def batch_at(self, cursor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``cursor`` as (x, y), each a LongTensor (B, T); does not move the cursor."""
        rng = np.random.default_rng([self.seed, self.shard_index, cursor])
        high = len(self._shard) - self.seq_len  # exclusive, so the last window ends at the stop
        offsets = rng.integers(0, high, size=self.batch_size)  # (B,)
        return _windows(self._shard, offsets, self.seq_len)


def heldout_batches(heldout: np.ndarray, *, seq_len: int, batch_size: int,
                    num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` evaluation batches (x, y), each (B, T), at evenly spaced held-out offsets.

    No randomness: the same arguments give the same windows, so every evaluation of every island,
    round and run sees the same data.
    """
    _check_positive(seq_len=seq_len, batch_size=batch_size, num_batches=num_batches)
    if len(heldout) < seq_len + 1:
        raise DataError(f"held-out data has {len(heldout)} tokens, fewer than seq_len+1="
                        f"{seq_len + 1}; raise heldout_fraction or shorten seq_len")
    last = len(heldout) - seq_len - 1  # last valid window offset
    offsets = np.linspace(0, last, num=batch_size * num_batches).round().astype(np.int64)
    offsets = offsets.reshape(num_batches, batch_size)  # (num_batches, B)
    return [_windows(heldout, row, seq_len) for row in offsets]


def unigram_bits_per_byte(train: np.ndarray, heldout: np.ndarray, *,
                          vocab_size: int = 256) -> float:
    """Held-out cross-entropy, in bits per token, of an add-one-smoothed unigram model of ``train``.

    ``p(v) = (count_train(v) + 1) / (len(train) + vocab_size)``; the result is
    ``-mean(log2 p(heldout))``: the baseline training must beat (8 bits for uniform bytes).
    """
    _check_positive(vocab_size=vocab_size)
    if len(heldout) == 0:
        raise DataError("held-out data is empty; a unigram baseline needs at least one token")
    for name, tokens in (("train", train), ("heldout", heldout)):
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise DataError(f"{name} ids span [{tokens.min()}, {tokens.max()}], outside "
                            f"[0, vocab_size={vocab_size}); pass the corpus's vocab_size")
    counts = np.bincount(train, minlength=vocab_size) + 1.0  # (V,) add-one smoothing
    log2_p = np.log2(counts / counts.sum())  # (V,)
    heldout_counts = np.bincount(heldout, minlength=vocab_size)  # (V,)
    return float(-(heldout_counts * log2_p).sum() / len(heldout))
