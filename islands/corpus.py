"""A corpus as units, described from metadata only, and the reading of one unit, which only islands do.

The control plane (driver, outer optimizer, health monitor) knows a corpus by its **index**: file
lists, Parquet footers and file sizes cut into **units**, each small enough for one island to read at a
time. No token is read to build it. Units per source (docs/data.md):

| source | unit | held out |
| --- | --- | --- |
| ``parquet`` (text or token lists) | a row group (or a slice of one) of a Parquet file; an Arrow/IPC file whole | rows, by a stable hash of (row group, row) |
| ``tokens`` (flat uint16/uint32 little-endian files) | a fixed range of ``unit_tokens`` tokens | whole units, by a stable hash of the unit's name |
| ``stdlib`` (the default corpus) | one standard-library source file | whole files, by a stable hash of the path |

A corpus with fewer units than it needs (every island needs one) has its largest units halved until it
has enough. :func:`read_unit` turns one unit into token ids in the island that reads it: it opens the
file through ``pyarrow.fs`` (local disk, ``s3://``, ``gs://``), reads the unit's byte range or row group,
keeps the split's rows and tokenizes text with the run's encoder. A unit that cannot be read (gone,
truncated, corrupt, ids past the vocabulary) raises :class:`UnitError`, which the island's stream logs
and skips (islands/stream.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from islands.data import (
    _ARROW_SUFFIXES,
    DataError,
    _check_column_type,
    _dataset_files,
    _resolve,
    _stdlib_split,
)
from islands.data_defaults import HELDOUT_FRACTION, SHUFFLE_DOCUMENTS
from islands.tokenizer import ByteEncoder

log = logging.getLogger(__name__)

SOURCES = ("stdlib", "parquet", "tokens")
"""Corpus sources read as units."""
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Flat token files: ids as little-endian unsigned integers of this width (the nanoGPT/Megatron convention)."""
TOKEN_FILE_SUFFIXES = (".bin", ".tokens", ".u16", ".u32")
"""The files of a token-file directory (others, such as an index or a README, are left alone)."""


class UnitError(DataError):
    """One unit could not be read (gone, truncated, corrupt, ids past the vocabulary): the stream skips it."""


@dataclass(frozen=True)
class Unit:
    """One piece of a corpus that an island reads whole; its fields come from metadata only."""

    name: str
    """Stable and unique within the corpus: the file's path relative to the corpus root, with the row group
    (``#g``), the slice (``:start+count``) or the token range (``@start``). Copies of a corpus compare by it."""
    path: str
    """The file, relative to the corpus root (posix separators)."""
    group: int
    """Parquet: the row group; -1 for a file read whole (Arrow/IPC, token files, stdlib files)."""
    start: int
    """First row (Parquet, within the row group), token (token files) or byte (stdlib files) of the unit."""
    count: int
    """Rows, tokens or bytes from ``start``; -1 for the rest of the file or row group."""
    tokens: int
    """Its tokens as estimated from metadata: balances the plan and counts a unit that could not be read."""
    heldout: bool | None
    """True: held out whole; False: trained on whole; None: its rows are split (Parquet, the row rule)."""


class UnitTable(Sequence[Unit]):
    """Units as columns: a sequence of :class:`Unit` that pickles as a few arrays and one string instead of an object
    per unit, so a plan of many thousands of units reaches every island process in milliseconds."""

    def __init__(self, units: Sequence[Unit]) -> None:
        self._paths = sorted({u.path for u in units})
        index = {p: k for k, p in enumerate(self._paths)}
        self._path = np.array([index[u.path] for u in units], dtype=np.int32)
        self._numbers = np.array([(u.group, u.start, u.count, u.tokens, -1 if u.heldout is None else int(u.heldout))
                                  for u in units], dtype=np.int64).reshape(len(units), 5)
        self._names = "\n".join(u.name for u in units)
        self._split: list[str] | None = None

    def __len__(self) -> int:
        return len(self._path)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if self._split is None:
            self._split = self._names.split("\n") if len(self) else []
        group, start, count, tokens, held = self._numbers[i].tolist()
        return Unit(self._split[i], self._paths[self._path[i]], group, start, count, tokens, None if held < 0 else bool(held))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_split": None}

    def __repr__(self) -> str:
        return f"UnitTable({len(self)} units)"


