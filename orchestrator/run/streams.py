"""The run's corpus as the driver knows it: an index of units, the plan that gives islands their units, and a
bounded held-out sample. No training token passes through here (docs/data.md).

:func:`corpus_stream` builds, from the config and metadata only, the :class:`islands.stream.TokenStream` the
islands read (each its own units, each pool from its own copy) and reads the held-out sample evaluation
uses (at most ``data.heldout_tokens``). Before it returns, every pool's copy is indexed and compared with
the first: copies that differ, a path that does not exist, storage that cannot be reached are one-line
DataErrors, raised before Ray starts.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from islands.corpus import (
    CorpusFormat,
    CorpusIndex,
    Unit,
    UnitError,
    UnitTable,
    _split_largest,
    held_out_by_name,
    heldout_sample,
    index_parquet,
    index_stdlib,
    index_token_files,
    read_texts,
    read_unit,
    shown_path,
)
from islands.data import DataError, token_id_range
from islands.stream import TokenStream
from orchestrator.config import RunConfig
from policies.data_plan import assign_units, copies_differ

log = logging.getLogger(__name__)

DEFAULT_TRAINED_VOCAB = 4096
"""The vocabulary a tokenizer trained on the corpus gets when data.vocab_size is unset."""
TOKENIZER_FILE = "tokenizer.json"
"""Where a run directory keeps the tokenizer its text was encoded with (sample and evaluate decode with it)."""


@dataclass
class CorpusPlan:
    """What :func:`corpus_stream` returns: the islands' stream, the held-out sample and what describes them."""

    stream: TokenStream
    heldout: np.ndarray
    vocab_size: int
    source: str
    encoder: Any  # the islands.tokenizer.TextEncoder text is encoded with; None for bytes and token ids
    index: CorpusIndex


def corpus_index(cfg: RunConfig, path: str | None = None) -> CorpusIndex:
    """The config's corpus (or the copy at ``path``) as units, from metadata only. Raises DataError (one line)."""
    d = cfg.data
    islands = cfg.num_islands
    if d.source == "stdlib":
        root, units, files = index_stdlib(heldout_fraction=d.heldout_fraction, max_bytes=d.max_bytes,
                                          shuffle=d.shuffle_documents, minimum_units=islands)
        fmt = CorpusFormat("stdlib", is_text=True, heldout_fraction=d.heldout_fraction)
        size = sum(u.count for u in units)
        order = "shuffled" if d.shuffle_documents else "sorted"
        source = (f"Python {platform.python_version()} standard library source ({files} files, {size / 1e6:.1f} MB; "
                  f"{sum(bool(u.heldout) for u in units)} files held out; files {order})")
    elif d.source == "tokens":
        assert d.path is not None
        root, units, total = index_token_files(path or d.path, dtype=d.token_dtype, unit_tokens=d.unit_tokens,
                                               heldout_fraction=d.heldout_fraction, minimum_units=islands + 1)
        fmt = CorpusFormat("tokens", is_text=False, dtype=d.token_dtype, heldout_fraction=d.heldout_fraction,
                           vocab_size=d.vocab_size)
        source = (f"{shown_path(path or d.path)} ({total:,} {d.token_dtype} tokens in {len(units)} units, "
                  f"{sum(bool(u.heldout) for u in units)} held out)")
    elif d.source == "parquet":
        assert d.path is not None
        is_text = d.text_column is not None
        column = d.text_column if is_text else d.token_column
        assert column is not None
        root, units, rows = index_parquet(path or d.path, column=column, is_text=is_text, minimum_units=islands)
        fmt = CorpusFormat("parquet", column=column, is_text=is_text, heldout_fraction=d.heldout_fraction,
                           shuffle_rows=d.shuffle_documents, vocab_size=d.vocab_size if not is_text else None)
        order = "shuffled" if d.shuffle_documents else "in file order"
        source = f"{shown_path(path or d.path)} column {column!r} ({rows:,} rows in {len(units)} units; rows {order})"
    else:
        raise DataError(f"data.source {d.source!r} is not a corpus; pass datasets to the Python API")
    return CorpusIndex(fmt=fmt, root=root, units=tuple(units), source=source)


