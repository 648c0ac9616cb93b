"""Each island streams its own units: the run's data plan, and the sampler that reads it with bounded read-ahead.

:class:`TokenStream` is what the driver hands the islands in place of data: the corpus's format, its
training units, which island reads which (policies/data_plan.py), and where each pool's copy lies. It
holds no token; it pickles in a few hundred kilobytes for thousands of units.

:class:`StreamSampler` is one island's reader. The island's stream is its units in the plan's epoch order
(a seeded permutation per epoch), each unit's tokens after the previous unit's, endlessly. Window ``j``
is the stream's tokens ``[j*T, j*T + T + 1)`` (inputs and next-token targets), so every token is a target
once per epoch. Windows are shuffled in **blocks** of ``batch_size * block_batches`` windows (the shuffle
buffer), each block by its own seeded permutation, and batch ``n`` is the block's windows
``(n mod block_batches) * B .. + B``. Everything is a pure function of the plan, so a
:class:`islands.cursor.DataCursor` (the batch count, and the unit and token where its block starts) is
enough to resume exactly.

A thread reads up to ``readahead`` units ahead of the one being cut into windows, so reading overlaps
the inner steps. Memory: those units' ids plus one block (``B * block_batches * (T + 1)`` ids), whatever
the corpus's size. A unit that cannot be read is logged once, skipped, and counted in :attr:`skipped`
with its metadata estimate of tokens (the fate "unreadable" in the run's summary).

Data from the Python API goes the same way: a token array is cut into units that the driver puts in Ray's
object store one by one (each island fetches only its own), and a map-style dataset's indices are cut into
units whose "windows" are single examples, a batch being ``batch_size`` collated examples.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from islands.corpus import CorpusFormat, Unit, UnitError, read_unit
from islands.cursor import DataCursor
from islands.data import DataError, _check_positive, _windows
from policies.data_plan import block_permutation, epoch_order

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenStream:
    """A run's training data as the islands receive it: the plan, no tokens (see the module docstring)."""

    fmt: CorpusFormat
    """How units turn into token ids."""
    root: str
    """Where the corpus lies (local path or pyarrow.fs URI): the copy of every pool without one of its own."""
    units: Sequence[Unit]
    """The training units (held-out units are the evaluator's): a tuple, or an islands.corpus.UnitTable (compact)."""
    assignment: tuple[tuple[int, ...], ...]
    """``assignment[i]``: indices into ``units`` of island ``i``'s units, in plan order."""
    shuffle: bool = True
    """Epochs read an island's units in a seeded order, and blocks shuffle their windows; False keeps both in order."""
    block_batches: int = 512
    """Batches per block: the shuffle buffer holds ``block_batches * batch_size`` windows."""
    readahead: int = 2
    """Units read ahead of the one being cut into windows."""
    roots: dict[str, str] = field(default_factory=dict)
    """Pool name -> the root of that pool's own copy (the same units), so its islands read in their region."""
    source: str = ""
    """Human description, for logs and reports."""
    payloads: tuple[Any, ...] = ()
    """Data from Python (``fmt.kind`` 'memory'): per unit, its ids (a 1-D array, or ``[ref]`` to one in Ray's
    object store, so an island fetches only its own units)."""
    examples: Any = None
    """A map-style dataset from Python (``fmt.kind`` 'examples'): units are ranges of its indices, and a batch is
    ``batch_size`` of its examples collated by ``torch.utils.data.default_collate``."""

    @property
    def of_examples(self) -> bool:
        """True when the stream is of a dataset's examples, not of tokens."""
        return self.fmt.kind == "examples"

    def with_refs(self, put: Callable[[Any], Any]) -> TokenStream:
        """The same stream with each in-memory unit put in Ray's object store by ``put`` (``ray.put``), as ``[ref]``."""
        if self.fmt.kind != "memory":
            return self
        return replace(self, payloads=tuple(p if isinstance(p, list) else [put(p)] for p in self.payloads))

    @property
    def num_islands(self) -> int:
        """Islands the plan was made for."""
        return len(self.assignment)

    def root_for(self, pool: str | None) -> str:
        """The copy pool ``pool`` reads: its own if it has one, else the corpus's root."""
        return self.roots.get(pool or "", self.root)

    def island_tokens(self, island: int) -> int:
        """Estimated training tokens of island ``island``'s units (metadata)."""
        return sum(self.units[u].tokens for u in self.assignment[island])


def _fetch(payload: Any) -> np.ndarray:
    """A token-array unit's ids: the array itself (in process), or ``[ref]`` fetched from Ray's object store."""
    if isinstance(payload, np.ndarray):
        return payload
    import ray  # only islands of a run given arrays from Python get here, in a Ray worker

    return ray.get(payload[0])