@dataclass(frozen=True)
class CorpusFormat:
    """How units of one corpus turn into token ids: the same for every copy and every island."""

    kind: str
    """'stdlib', 'parquet' or 'tokens' (:data:`SOURCES`)."""
    column: str | None = None
    """Parquet: the column read (text or list<int> token ids)."""
    is_text: bool = True
    """Text, tokenized in the island by ``encoder``; False for token ids as they are."""
    dtype: str | None = None
    """Token files: 'uint16' or 'uint32'."""
    heldout_fraction: float = HELDOUT_FRACTION
    """Share of rows (Parquet), files (stdlib) or units (token files) held out for evaluation."""
    shuffle_rows: bool = True
    """Parquet: read a unit's rows in a fixed pseudo-random order (False: file order)."""
    vocab_size: int | None = None
    """Token ids must be below it; a unit with a larger id is skipped as corrupt. None: not checked."""
    encoder: Any = None
    """Text: the islands.tokenizer.TextEncoder the island tokenizes with (None: UTF-8 bytes as they are)."""

    @property
    def separator(self) -> int | None:
        """The id appended after every document of text (b"\\n" for bytes, the encoder's end of document)."""
        if not self.is_text:
            return None
        return (self.encoder or ByteEncoder).eos_id

    @property
    def id_dtype(self) -> np.dtype:
        """The dtype of a unit's ids: bytes uint8, a token file's own, else int32 (or int64 past 2**31)."""
        if self.kind == "tokens":
            return TOKEN_DTYPES[self.dtype or "uint16"]
        if self.is_text and (self.encoder is None or self.encoder.vocab_size <= 256):
            return np.dtype(np.uint8)
        return np.dtype(np.int32)


@dataclass
class CorpusIndex:
    """A corpus as the control plane knows it: where it lies, how to read it, and its units."""

    fmt: CorpusFormat
    root: str
    """The directory (local path or pyarrow.fs URI) every unit's path is relative to."""
    units: tuple[Unit, ...]
    source: str
    """Human description, for logs and reports."""

    def train_units(self) -> list[int]:
        """Indices of the units that hold training tokens (all but those held out whole)."""
        return [i for i, u in enumerate(self.units) if u.heldout is not True]

    def heldout_units(self) -> list[int]:
        """Indices of the units that hold held-out tokens (held out whole, or rows split)."""
        return [i for i, u in enumerate(self.units) if u.heldout is not False]

    def keys(self) -> list[tuple[str, int]]:
        """(name, estimated tokens) of every unit in order: two copies of a corpus must agree on them."""
        return [(u.name, u.tokens) for u in self.units]

    def with_encoder(self, encoder: Any) -> CorpusIndex:
        """The same index whose text is tokenized by ``encoder`` (islands.tokenizer.TextEncoder)."""
        return dataclasses.replace(self, fmt=dataclasses.replace(self.fmt, encoder=encoder))


# ------------------------------------------------------------------ the index, from metadata


def _split_query(path: str) -> tuple[str, str]:
    """(path, "?query") of a URI that carries options (``s3://b/x?endpoint_override=...``); ("path", "") else."""
    base, sep, query = path.partition("?")
    return base, sep + query


def _join_path(root: str, rel: str) -> str:
    """``rel`` under ``root``, the root's URI options kept at the end."""
    base, query = _split_query(root)
    return (f"{base.rstrip('/')}/{rel}" if rel else base) + query


_REFUSED = ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN", "HTTP status 401",
            "HTTP status 403", "PERMISSION_DENIED", "UNAUTHENTICATED", "AuthorizationFailure", "AuthenticationFailed")
"""Words of a storage error that mean the storage answered and refused the credentials (S3, GCS, Azure)."""


def shown_path(path: str) -> str:
    """``path`` for messages, logs and reports: a URI's secret (``s3://KEY:SECRET@bucket``) shown as ``***``."""
    scheme, sep, rest = path.partition("://")
    authority, slash, tail = rest.partition("/")
    user, at, host = authority.rpartition("@")
    if not (sep and at and ":" in user):
        return path
    return f"{scheme}://{user.split(':', 1)[0]}:***@{host}{slash}{tail}"


