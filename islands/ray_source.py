"""A Ray Data dataset as a picklable map-style dataset of examples, for :class:`islands.examples.ExampleSampler`.

The driver materializes the dataset once (:meth:`RayDatasetExamples.from_dataset`) and keeps its
blocks' object refs and row counts; islands receive the object (as a task or actor argument) and
fetch only the blocks that hold the rows they ask for. Islands never run Ray Data themselves.

Ownership (docs/notes ray-2.60.md, "owner fate-sharing"): the blocks are owned by the driver
that materialized them, so they stay readable from any island while that driver lives and the
object (or a copy of it) holds the refs; when the driver exits they are gone, and a fetch raises
:class:`islands.data.DataError`. The materialized blocks stay pinned in the object store for as
long as the object lives.

Rows are dicts ``{column: value}``: numeric and boolean scalars become 0-d tensors, numeric
lists (nested lists must be rectangular) and Ray tensor columns become tensors of their dtype
(unsigned ints wider than 8 bits become int64, which torch supports fully); strings, bytes and
other types stay Python values (``as_py()``). ``torch.utils.data.default_collate`` then stacks
the tensors of equal shape and lists the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from islands.data import DataError

if TYPE_CHECKING:
    import ray.data

_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
CACHED_BLOCKS = 4
"""Blocks a process keeps after fetching them (the oldest is dropped first)."""
_WIDE_UNSIGNED = (np.uint16, np.uint32, np.uint64)


def _is_numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _innermost(kind: pa.DataType) -> pa.DataType:
    while any(is_list(kind) for is_list in _LIST_TYPES):
        kind = kind.value_type
    return kind


def _to_tensor(array: np.ndarray):
    import torch

    if array.dtype.type in _WIDE_UNSIGNED:
        array = array.astype(np.int64)
    # A copy: blocks from the object store are read-only, and torch wants writable memory.
    return torch.from_numpy(np.array(array, copy=True))


def _list_values(values: pa.Array, column: str) -> np.ndarray:
    """One row's (possibly nested) numeric list as an ndarray; nested lists must be rectangular."""
    if values.null_count:
        raise DataError(f"column {column!r} has nulls inside a list; fill or drop them before from_dataset")
    if not any(is_list(values.type) for is_list in _LIST_TYPES):
        return values.to_numpy(zero_copy_only=False)
    lengths = np.unique(values.value_lengths().to_numpy(zero_copy_only=False)) if len(values) else np.array([0])
    if len(lengths) > 1:
        raise DataError(f"column {column!r} holds ragged nested lists (inner lengths {lengths.tolist()[:4]}); "
                        f"pad them to one length or flatten them")
    inner = _list_values(values.flatten(), column)
    return inner.reshape(len(values), int(lengths[0]), *inner.shape[1:])


def _cell(array: pa.Array, row: int, column: str) -> Any:
    """Row ``row`` of one column: numeric data as a tensor, anything else as a Python value."""
    kind = array.type
    if isinstance(kind, pa.ExtensionType) and type(kind).__module__.startswith("ray."):  # Ray Data tensors
        return _to_tensor(np.asarray(array.slice(row, 1).to_numpy(zero_copy_only=False))[0])
    scalar = array[row]
    if not scalar.is_valid:
        if _is_numeric(_innermost(kind)):
            raise DataError(f"column {column!r} is null at a row; fill or drop nulls before from_dataset")
        return None
    if _is_numeric(kind):
        return _to_tensor(np.asarray(array.slice(row, 1).to_numpy(zero_copy_only=False))[0])
    if any(is_list(kind) for is_list in _LIST_TYPES) and _is_numeric(_innermost(kind)):
        return _to_tensor(_list_values(scalar.values, column))
    return scalar.as_py()