def check_copies(cfg: RunConfig, index: CorpusIndex) -> dict[str, str]:
    """Pool -> the root of its own copy (pools.NAME.data_path), each indexed and compared with the corpus's units.

    Raises DataError naming the pool and the first difference: a copy must hold the same units (names and
    sizes), or its islands would read other data than the plan gave them."""
    roots: dict[str, str] = {}
    for pool in cfg.pools:
        if pool.data_path is None:
            continue
        if cfg.data.source not in ("parquet", "tokens"):
            raise DataError(f"pools.{pool.name}.data_path is set but data.source is '{cfg.data.source}'; copies are "
                            f"for parquet or token-file corpora: drop it")
        copy = corpus_index(cfg, pool.data_path)
        difference = copies_differ(_files(index), _files(copy)) or copies_differ(index.keys(), copy.keys())
        if difference is not None:
            raise DataError(f"pools.{pool.name}.data_path={shown_path(pool.data_path)!r} is not a copy of data.path="
                            f"{shown_path(cfg.data.path or '')!r}: "
                            f"{difference}; copy the same files there (docs/data.md, one copy per region)")
        roots[pool.name] = copy.root
    return roots


def _files(index: CorpusIndex) -> list[tuple[str, int]]:
    """(file, its units' estimated tokens) in index order: copies are compared file by file first, so a message
    names the file that differs rather than a unit cut from it."""
    totals: dict[str, int] = {}
    for u in index.units:
        totals[u.path] = totals.get(u.path, 0) + u.tokens
    return list(totals.items())


def corpus_stream(cfg: RunConfig, run_dir: str | Path | None = None) -> CorpusPlan:
    """The run's corpus as a plan (module docstring). A resumed run (``run_dir`` holds a tokenizer.json) encodes
    with the tokenizer it saved; ``tokenizer: train`` trains one on ``data.tokenizer_sample_bytes`` of text."""
    d = cfg.data
    index = corpus_index(cfg)
    roots = check_copies(cfg, index)
    encoder = _encoder(cfg, index, run_dir) if index.fmt.is_text else None
    index = index.with_encoder(encoder)
    vocab = _vocab_size(cfg, index, encoder)
    if index.fmt.kind == "parquet" and not index.fmt.is_text:
        index = replace(index, fmt=replace(index.fmt, vocab_size=vocab))
    train = index.train_units()
    try:
        stream = _stream(cfg, index.fmt, [index.units[u] for u in train], index.source, root=index.root, roots=roots)
    except ValueError:
        raise DataError(f"the corpus at {shown_path(index.root)} cuts into {len(train)} training unit(s), too few for {cfg.num_islands} "
                        f"islands that each read units of their own: add rows or files, or train fewer islands "
                        f"(pools.NAME.islands)") from None
    heldout = heldout_sample(index, max_tokens=d.heldout_tokens)
    name = "" if encoder is None else f"; tokenized in the islands with {encoder.name} (vocab {vocab})"
    log.info("data plan: %d training units over %d islands, %d held-out tokens read", len(train), cfg.num_islands, len(heldout))
    return CorpusPlan(stream=stream, heldout=heldout, vocab_size=vocab, source=index.source + name, encoder=encoder,
                      index=index)


def _vocab_size(cfg: RunConfig, index: CorpusIndex, encoder: Any) -> int:
    """Bytes: 256; a tokenizer's; token files: data.vocab_size; a token column: data.vocab_size, else from statistics."""
    d = cfg.data
    if index.fmt.is_text:
        return 256 if encoder is None else int(encoder.vocab_size)
    if d.vocab_size is not None:
        return d.vocab_size
    assert d.path is not None and d.token_column is not None
    span = token_id_range(d.path, d.token_column)
    if span is None:
        raise DataError(f"{d.path!r} column {d.token_column!r} keeps no min/max statistics to take the vocabulary from; "
                        f"set data.vocab_size to your tokenizer's vocabulary")
    if span[0] < 0:
        raise DataError(f"{d.path!r} column {d.token_column!r} holds negative token ids (down to {span[0]}); fix the ids")
    return span[1] + 1