def _locate(path: str) -> tuple[pafs.FileSystem, str, str, str]:
    """(filesystem, inner path, the root's inner path, the root) of a dataset path or URI. A directory is its own
    root; a single file's root is its directory, so a file and its copy elsewhere compare by file name. Raises
    DataError when the path does not exist or its storage cannot be reached."""
    fs, inner = _filesystem(path)
    try:
        kind = fs.get_file_info(inner).type
    except OSError as exc:  # an unreachable endpoint, refused credentials, a bucket we may not read
        shown = shown_path(path)
        if any(mark in str(exc) for mark in _REFUSED):
            raise DataError(f"access to {shown!r} was refused ({_first(exc)}); check the credentials (the URI's KEY:SECRET@, "
                            f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or the machine's role) and that they may read it") from exc
        raise DataError(f"cannot reach {shown!r} ({_first(exc)}); check the endpoint (the URI's endpoint_override=HOST:PORT "
                        f"and scheme, or the network) and that the storage is up") from exc
    if kind == pafs.FileType.NotFound:
        raise DataError(f"dataset path {shown_path(path)!r} does not exist; pass a data file or a directory of them")
    if kind == pafs.FileType.Directory:
        return fs, inner, inner, path if "://" in path else inner
    base, query = _split_query(path)
    root = (base.rsplit("/", 1)[0] + query) if "://" in path else str(pathlib.PurePosixPath(inner).parent)
    return fs, inner, inner.rsplit("/", 1)[0] if "/" in inner else "", root


def _relative(file: str, inner_root: str) -> str:
    return file[len(inner_root):].lstrip("/") if inner_root else file


def _split_largest(units: list[Unit], minimum: int) -> list[Unit]:
    """Halve the largest splittable unit (in place of it) until there are ``minimum`` units; deterministic."""
    units = list(units)
    while len(units) < minimum:
        k = max(range(len(units)), key=lambda i: (units[i].count, -i))
        u = units[k]
        if u.count < 2:
            break  # nothing left to halve: the plan then says how many units it has
        half = u.count // 2
        # The name without its slice, from the fields: a path may itself hold ":" or "@" (timestamps, versions).
        base = f"{u.path}#{u.group}" if u.group >= 0 else u.path
        sep = ":" if u.group >= 0 else "@"
        first = dataclasses.replace(u, name=f"{base}{sep}{u.start}+{half}", count=half, tokens=u.tokens // 2)
        second = dataclasses.replace(u, name=f"{base}{sep}{u.start + half}+{u.count - half}", start=u.start + half,
                                     count=u.count - half, tokens=u.tokens - u.tokens // 2)
        units[k:k + 1] = [first, second]
    return units


def index_parquet(path: str, *, column: str, is_text: bool, minimum_units: int = 1) -> tuple[str, list[Unit], int]:
    """(root, units, rows) of a Parquet/Arrow dataset from its footers: a unit per row group of each Parquet
    file (sorted path order), one per Arrow/IPC file. Raises DataError (one line) for a path that does not
    exist or cannot be reached, a directory without data files, a missing column or a column of the wrong type."""
    import pyarrow.parquet as pq

    fs, inner, root_inner, root = _locate(path)
    files = _dataset_files(fs, inner, path)
    units: list[Unit] = []
    rows = 0
    arg = "text_column" if is_text else "token_column"
    for file in files:
        rel = _relative(file, root_inner)
        try:
            if file.endswith(_ARROW_SUFFIXES):
                schema = _arrow_schema(fs, file)
                size = fs.get_file_info(file).size or 0
                units.append(Unit(rel, rel, -1, 0, -1, size if is_text else size // 4, None))
                _check_field(schema, column, is_text, path, arg)
                continue
            meta = pq.read_metadata(file, filesystem=fs)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read the footer of {file!r} ({_first(exc)}); fix or remove the file") from exc
        _check_field(meta.schema.to_arrow_schema(), column, is_text, path, arg)
        leaf = _leaf(meta, column, is_text)
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            chunk = group.column(leaf)
            tokens = chunk.total_uncompressed_size if is_text else chunk.num_values
            units.append(Unit(f"{rel}#{g}", rel, g, 0, group.num_rows, int(tokens), None))
            rows += group.num_rows
    if not any(u.count != 0 for u in units):
        raise DataError(f"dataset {shown_path(path)!r} has no rows; point at a non-empty dataset")
    units = [u for u in units if u.count != 0]  # empty row groups hold nothing to read
    return root, _split_largest(units, minimum_units), rows


def _leaf(meta: Any, column: str, is_text: bool) -> int:
    paths = [meta.schema.column(j).path for j in range(meta.num_columns)]
    for j, p in enumerate(paths):
        if (p == column) if is_text else p.startswith(column + "."):
            return j
    raise DataError(f"column {column!r} not found; columns are {paths}")


def _arrow_schema(fs: pafs.FileSystem, file: str) -> pa.Schema:
    try:
        return pa.ipc.open_file(fs.open_input_file(file)).schema
    except pa.ArrowInvalid:  # the IPC stream format (Hugging Face caches)
        with fs.open_input_stream(file) as stream:
            return pa.ipc.open_stream(stream).schema


def _check_field(schema: pa.Schema, column: str, is_text: bool, path: str, arg: str) -> None:
    if column not in schema.names:
        raise DataError(f"column {column!r} not found in {shown_path(path)!r}; columns are {schema.names}; pass {arg}= one of them")
    _check_column_type(schema.field(column).type, column, is_text, path)


def index_token_files(path: str, *, dtype: str, unit_tokens: int, heldout_fraction: float = HELDOUT_FRACTION,
                      minimum_units: int = 2) -> tuple[str, list[Unit], int]:
    """(root, units, tokens) of flat token files from their sizes: each file (a file, or the sorted
    ``*.bin``/``*.tokens``/``*.u16``/``*.u32`` files under a directory) cut into ranges of ``unit_tokens``.
    A unit is held out iff a stable hash of its name falls under ``heldout_fraction`` (the last unit if none
    does). Raises DataError for a size that is not a whole number of ids (a truncated file or the wrong
    dtype), no files, or a corpus too small to hold one training and one held-out unit."""
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"data.token_dtype={dtype!r}; token files hold 'uint16' or 'uint32' ids")
    width = TOKEN_DTYPES[dtype].itemsize
    fs, inner, root_inner, root = _locate(path)
    if inner == root_inner:  # a directory of token files
        infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
        files = sorted((i.path, i.size) for i in infos if i.type == pafs.FileType.File
                       and not i.base_name.startswith((".", "_")) and i.base_name.endswith(TOKEN_FILE_SUFFIXES))
        if not files:
            raise DataError(f"directory {shown_path(path)!r} has no {'/'.join(TOKEN_FILE_SUFFIXES)} token files; point at the "
                            f"directory that holds them (docs/data.md says how to make one)")
    else:
        files = [(inner, fs.get_file_info(inner).size)]
    units: list[Unit] = []
    total = 0
    for file, size in files:
        if size % width:
            raise DataError(f"token file {file!r} has {size} bytes, not a whole number of {dtype} ids; it is truncated "
                            f"or holds another width: fix it or set data.token_dtype")
        n = size // width
        rel = _relative(file, root_inner)
        for start in range(0, n, unit_tokens):
            count = min(unit_tokens, n - start)
            name = f"{rel}@{start}"
            units.append(Unit(name, rel, -1, start, count, count, False))
        total += n
    if total == 0:
        raise DataError(f"token files under {shown_path(path)!r} are empty; write token ids into them first")
    units = _split_largest(units, minimum_units)
    held = held_out_by_name([u.name for u in units], heldout_fraction)
    if all(held):
        raise DataError(f"{shown_path(path)!r} has {len(units)} unit(s), all held out at heldout_fraction={heldout_fraction}; "
                        f"lower data.unit_tokens so the corpus cuts into more units")
    units = [dataclasses.replace(u, heldout=h) for u, h in zip(units, held)]
    return root, units, total


def held_out_by_name(names: Sequence[str], heldout_fraction: float) -> list[bool]:
    """Which whole units are held out: those whose name's crc32 falls under ``heldout_fraction`` of 2**32, and the
    last one when none does (stable across processes, machines and copies of a corpus)."""
    held = [zlib.crc32(name.encode()) / 2**32 < heldout_fraction for name in names]
    if held and not any(held):
        held[-1] = True
    return held


def index_stdlib(*, heldout_fraction: float = HELDOUT_FRACTION, max_bytes: int | None = None, shuffle: bool = SHUFFLE_DOCUMENTS,
                 minimum_units: int = 1) -> tuple[str, list[Unit], int]:
    """(root, units, files) of the running Python's standard-library source: one unit per file, the
    training files first, then the held-out ones, each in corpus order (islands.data.load_stdlib_corpus's
    split and order). ``max_bytes`` keeps training files until their sizes reach it, the last one cut at the cap as
    the byte loader cut it, and held-out files in proportion (at least 64 KiB)."""
    train_files, heldout_files, heldout_cap = _stdlib_split(heldout_fraction, max_bytes, shuffle)
    root = sysconfig.get_paths()["stdlib"]
    units: list[Unit] = []
    for files, cap, held in ((train_files, max_bytes, False), (heldout_files, heldout_cap, True)):
        total = 0
        for path in files:
            if cap is not None and total >= cap:
                break
            size = path.stat().st_size
            if cap is not None:
                size = min(size, cap - total)  # the last file read only up to the cap, as the byte loader cut it
            rel = path.relative_to(root).as_posix()
            units.append(Unit(rel, rel, -1, 0, size, size + 1, held))
            total += size + 1
    train = [u for u in units if not u.heldout]
    heldout = [u for u in units if u.heldout]
    return root, _split_largest(train, minimum_units) + heldout, len(units)


# ------------------------------------------------------------------ reading a unit (islands)


@functools.lru_cache(maxsize=64)
def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and inner path of a local path or URI, once per path and process: an S3 client is slow to make."""
    return _resolve(path)


def _file_of(root: str, rel: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of ``root`` (made once per process) and the inner path of ``rel`` under it."""
    fs, inner_root = _filesystem(root)
    return fs, f"{inner_root.rstrip('/')}/{rel}" if rel else inner_root


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__


def read_unit(fmt: CorpusFormat, root: str, unit: Unit, *, heldout: bool = False) -> np.ndarray:
    """The token ids of ``unit`` of the corpus copy at ``root``: its training tokens, or with ``heldout`` its
    held-out tokens (empty when it holds none of that split). Text is tokenized here, a separator after every
    document. Raises :class:`UnitError` (one line naming the unit) when the unit cannot be read."""
    if unit.heldout is not None and unit.heldout != heldout:
        return np.zeros(0, dtype=fmt.id_dtype)
    try:
        if fmt.kind == "tokens":
            ids = _read_token_range(fmt, root, unit)
        elif fmt.kind == "stdlib":
            ids = _read_text_file(fmt, root, unit)
        else:
            ids = _read_rows(fmt, root, unit, heldout=heldout)
    except UnitError:
        raise
    except (OSError, pa.ArrowException, ValueError, UnicodeError) as exc:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} could not be read: {_first(exc)}") from exc
    if fmt.vocab_size is not None and ids.size and int(ids.max()) >= fmt.vocab_size:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} holds token id {int(ids.max())}, past data.vocab_size="
                        f"{fmt.vocab_size}: the file is corrupt or was made with another tokenizer")
    return ids


def _read_token_range(fmt: CorpusFormat, root: str, unit: Unit) -> np.ndarray:
    dtype = TOKEN_DTYPES[fmt.dtype or "uint16"]
    path = _join_path(root, unit.path)
    if "://" not in path:  # memory-mapped: the page cache serves it, nothing is copied until the window is cut
        with pa.memory_map(path, "r") as source:
            data = source.read_at(unit.count * dtype.itemsize, unit.start * dtype.itemsize)
            ids = np.frombuffer(data, dtype=dtype).copy()
    else:
        fs, inner = _file_of(root, unit.path)
        with fs.open_input_file(inner) as source:
            data = source.read_at(unit.count * dtype.itemsize, unit.start * dtype.itemsize)
        ids = np.frombuffer(data, dtype=dtype)
    if len(ids) != unit.count:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} is truncated: {len(ids)} of its {unit.count} tokens are there")
    return ids


