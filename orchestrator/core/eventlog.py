"""The run directory's event log: Parquet part files per event kind, written as the run goes.

Layout: `RUN_DIR/events/<kind>/part-00000.parquet`, ... with kind in `rounds`, `refusals`, `evals`,
`islands` (final status of every incarnation), `timeline` (island state transitions), `faults`
(injected faults), `detections` (each failure the health monitor acted on, with its reason) and
`salvages` (a dead incarnation's progress handed from its keeper to the outer optimizer). Part files (not one
file rewritten) so a crash loses at most the last unflushed batch, and
`read_events` reads a whole kind back as one Arrow table.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

KINDS = ("rounds", "refusals", "evals", "islands", "timeline", "faults", "detections", "salvages")


def _row(item: Any) -> dict[str, Any]:
    return dataclasses.asdict(item) if dataclasses.is_dataclass(item) and not isinstance(item, type) else dict(item)


class EventLog:
    """Buffers rows per kind and flushes them as numbered Parquet part files."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / "events"
        self._rows: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
        self._parts: dict[str, int] = {}
        self._lock = threading.Lock()
        for kind in KINDS:
            d = self.root / kind
            d.mkdir(parents=True, exist_ok=True)
            # Continue numbering after existing parts (a resumed run appends, never overwrites).
            self._parts[kind] = len(list(d.glob("part-*.parquet")))

    def add(self, kind: str, items: Iterable[Any]) -> None:
        """Queue rows (dataclasses or dicts) of one kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; use one of {', '.join(KINDS)}")
        rows = [_row(i) for i in items]
        with self._lock:
            self._rows[kind].extend(rows)

    def flush(self) -> None:
        """Write every non-empty buffer as a new part file (atomically: temp name, then rename)."""
        with self._lock:
            pending = {k: rows for k, rows in self._rows.items() if rows}
            self._rows = {k: [] for k in KINDS}
        for kind, rows in pending.items():
            table = pa.Table.from_pylist(rows)
            n = self._parts[kind]
            self._parts[kind] = n + 1
            final = self.root / kind / f"part-{n:05d}.parquet"
            tmp = final.with_suffix(".parquet.tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, final)


def read_events(run_dir: str | Path, kind: str) -> pa.Table:
    """All rows of one event kind in a run directory, as an Arrow table (empty table if none)."""
    if kind not in KINDS:
        raise ValueError(f"unknown event kind {kind!r}; use one of {', '.join(KINDS)}")
    d = Path(run_dir) / "events" / kind
    files = sorted(d.glob("part-*.parquet")) if d.is_dir() else []
    if not files:
        return pa.table({})
    # Parts written by an older version of the code (a resumed run) may lack newer columns: concatenating
    # with promotion keeps every column, null where a part has none (each file is read once).
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