class RayDatasetExamples:
    """A materialized ``ray.data.Dataset`` as a map-style dataset: ``len()`` rows, ``[i]`` a dict.

    Build it in the driver with :meth:`from_dataset`; pass it to islands as a task or actor
    argument (it pickles as block refs and row counts, not data). In each process, ``[i]``
    fetches the block holding row ``i`` on first use and keeps it: an island's shard is a
    contiguous range of rows, so an island holds only its shard's blocks.
    """

    def __init__(self, block_refs: Sequence[Any], block_rows: Sequence[int], columns: Sequence[str]) -> None:
        """Prefer :meth:`from_dataset`. ``block_refs[k]`` is an ObjectRef of a ``pyarrow.Table``
        with ``block_rows[k]`` rows; rows are numbered across blocks in order."""
        if len(block_refs) != len(block_rows):
            raise ValueError(f"{len(block_refs)} block refs but {len(block_rows)} row counts; pass one count per block")
        self._refs = list(block_refs)
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(block_rows, dtype=np.int64))])  # (blocks + 1,)
        self.columns = list(columns)
        """The columns each row holds."""
        self._blocks: dict[int, pa.Table] = {}  # fetched blocks of this process, newest last; never pickled

    @classmethod
    def from_dataset(cls, dataset: ray.data.Dataset, *, columns: Sequence[str] | None = None) -> RayDatasetExamples:
        """Materialize ``dataset`` once, in order, and keep its blocks' refs and row counts.

        The dataset runs with ``preserve_order=True`` (set on its own context for the call, then
        restored), so two materializations of the same ``ray.data.read_parquet(path)`` number the
        rows the same way (files in path order, rows in file order): a resumed run that re-reads the
        dataset resumes on the same examples. Without it Ray Data emits blocks as tasks finish. An
        already materialized dataset keeps the order it was materialized in. ``columns`` (default
        all) selects the columns each row holds.
        """
        import ray
        import ray.data

        if not isinstance(dataset, ray.data.Dataset):
            raise DataError(f"from_dataset got a {type(dataset).__name__}; pass a ray.data.Dataset, e.g. "
                            f"ray.data.read_parquet(path)")
        options = dataset.context.execution_options
        saved, options.preserve_order = options.preserve_order, True
        try:
            materialized = dataset.materialize()
        finally:
            options.preserve_order = saved
        names = materialized.schema().names if materialized.schema() is not None else []
        selected = list(names if columns is None else columns)
        missing = [c for c in selected if c not in names]
        if missing:
            raise DataError(f"columns {missing} not in the dataset; its columns are {names}; pass columns= from them")
        refs = materialized.to_arrow_refs()  # zero-copy: read_parquet blocks already are Arrow tables
        # Row counts from the blocks themselves (a zero-CPU task each, run where the block is), not
        # from Ray Data's internal metadata.
        rows = ray.get([_num_rows_task().remote(ref) for ref in refs]) if refs else []
        total = materialized.count()
        if sum(rows) != total:
            raise DataError(f"the dataset's {len(refs)} blocks hold {sum(rows)} rows but it counts {total}; "
                            f"materialize it without limit/split (or repartition it) before from_dataset")
        if total == 0:
            raise DataError("the Ray dataset has no rows; point it at non-empty data")
        return cls(refs, rows, selected)

    @property
    def num_blocks(self) -> int:
        """Number of blocks the rows are spread over."""
        return len(self._refs)

    @property
    def block_rows(self) -> tuple[int, ...]:
        """Rows in each block, in order (row ``i`` is in the first block whose cumulative count passes ``i``)."""
        return tuple(np.diff(self._starts).tolist())

    @property
    def cached_blocks(self) -> frozenset[int]:
        """Numbers of the blocks this process has fetched (for tests and accounting)."""
        return frozenset(self._blocks)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _block(self, k: int) -> pa.Table:
        block = self._blocks.get(k)
        if block is None:
            import ray

            try:
                block = ray.get(self._refs[k])
            except ray.exceptions.ObjectLostError as exc:  # OwnerDiedError included
                raise DataError(f"block {k} of the Ray dataset is gone ({type(exc).__name__}): the driver that "
                                f"called from_dataset exited or the object was lost; build it again in the live "
                                f"driver") from exc
            if not isinstance(block, pa.Table):  # to_arrow_refs gives Arrow; accept pandas to be safe
                block = pa.Table.from_pandas(block, preserve_index=False)
            block = _keep(self._blocks, k, block.select(self.columns).combine_chunks())  # one chunk per column
        return block

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row ``index`` as ``{column: tensor or value}`` (negative indices count from the end)."""
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise TypeError(f"index {index!r} must be an int")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"row {index} is out of range for {n} rows")
        index = int(index) % n
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        block, row = self._block(k), index - int(self._starts[k])
        return {name: _cell(block.column(name).chunk(0), row, name) for name in self.columns}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_blocks"] = {}  # each process fetches its own blocks
        return state

    def __repr__(self) -> str:
        return f"RayDatasetExamples({len(self)} rows in {self.num_blocks} blocks, columns {self.columns})"


class RayDataReads:
    """A ``ray.data.Dataset`` that is one read (``read_parquet``, ``read_json``, ...) as units the islands read
    themselves: its datasource's read tasks, each a unit. Nothing is materialized: an island runs its own read
    tasks, one at a time on its read-ahead thread (islands/stream.py), and keeps the rows of a few.

    Examples are numbered ``(unit << 32) + row``: a unit's rows are known only once it is read. Rows become
    ``{column: tensor or value}`` as in :class:`RayDatasetExamples`.
    """

    def __init__(self, tasks: Sequence[Any], rows: Sequence[int | None], columns: Sequence[str]) -> None:
        """Prefer :meth:`of`. ``tasks[k]`` is a Ray Data ``ReadTask``; ``rows[k]`` its rows when its metadata says."""
        self.tasks, self.rows, self.columns = list(tasks), list(rows), list(columns)
        self._tables: dict[int, pa.Table] = {}  # units of this process, newest last; never pickled

    @classmethod
    def of(cls, dataset: ray.data.Dataset, *, units: int) -> RayDataReads | None:
        """The read tasks of ``dataset`` (about ``units`` of them), or None when its plan is more than one read
        (transforms after the read: such a dataset is materialized instead, :class:`RayDatasetExamples`).

        Ray 2.60 (pinned in pyproject.toml) plans ``read_parquet`` as ``ListFiles -> ReadFiles`` and its other
        readers as one ``Read`` of a datasource. A Parquet read becomes one unit per row group of its files
        (footers read here, row groups read with pyarrow in the island); any other read, its datasource's read tasks.
        """
        from ray.data._internal.logical.operators.read_operator import ListFiles, Read, ReadFiles

        dag = getattr(getattr(dataset, "_logical_plan", None), "dag", None)
        if isinstance(dag, ReadFiles) and dag.block_udf is None and len(dag.input_dependencies) == 1 \
                and isinstance(dag.input_dependencies[0], ListFiles) and dag.datasource_name.lower().startswith("parquet"):
            return cls._of_parquet(dag.input_dependencies[0], list(dag.infer_schema().names))
        if not isinstance(dag, Read):
            return None
        tasks = dag.datasource.get_read_tasks(units)
        if not tasks:
            raise DataError("the Ray dataset reads nothing (no read tasks); point it at non-empty data")
        schema = dataset.schema()
        columns = list(schema.names) if schema is not None else []
        return cls(tasks, [t.metadata.num_rows for t in tasks], columns)

    @classmethod
    def _of_parquet(cls, listing: Any, columns: list[str]) -> RayDataReads:
        """One unit per row group of the files a ``read_parquet`` lists (their footers read here, nothing else)."""
        import pyarrow.fs as pafs
        import pyarrow.parquet as pq

        from islands.data import _dataset_files, _resolve

        tasks, rows = [], []
        for path in listing.paths:
            fs, inner = (listing.filesystem, path) if listing.filesystem is not None else _resolve(path)
            files = _dataset_files(fs, inner, path) if fs.get_file_info(inner).type != pafs.FileType.File else [inner]
            for file in files:
                meta = pq.read_metadata(file, filesystem=fs)
                for g in range(meta.num_row_groups):
                    tasks.append(_RowGroupRead(fs, file, g, tuple(columns)))
                    rows.append(meta.row_group(g).num_rows)
        if not tasks:
            raise DataError("the Ray dataset's Parquet files hold no row groups; point it at non-empty data")
        return cls(tasks, rows, columns)

    def read_unit(self, k: int) -> int:
        """Run read task ``k`` (here, in this process), keep its rows, and return how many it gave."""
        tables = [b if isinstance(b, pa.Table) else pa.Table.from_pandas(b, preserve_index=False) for b in self.tasks[k]()]
        table = pa.concat_tables(tables).select(self.columns).combine_chunks() if tables else pa.table({})
        return _keep(self._tables, k, table).num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Row ``index & 0xFFFFFFFF`` of unit ``index >> 32``, read again if it was dropped."""
        k, row = int(index) >> 32, int(index) & 0xFFFFFFFF
        if k not in self._tables:
            self.read_unit(k)
        table = self._tables[k]
        return {name: _cell(table.column(name).chunk(0), row, name) for name in self.columns}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tables"] = {}  # each process reads its own units
        return state

    def __repr__(self) -> str:
        return f"RayDataReads({len(self.tasks)} read tasks, columns {self.columns})"


