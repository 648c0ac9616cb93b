"""What travels between an island and the outer optimizer: submissions up, fragment updates down.

Both are plain dataclasses that pickle cleanly through Ray. Tensors in a `Submission` are the
(compressed) outer gradient of one fragment; a `FragmentUpdate` carries the new global fragment as a
list-wrapped object ref, so the receiver decides when to fetch it and the publisher puts it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from islands.cursor import DataCursor

if TYPE_CHECKING:  # a type only: holders of messages (the health monitor) need not import torch
    from policies.compression import Compressed


@dataclass(frozen=True)
class SubmissionKey:
    """Identifies one submission: which island slot, which incarnation of it, its k-th submission."""

    island: int
    incarnation: int
    seq: int


@dataclass
class Submission:
    """One island's outer gradient for one fragment: delta = base[p] - theta[p] (docs/architecture.md section 2)."""

    island: int
    incarnation: int
    seq: int  # the island's k-th submission; fragment = seq mod P
    fragment: int
    base_version: int  # version of the fragment the delta is measured from
    tokens: int  # tokens processed since the island's previous submission of this fragment
    inner_steps: int  # inner steps in the same span
    step_time_s: float  # moving average of the island's wall time per inner step
    train_loss: float  # moving average of the inner training loss (nats per token)
    payload: list[Compressed]  # one entry per tensor of the fragment, in fragment order
    created_at: float = 0.0  # wall clock (time.time) when the island cut it
    compute_s: float = 0.0  # wall time of the inner steps this submission covers (goodput's useful time)
    cursor: DataCursor = DataCursor()  # the island's data cursor (islands/cursor.py) when it cut this submission
    salvaged: bool = False  # progress of a dead incarnation, handed on from its keeper (policies/salvage.py)
    base_epoch: int = -1  # epoch of the outer optimizer that sent the base (its restart count; -1: none adopted)
    # policies.base_check.fragment_digest of the base the delta is measured from (None: not told, e.g. an FSDP island,
    # whose workers hold parts of it): the outer optimizer checks it against what it published as base_version.
    base_digest: str | None = None
    # The highest fragment version this incarnation started from (0: with the run, before any outer step). One that
    # started mid-run starts from the global parameters with no progress of its own, and its first cuts align less
    # with the outer momentum than the others': the poison guard does not read its direction as beyond doubt.
    started_at_version: int = 0

    @property
    def key(self) -> SubmissionKey:
        """The (island, incarnation, seq) identity of this submission."""
        return SubmissionKey(self.island, self.incarnation, self.seq)

    @property
    def nbytes(self) -> int:
        """Bytes of outer gradient on the wire (payload and quantization scales)."""
        return sum(c.nbytes for c in self.payload)


@dataclass(frozen=True)
class FragmentUpdate:
    """A published version of one fragment and which submissions it resolved.

    `tensors` is `[ref]` in Ray runs (the receiver resolves it) or `[list_of_tensors]` in process.
    `merged` lists the submissions that went into this version; `refused` lists submissions that were
    refused since the previous update to their island, so the island can stop tracking them.
    With `delta_from` set, the tensors are the difference from the island's copy of version
    `delta_from` (outer.downlink_delta, policies/downlink.py), valid only on top of a copy that came
    from the outer optimizer of the same `epoch` (its restart count). `progress` is the run's tokens
    processed / token budget as the outer optimizer last heard it (None: not known), which a decaying
    inner learning rate follows (policies/lr_schedule.py).
    """

    fragment: int
    version: int
    tensors: list[Any]
    merged: tuple[SubmissionKey, ...] = ()
    refused: tuple[SubmissionKey, ...] = field(default_factory=tuple)
    epoch: int = 0
    delta_from: int | None = None
    progress: float | None = None