def _encoder(cfg: RunConfig, index: CorpusIndex, run_dir: str | Path | None) -> Any:
    """The TextEncoder of data.tokenizer (None: bytes as they are): a resumed run's saved one, or trained on a
    sample of the training units, loaded, or wrapped."""
    from islands.tokenizer import TokenizersEncoder, text_encoder, train_tokenizer

    d = cfg.data
    saved = Path(run_dir) / TOKENIZER_FILE if run_dir is not None else None
    if saved is not None and saved.is_file():
        encoder = text_encoder(str(saved), vocab_size=d.vocab_size)
        return None if type(encoder).__name__ == "ByteEncoder" else encoder
    if d.tokenizer == "bytes":
        return None
    if d.tokenizer == "train":
        vocab = d.vocab_size or DEFAULT_TRAINED_VOCAB
        texts = sample_texts(index, max_bytes=d.tokenizer_sample_bytes)
        return TokenizersEncoder(train_tokenizer(texts, vocab),
                                 origin=f"trained on {sum(map(len, texts)) / 1e6:.1f} MB of the training split (vocab {vocab})")
    return text_encoder(d.tokenizer, vocab_size=d.vocab_size)


def sample_texts(index: CorpusIndex, *, max_bytes: int) -> list[str]:
    """Training documents, read unit by unit in index order until ``max_bytes`` of text (for a tokenizer)."""
    texts: list[str] = []
    have = 0
    for u in index.train_units():
        if have >= max_bytes:
            break
        try:
            docs = read_texts(index.fmt, index.root, index.units[u])
        except UnitError as err:
            log.warning("tokenizer sample: %s; training the tokenizer without it", err)
            continue
        texts.extend(docs)
        have += sum(len(t) for t in docs)
    if not texts:
        raise DataError(f"no training text could be read from {shown_path(index.root)} to train a tokenizer; check data.path")
    return texts


def loss_unit(heldout: Any) -> str:
    """What a run's losses are per: "byte" where the held-out tokens are text read as bytes (uint8 ids, a token IS
    a byte: islands.corpus), else "token"."""
    return "byte" if isinstance(heldout, np.ndarray) and heldout.dtype == np.uint8 else "token"


def heldout_unigram_bits(heldout: np.ndarray, vocab_size: int) -> float:
    """The unigram baseline of a streamed corpus, whose training tokens the driver never reads: an add-one unigram
    fitted on the first half of the held-out sample, scored on the second (islands.data.unigram_bits_per_byte)."""
    from islands.data import unigram_bits_per_byte

    half = len(heldout) // 2
    return unigram_bits_per_byte(heldout[:half], heldout[half:], vocab_size=vocab_size)


def _units_of(name: str, count: int, size: int, islands: int) -> list[Unit]:
    """Units of ``size`` items over ``count`` items of Python data named ``name``, halved until every island has one."""
    units = [Unit(f"{name}@{start}", name, -1, start, min(size, count - start), min(size, count - start), False)
             for start in range(0, count, size)]
    return _split_largest(units, islands)


def _stream(cfg: RunConfig, fmt: CorpusFormat, units: list[Unit], source: str, *, root: str = "python",
            **data: Any) -> TokenStream:
    """The data plan of training ``units``: spread over the islands (policies/data_plan.py), read with the config's
    shuffling, block size and read-ahead. Raises ValueError when there are fewer units than islands."""
    d = cfg.data
    assignment = assign_units([u.tokens for u in units], cfg.num_islands, seed=cfg.run.seed, shuffle=d.shuffle_documents)
    return TokenStream(fmt=fmt, root=root, units=UnitTable(units), assignment=tuple(tuple(a) for a in assignment),
                       shuffle=d.shuffle_documents, block_batches=d.block_batches, readahead=d.readahead_units,
                       source=source, **data)