def _read_text_file(fmt: CorpusFormat, root: str, unit: Unit) -> np.ndarray:
    data, ends = _file_bytes(root, unit)
    if fmt.encoder is None:  # bytes as they are, as the byte corpus always read them; b"\n" after each file
        return np.frombuffer(data + (b"\n" if ends else b""), dtype=np.uint8)
    if not ends:  # the first part of a halved file: its document goes on in the next part
        return np.asarray(fmt.encoder.encode_batch([data.decode("utf-8", errors="replace")])[0]).astype(fmt.id_dtype)
    return _encode(fmt, [data.decode("utf-8", errors="replace")])


def _file_bytes(root: str, unit: Unit) -> tuple[bytes, bool]:
    """The unit's bytes of its file, and whether they reach the file's end."""
    with open(os.path.join(root, unit.path), "rb") as f:
        f.seek(unit.start)
        data = f.read(unit.count if unit.count >= 0 else -1)
        return data, not f.read(1)


def _encode(fmt: CorpusFormat, texts: Sequence[str]) -> np.ndarray:
    """Documents encoded and joined, a separator after each (so units concatenate into a stream of documents);
    no encoder is UTF-8 bytes, documents separated by b"\\n" (islands.tokenizer.ByteEncoder)."""
    if not texts:
        return np.zeros(0, dtype=fmt.id_dtype)
    ids = np.asarray((fmt.encoder or ByteEncoder()).encode_documents(list(texts)))
    return np.concatenate([ids, [fmt.separator]]).astype(fmt.id_dtype, copy=False)


