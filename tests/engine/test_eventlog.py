"""The event log reads back every column of every part, also when parts differ in columns."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.core.eventlog import EventLog, read_events


@dataclass
class Row:
    fragment: int
    version: int


def test_parts_round_trip(tmp_path):
    log = EventLog(tmp_path)
    log.add("rounds", [Row(0, 1), Row(1, 1)])
    log.flush()
    log.add("rounds", [Row(0, 2)])
    log.flush()
    assert read_events(tmp_path, "rounds").to_pylist() == [
        {"fragment": 0, "version": 1}, {"fragment": 1, "version": 1}, {"fragment": 0, "version": 2}]


def test_a_column_added_by_a_later_part_is_kept(tmp_path):
    # A run resumed under a newer version appends parts with columns the older parts lack (rda_factor).
    d = tmp_path / "events" / "rounds"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"version": [1]}), d / "part-00000.parquet")
    pq.write_table(pa.table({"version": [2], "rda_factor": [1.25]}), d / "part-00001.parquet")
    assert read_events(tmp_path, "rounds").to_pylist() == [
        {"version": 1, "rda_factor": None}, {"version": 2, "rda_factor": 1.25}]