class _RowGroupRead:
    """Reads one row group of one Parquet file: a unit of a ``read_parquet`` dataset (picklable, like a ReadTask)."""

    def __init__(self, fs: Any, file: str, group: int, columns: tuple[str, ...]) -> None:
        self.fs, self.file, self.group, self.columns = fs, file, group, columns

    def __call__(self) -> list[pa.Table]:
        import pyarrow.parquet as pq

        with self.fs.open_input_file(self.file) as source:
            return [pq.ParquetFile(source).read_row_group(self.group, columns=list(self.columns))]


def _keep(cache: dict[int, pa.Table], k: int, table: pa.Table) -> pa.Table:
    """Put ``table`` in ``cache`` under ``k``, dropping the oldest past CACHED_BLOCKS, and return it.

    A few at a time: an island reads its units one after another, and a shuffle block spans at most a few of
    them (with the ones read ahead); holding every one it read would grow to its whole share of the data."""
    cache[k] = table
    while len(cache) > CACHED_BLOCKS:
        cache.pop(next(iter(cache)))
    return table


def _num_rows(block) -> int:
    return block.num_rows if isinstance(block, pa.Table) else len(block)


@functools.cache
def _num_rows_task():
    """The remote form of :func:`_num_rows`, made on first use: importing this module neither
    imports ray nor needs a cluster."""
    import ray

    return ray.remote(num_cpus=0)(_num_rows)