def array_stream(cfg: RunConfig, ids: np.ndarray, source: str) -> TokenStream:
    """A token array from the Python API as a stream: units of ``data.unit_tokens`` ids, each its own object in
    Ray's object store once the run starts (TokenStream.with_refs), so each island fetches only its own."""
    if len(ids) < cfg.num_islands:
        raise DataError(f"the token array has {len(ids)} ids, fewer than the {cfg.num_islands} islands; pass more data")
    units = _units_of("array", len(ids), cfg.data.unit_tokens, cfg.num_islands)
    return _stream(cfg, CorpusFormat("memory", is_text=False), units, source,
                          payloads=tuple(ids[u.start:u.start + u.count] for u in units))


def examples_stream(cfg: RunConfig, dataset: Any, source: str) -> TokenStream:
    """A map-style dataset from the Python API as a stream: units are ranges of its indices (a Ray Data dataset's
    own blocks, so an island fetches only the blocks it reads), a batch is ``data.batch_size`` collated examples."""
    n = len(dataset)
    if n < cfg.num_islands:
        raise DataError(f"the dataset has {n} examples, fewer than the {cfg.num_islands} islands; every island needs "
                        f"examples of its own: pass more data or train fewer islands (pools.NAME.islands)")
    rows = getattr(dataset, "block_rows", None)
    if rows is not None:  # islands.ray_source.RayDatasetExamples: a unit per block
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).tolist()
        units = _split_largest([Unit(f"block@{s}", "block", -1, s, r, r, False) for s, r in zip(starts, rows) if r],
                               cfg.num_islands)
    else:
        units = _units_of("examples", n, cfg.data.unit_examples, cfg.num_islands)
    return _stream(cfg, CorpusFormat("examples", is_text=False), units, source, examples=dataset)


def reads_stream(cfg: RunConfig, reads: Any, source: str, *, hold_out: bool) -> tuple[TokenStream, list | None]:
    """A Ray Data dataset that is one read (islands.ray_source.RayDataReads) as a stream: each read task a unit,
    run by the island it belongs to. With ``hold_out`` (no validation dataset given) whole read tasks are held out
    by a stable hash of their number (the last if none is picked), and the driver reads held-out rows until it has
    what evaluation scores; returns (stream, those examples or None)."""
    names = [f"read@{k}" for k in range(len(reads.tasks))]
    held = held_out_by_name(names, cfg.data.heldout_fraction) if hold_out else [False] * len(names)
    units = [Unit(n, "read", -1, k, rows if rows is not None else -1, max(1, rows or 1), h)
             for k, (n, rows, h) in enumerate(zip(names, reads.rows, held))]
    train = [u for u in units if not u.heldout]
    if len(train) < cfg.num_islands:
        raise DataError(f"the Ray dataset reads in {len(reads.tasks)} task(s), too few for {cfg.num_islands} islands and "
                        f"held-out data; give it more files, or train fewer islands (pools.NAME.islands)")
    stream = _stream(cfg, CorpusFormat("examples", is_text=False), train, source, examples=reads)
    if not hold_out:
        return stream, None
    want, examples = cfg.eval.batches * cfg.eval.batch_size, []
    for u in (u for u in units if u.heldout):
        rows = reads.read_unit(u.start)
        examples += [reads[(u.start << 32) + r] for r in range(min(rows, want - len(examples)))]
        if len(examples) >= want:
            break
    if not examples:
        raise DataError("the Ray dataset's held-out read tasks gave no rows; pass datasets={'validation': ...}")
    return stream, examples


def read_all_training(index: CorpusIndex) -> np.ndarray:
    """Every training token of the corpus in one array, units in index order: the in-memory form that only the
    data-parallel baseline still takes (it reads the whole corpus)."""
    pieces = []
    for u in index.train_units():
        try:
            pieces.append(read_unit(index.fmt, index.root, index.units[u]))
        except UnitError as err:
            log.warning("skipping %s", err)
    if not pieces:
        raise DataError(f"no training token could be read from {shown_path(index.root)}; check data.path")
    return np.concatenate(pieces)
