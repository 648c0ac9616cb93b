"""Rounds: the open round of each fragment, and what the outer optimizer records for each round and refusal.

`OpenRound` is one fragment's round while it collects submissions, `RoundRecord` one merged round as
the event log keeps it, `Refusal` one refused submission, `RoundResult` a new global version of one
fragment for the shell to publish.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from islands.cursor import DataCursor
from islands.messages import Submission, SubmissionKey
from policies.compression import Compressed


class Pending(NamedTuple):
    """One accepted submission waiting for its round (a plain 3-tuple of the first fields is accepted too)."""

    sub: Submission
    staleness: int
    deltas: list[torch.Tensor | Compressed]  # per tensor: float32 values, or an int8/int4 wire tensor
    norms: list[float | None] | None = None  # per tensor: its norm when the submission check computed it


@dataclass
class OpenRound:
    """One fragment's round while it collects submissions (policies.quorum decides when it closes)."""

    opened_at: float  # the optimizer's clock when the round opened (the previous one closed)
    pending: list[Pending] = field(default_factory=list)  # accepted submissions, in arrival order
    # The islands whose pending submissions vote toward the quorum (OuterOptimizer._pending_islands).
    voters: set[int] = field(default_factory=set)
    quorum_at: float | None = None  # when the quorum was reached; None: not yet
    grace_s: float = 0.0  # grace window granted at quorum (kept until the next quorum sets it again)
    refused: list[SubmissionKey] = field(default_factory=list)  # refused at its close, for the islands to hear of

    def clear(self) -> None:
        """Drop the pending submissions and their votes; the round waits for a new quorum."""
        self.pending = []
        self.refused = []
        self.voters = set()
        self.quorum_at = None


@dataclass
class RoundRecord:
    """One merged round, as it goes to the event log."""

    fragment: int
    version: int
    participants: list[int]
    incarnations: list[int]
    seqs: list[int]
    weights: list[float]
    staleness: list[int]
    tokens: int
    inner_steps: int
    bytes: int
    quorum_s: float  # round open -> quorum reached
    grace_s: float  # grace window granted at quorum
    wait_s: float  # round open -> close
    merge_s: float  # decompress + merge + outer step
    reason: str
    step_scale: float = 1.0  # the factor on the merged outer gradient (policies.outer_optimizer.round_step_scale)
    rda_factor: float = 1.0  # RdaAcrossRounds' lengthening of the outer gradient, size-weighted mean over tensors
    wall_time: float = field(default_factory=time.time)
    # Per submission: the island's data cursor at its cut, and whether a keeper salvaged it: with the
    # incarnations, what an audit of exact data resume needs (which batches reached the global model).
    cursors: list[int] = field(default_factory=list)
    salvaged: list[bool] = field(default_factory=list)

    @classmethod
    def of(cls, fragment: int, version: int, subs: Sequence[Submission], *, weights: list[float],
           staleness: list[int], quorum_s: float, grace_s: float, wait_s: float, merge_s: float, reason: str,
           step_scale: float, rda_factor: float) -> RoundRecord:
        """The record of a round that merged `subs` (in their order) into `version` of `fragment`."""
        return cls(
            fragment=fragment, version=version, participants=[s.island for s in subs],
            incarnations=[s.incarnation for s in subs], seqs=[s.seq for s in subs], weights=list(weights),
            staleness=staleness, tokens=sum(s.tokens for s in subs), inner_steps=sum(s.inner_steps for s in subs),
            bytes=sum(s.nbytes for s in subs), quorum_s=quorum_s, grace_s=grace_s, wait_s=wait_s, merge_s=merge_s,
            reason=reason, step_scale=step_scale, rda_factor=rda_factor,
            cursors=[DataCursor.of(s.cursor).batch for s in subs], salvaged=[s.salvaged for s in subs],
        )


@dataclass
class Refusal:
    """A refused submission, as it goes to the event log."""

    island: int
    incarnation: int
    seq: int
    fragment: int
    tokens: int
    reason: str
    wall_time: float = field(default_factory=time.time)
    cursor: int = 0  # the island's data cursor at the cut: its batches never reach the global model

    @property
    def key(self) -> SubmissionKey:
        """The refused submission's identity."""
        return SubmissionKey(self.island, self.incarnation, self.seq)


@dataclass
class RoundResult:
    """A new global version of one fragment for the shell to publish to every live island."""

    fragment: int
    version: int
    # A private copy, safe to hand to the object store; or, from an OuterOptimizer built with copy_results=False,
    # the live global tensors, valid only until the optimizer's next call (the actor puts them at once).
    tensors: list[torch.Tensor]
    merged: tuple[SubmissionKey, ...]
    record: RoundRecord
    refused: tuple[SubmissionKey, ...] = ()  # refused when the round closed (the poison guard's first round)
