"""Salvage: what of a dead island's unsubmitted progress may still be merged.

An island cuts fragment p into a submission only every H steps, so a kill used to lose about H/2
steps of work per fragment (the structural cost of a failure, README "Chaos"). With
`health.salvage_every_steps = n`, every n inner steps the island leaves a snapshot of that progress
(each fragment's outer gradient since its last cut, in the wire format) with its pool's keeper, a
small process outside the island's failure domain. When the island dies, the health monitor hands
the latest snapshot to the outer optimizer, which merges what is still valid; the kill then costs
about n/2 steps instead of H/2.

A snapshot is only valid where nothing newer covers the same steps. These rules decide that, without
Ray or tensors:

- a fragment the island cut again after the snapshot (the outer optimizer took a submission of it
  with seq >= the snapshot's `next_seq`) is already covered by that submission: skipped;
- a fragment whose base came from an outer optimizer that has since restarted (another epoch) was
  discarded by the resync: skipped;
- the rest are renumbered after every seq the outer optimizer has seen from that incarnation, so a
  salvaged submission never shares a key with a real one, and marked `salvaged`: the outer optimizer
  takes them even once the slot's next incarnation is live (an emulated uplink can deliver them late).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ProgressSnapshot", "Salvaged", "salvage_due", "salvageable"]


@dataclass
class ProgressSnapshot:
    """One island incarnation's unsubmitted progress at a step boundary.

    `submissions` holds one not-yet-cut submission per fragment with progress (islands.messages.Submission,
    seq not final); `next_seq` is the seq the island's next real cut would have had; `epochs[p]` is the
    epoch of the outer optimizer that sent the base fragment p's progress is measured from.
    """

    island: int
    incarnation: int
    next_seq: int
    epochs: list[int]
    step: int  # the island's inner-step count when the snapshot was taken
    submissions: list[Any]


@dataclass
class Salvaged:
    """The outcome of `salvageable`: submissions to merge and, per skipped fragment, why."""

    submissions: list[Any]
    skipped: dict[int, str]


def salvage_due(steps: int, every: int) -> bool:
    """Whether an island that has taken `steps` inner steps leaves a snapshot now (`every` <= 0: never)."""
    return every > 0 and steps > 0 and steps % every == 0


def salvageable(snapshot: ProgressSnapshot, *, taken: dict[int, int], epoch: int) -> Salvaged:
    """Which of `snapshot`'s submissions the outer optimizer (at `epoch`) may still merge.

    `taken` maps fragment -> the highest seq the outer optimizer took of that fragment from this
    incarnation. Salvaged submissions get seqs above every seq taken and the snapshot's own.
    """
    keep: list[Any] = []
    skipped: dict[int, str] = {}
    for sub in snapshot.submissions:
        p = sub.fragment
        if sub.island != snapshot.island or sub.incarnation != snapshot.incarnation:
            raise ValueError(f"snapshot of island {snapshot.island}/{snapshot.incarnation} holds a submission of "
                             f"{sub.island}/{sub.incarnation}; a snapshot holds one incarnation's progress")
        if not 0 <= p < len(snapshot.epochs):
            skipped[p] = f"fragment {p} out of range"
        elif snapshot.epochs[p] != epoch:
            skipped[p] = f"its base is from outer epoch {snapshot.epochs[p]}, now {epoch} (discarded by the resync)"
        elif taken.get(p, -1) >= snapshot.next_seq:
            skipped[p] = f"cut again after the snapshot (seq {taken[p]} >= {snapshot.next_seq})"
        else:
            keep.append(sub)
    first = max(max(taken.values(), default=-1) + 1, snapshot.next_seq)
    return Salvaged([replace(sub, seq=first + j, salvaged=True) for j, sub in enumerate(keep)], skipped)

