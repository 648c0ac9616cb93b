"""DataCursor: where an island's data stream stands, the value that makes resumes exact.

An island's stream is a pure function of the run's data plan (policies/data_plan.py): its units in a
seeded order, epoch after epoch, cut into windows, the windows shuffled in blocks. The cursor names the
next batch to draw: ``batch`` counts the island steps drawn so far, and ``(unit, offset)`` is where the
block holding that batch starts: ``unit`` is the ordinal in the island's unit sequence (epoch ``e``,
position ``p`` is ordinal ``e * units + p``) and ``offset`` the token within that unit. A restarted
island seeks there, rebuilds the block and skips to the batch: no token before it is read again.

Cursors order by ``batch`` (the tuple's first field): of two cursors of one island, the later one drew
more batches. Samplers without positions (a map-style dataset of examples) use ``unit = offset = 0``.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class DataCursor(NamedTuple):
    """The next batch an island draws: ``batch`` island steps drawn; its block starts at ``(unit, offset)``."""

    batch: int = 0
    """Island steps drawn so far, which is also the number of the next one."""
    unit: int = 0
    """Ordinal, in the island's unit sequence across epochs, of the unit where the next batch's block starts."""
    offset: int = 0
    """Token of that unit (after tokenizing, held-out rows left out) where the block starts."""

    @classmethod
    def of(cls, value: Any) -> DataCursor:
        """A cursor from what checkpoints, events and older runs hold: a cursor, a list ``[batch, unit, offset]``,
        an int (a batch count: runs written before data units), or None (nothing drawn)."""
        if value is None:
            return cls()
        if isinstance(value, DataCursor):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(batch=value)
        if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, int) for v in value):
            return cls(*value)
        raise ValueError(f"data cursor {value!r} is not [batch, unit, offset]; it comes from a damaged checkpoint")

    def __str__(self) -> str:
        return f"batch {self.batch} (unit {self.unit}, token {self.offset})"