class StreamSampler:
    """Batches of one island's stream (module docstring), resumable from a :class:`DataCursor`.

    With ``world`` > 1 (an island of several data-parallel workers) worker ``rank`` takes stream batch
    ``c * world + rank`` at island step ``c``; every worker reads the island's stream, and the cursor counts
    island steps. ``read`` stands in for :func:`islands.corpus.read_unit` (tests inject failures).
    """

    def __init__(self, stream: TokenStream, *, island: int, seq_len: int, batch_size: int, seed: int,
                 pool: str | None = None, world: int = 1, rank: int = 0,
                 read: Callable[[CorpusFormat, str, Unit], np.ndarray] | None = None) -> None:
        _check_positive(seq_len=seq_len, batch_size=batch_size, world=world)
        if not 0 <= island < stream.num_islands:
            raise ValueError(f"island={island} but the data plan has {stream.num_islands} islands")
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in [0, world={world})")
        if world > stream.block_batches:  # an island step's batches then span at most two blocks
            raise ValueError(f"{world} workers per island but data.block_batches={stream.block_batches}; raise "
                             f"data.block_batches to at least {world}")
        if seed < 0:
            raise ValueError(f"seed={seed} must be non-negative (numpy SeedSequence rule)")
        self.stream, self.island, self.seed = stream, island, seed
        self.seq_len, self.batch_size, self.world, self.rank = seq_len, batch_size, world, rank
        self.shard_index, self.num_shards = island, stream.num_islands  # the CursorSampler names
        self.root = stream.root_for(pool)
        self._units = stream.assignment[island]
        if not self._units:
            raise DataError(f"island {island} has no units in the data plan; train fewer islands or cut the corpus finer")
        self._reader = read or (lambda fmt, root, unit: read_unit(fmt, root, unit))
        self.block_windows = batch_size * stream.block_batches
        """Windows per block (the shuffle buffer)."""
        # Token windows overlap by one token (the last target); a dataset's "windows" are single examples.
        self._stride, self._overlap = (1, 0) if stream.of_examples else (seq_len, 1)
        self.skipped: dict[str, int] = {}
        """Units skipped as unreadable, ``"name/epoch" -> estimated tokens``, each counted once per epoch."""
        self.bytes_read = 0
        """Bytes of token ids read so far (after tokenizing), over all units."""
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"island-{island}-data")
        self._ahead: dict[int, concurrent.futures.Future] = {}  # unit ordinal -> its read, in flight or done
        self._orders: dict[int, list[int]] = {}  # epoch -> positions of the island's units
        self._batch = 0  # island steps drawn
        self._block = -1  # number of the block in `_tokens`
        self._start = (0, 0)  # (unit ordinal, token) where block `_block` starts
        self._next_start = (0, 0)  # where the block after it starts
        self._tokens: np.ndarray | None = None  # block `_block`'s tokens: block_windows * T + 1
        self._order: np.ndarray | None = None  # its windows' permutation

    # -------------------------------------------------------------- the cursor

    @property
    def cursor(self) -> int:
        """Island steps drawn so far, which is also the number of the next one."""
        return self._batch

    @property
    def data_cursor(self) -> DataCursor:
        """Where the stream stands: the next batch and where its block starts."""
        block = self._batch * self.world // self.stream.block_batches
        # The next batch is in the block read last or the one after it (world <= block_batches).
        unit, offset = self._start if block == self._block else self._next_start
        return DataCursor(self._batch, unit, offset)

    def seek(self, cursor: DataCursor) -> None:
        """Resume at ``cursor`` (taken from this island's stream): the next batch drawn is ``cursor.batch``."""
        cursor = DataCursor.of(cursor)
        if cursor.batch < 0 or cursor.unit < 0 or cursor.offset < 0:
            raise ValueError(f"data cursor {tuple(cursor)} must be non-negative")
        self._batch = cursor.batch
        self._block = cursor.batch * self.world // self.stream.block_batches - 1
        self._next_start = (cursor.unit, cursor.offset)
        self._tokens = self._order = None
        for future in self._ahead.values():
            future.cancel()
        self._ahead.clear()

    def state_dict(self) -> dict:
        """The cursor (``cursor`` the batch count, ``data_cursor`` the whole position) and the island it belongs to."""
        return dict(cursor=self._batch, data_cursor=list(self.data_cursor), shard_index=self.island,
                    num_shards=self.num_shards)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output of this island's sampler."""
        if (state.get("shard_index"), state.get("num_shards")) != (self.island, self.num_shards):
            raise ValueError(f"sampler state is for island {state.get('shard_index')} of {state.get('num_shards')} but "
                             f"this is island {self.island} of {self.num_shards}; load it into that island's sampler")
        self.seek(DataCursor.of(state["data_cursor"]))

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens in one batch: ``batch_size * seq_len``."""
        return self.batch_size * self.seq_len

    # -------------------------------------------------------------- batches

    def next_batch(self):
        """This worker's batch of the next island step, as (x, y) LongTensors (B, T); advances the cursor."""
        n = self._batch * self.world + self.rank  # stream batch
        block, within = divmod(n, self.stream.block_batches)
        while self._block < block:
            self._advance()
        assert self._tokens is not None and self._order is not None
        windows = self._order[within * self.batch_size:(within + 1) * self.batch_size]  # (B,)
        self._batch += 1
        if self.stream.of_examples:
            return self._collate([self.stream.examples[int(i)] for i in self._tokens[windows]])
        return _windows(self._tokens, windows * self.seq_len, self.seq_len)

    @staticmethod
    def _collate(examples: list) -> Any:
        from torch.utils.data import default_collate  # lazily, as torch in islands.data

        return default_collate(examples)

    def _advance(self) -> None:
        """Read the next block: ``block_windows * T + 1`` tokens from where it starts; note where the next starts."""
        self._block += 1
        self._start = self._next_start
        advance = self.block_windows * self._stride
        tokens, self._next_start = self._take(self._start, advance + self._overlap, advance=advance)
        self._tokens = tokens
        self._order = block_permutation(self.block_windows, seed=self.seed, island=self.island, block=self._block) \
            if self.stream.shuffle else np.arange(self.block_windows)

    def _take(self, start: tuple[int, int], need: int, *, advance: int) -> tuple[np.ndarray, tuple[int, int]]:
        """``need`` tokens of the stream from ``start`` = (unit ordinal, token), and the position ``advance``
        tokens past ``start``."""
        pieces: list[np.ndarray] = []
        have = 0
        ordinal, offset = start
        end: tuple[int, int] | None = None
        empty_run = 0  # units in a row that gave nothing: a whole epoch of them means nothing can be read
        while have < need or end is None:
            ids = self._unit_ids(ordinal)
            if len(ids) <= offset:
                empty_run = empty_run + 1 if len(ids) == 0 else 0
                if empty_run >= len(self._units):
                    raise DataError(f"island {self.island}: none of its {len(self._units)} units gave a token "
                                    f"(skipped: {sorted(self.skipped)[:3]}); check data.path and the corpus")
                ordinal, offset = ordinal + 1, 0
                continue
            empty_run = 0
            part = ids[offset:]
            if end is None and have + len(part) > advance:
                end = (ordinal, offset + advance - have)
            if have < need:
                pieces.append(part[:need - have])
                have += len(pieces[-1])
            ordinal, offset = ordinal + 1, 0
        return np.concatenate(pieces), end

    # -------------------------------------------------------------- units

    def unit_at(self, ordinal: int) -> Unit:
        """The unit at ``ordinal`` of the island's sequence (epoch ``ordinal // units``)."""
        return self.stream.units[self._index_at(ordinal)]

    def _index_at(self, ordinal: int) -> int:
        """Index in ``stream.units`` of the unit at ``ordinal`` of the island's sequence."""
        epoch, position = divmod(ordinal, len(self._units))
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(len(self._units), seed=self.seed, island=self.island, epoch=epoch,
                                shuffle=self.stream.shuffle)
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
            if epoch & (epoch - 1) == 0 and epoch:  # epochs 1, 2, 4, 8...: a small dataset turns over quickly
                log.info("island %d starts epoch %d over its %d units", self.island, epoch, len(self._units))
        return self._units[order[position]]

    def _unit_ids(self, ordinal: int) -> np.ndarray:
        """The ids of unit ``ordinal`` (empty if it cannot be read: logged and counted once), reading ahead."""
        for k in range(ordinal, ordinal + 1 + self.stream.readahead):
            if k not in self._ahead:
                self._ahead[k] = self._pool.submit(self._read, self._index_at(k))
        for k in [k for k in self._ahead if k < ordinal]:
            self._ahead.pop(k).cancel()
        try:
            ids = self._ahead[ordinal].result()
        except UnitError as err:
            key = f"{self.unit_at(ordinal).name}/{ordinal // len(self._units)}"
            if key not in self.skipped:
                self.skipped[key] = self.unit_at(ordinal).tokens
                log.warning("island %d skips %s", self.island, err)
            return np.zeros(0, dtype=np.int64)
        return ids

    def _read(self, index: int) -> np.ndarray:
        """Read unit ``index`` of the stream (on the read-ahead thread): a dataset's unit is its range of example
        indices, a token array's its part of the array, a corpus's what the unit's files hold."""
        unit = self.stream.units[index]
        kind = self.stream.fmt.kind
        if kind == "examples":
            reads = getattr(self.stream.examples, "read_unit", None)
            if reads is not None:  # a unit the island reads itself (a Ray Data read task): (unit << 32) + row
                return (np.int64(unit.start) << 32) + np.arange(reads(unit.start), dtype=np.int64)
            return np.arange(unit.start, unit.start + unit.count, dtype=np.int64)
        ids = _fetch(self.stream.payloads[index]) if kind == "memory" else self._reader(self.stream.fmt, self.root, unit)
        self.bytes_read += ids.nbytes
        return ids

    def close(self) -> None:
        """Stop reading ahead (the thread ends after the read in flight)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def batch_at(self, cursor: int) -> Any:
        """Not supported: a stream is read forward (use :meth:`next_batch`, :meth:`seek`)."""
        raise TypeError("a StreamSampler reads forward only; seek() to a DataCursor and call next_batch()")