def _column(fmt: CorpusFormat, root: str, unit: Unit, *, heldout: bool) -> pa.Array | pa.ChunkedArray:
    """The unit's rows of the split, in the read order (file order, or a seeded order with ``shuffle_rows``)."""
    import pyarrow.parquet as pq

    assert fmt.column is not None
    fs, inner = _file_of(root, unit.path)
    if unit.group >= 0:
        with fs.open_input_file(inner) as source:
            column = pq.ParquetFile(source).read_row_group(unit.group, columns=[fmt.column]).column(0)
    else:
        try:
            column = pa.ipc.open_file(fs.open_input_file(inner)).read_all().column(fmt.column)
        except pa.ArrowInvalid:
            with fs.open_input_stream(inner) as stream:
                column = pa.ipc.open_stream(stream).read_all().column(fmt.column)
    if unit.count >= 0:
        column = column.slice(unit.start, unit.count)
    # Rows are held out by a hash of (row group, row): the same rows whichever slice or copy reads them.
    salt = zlib.crc32(f"{unit.path}#{unit.group}".encode())
    rows = np.arange(unit.start, unit.start + len(column))
    keep = (_hash_rows(rows, salt) < fmt.heldout_fraction) == heldout
    if fmt.shuffle_rows:
        order = np.argsort(_hash_rows(rows, salt ^ 0x5A5A5A5A), kind="stable")
        column, keep = column.take(pa.array(order)), keep[order]
    return column.filter(pa.array(keep))


def _read_rows(fmt: CorpusFormat, root: str, unit: Unit, *, heldout: bool) -> np.ndarray:
    import pyarrow.compute as pc

    column = _column(fmt, root, unit, heldout=heldout)
    if fmt.is_text:
        return _encode(fmt, [t for t in column.to_pylist() if t is not None])
    flat = pc.list_flatten(column)
    if flat.null_count:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} has {flat.null_count} null token ids; drop or fill them")
    ids = flat.to_numpy(zero_copy_only=False)
    if ids.size and int(ids.min()) < 0:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} holds a negative token id ({int(ids.min())})")
    return ids.astype(np.int64 if ids.size and int(ids.max()) >= 2**31 else np.int32, copy=False)


def read_texts(fmt: CorpusFormat, root: str, unit: Unit) -> list[str]:
    """The training documents of a text unit, untokenized (for training a tokenizer on a sample of the corpus)."""
    if unit.heldout is True:
        return []
    try:
        if fmt.kind == "stdlib":
            return [_file_bytes(root, unit)[0].decode("utf-8", errors="replace")]
        return [t for t in _column(fmt, root, unit, heldout=False).to_pylist() if t is not None]
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise UnitError(f"unit {unit.name!r} of {shown_path(root)} could not be read: {_first(exc)}") from exc


def _hash_rows(rows: np.ndarray, salt: int) -> np.ndarray:
    """A stable pseudo-random float in [0, 1) per row number (splitmix64's finalizer; each salt its own sequence)."""
    with np.errstate(over="ignore"):  # wrap-around multiplication is the point of the hash
        z = rows.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(salt + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


def heldout_sample(index: CorpusIndex, *, max_tokens: int, root: str | None = None) -> np.ndarray:
    """Up to ``max_tokens`` held-out token ids, read from the held-out units in index order until there are
    enough (a bounded read, whatever the corpus's size). Units that cannot be read are logged and passed over.
    Raises DataError when no held-out token could be read."""
    pieces: list[np.ndarray] = []
    have = 0
    errors: list[str] = []
    for i in index.heldout_units():
        if have >= max_tokens:
            break
        try:
            ids = read_unit(index.fmt, root or index.root, index.units[i], heldout=True)
        except UnitError as err:
            log.warning("held-out %s; evaluating without it", err)
            errors.append(str(err))
            continue
        pieces.append(ids[: max_tokens - have])
        have += len(pieces[-1])
    if not have:
        why = f" ({errors[0]})" if errors else ""
        raise DataError(f"no held-out tokens could be read from {shown_path(index.root)}{why}; raise data.heldout_fraction or "
                        f"fix the corpus")
    return np.concatenate(pieces)


__all__ = ["SOURCES", "TOKEN_DTYPES", "CorpusFormat", "CorpusIndex", "Unit", "UnitError", "UnitTable", "heldout_sample", "held_out_by_name", "shown_path",
           "index_parquet", "index_stdlib", "index_token_files", "read_texts", "read_unit"]
