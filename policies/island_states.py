"""The states of an island, in one place: what an island reports, and what the health monitor keeps per slot.

`IslandState` is a `str` Enum: each member equals its value (`IslandState.BLOCKED == "blocked"`) and
prints, formats and serializes (JSON, the event log, summary.json, status output) as that value, so
the strings the run's files and dashboards read are the ones they always were. It lives in policies/,
the lowest layer, because the pure policies (health verdicts, goodput) read states too and import
nothing above them (docs/architecture.md section 4).

Two vocabularies share it:

- What an island's inner loop reports in its status (islands/island.py, islands/follower.py):
  `REPORTED`, from `STARTING` through `TRAINING` or `BLOCKED` to `STOPPED`, or to `FAILED` or `DIVERGED`
  (`ENDED_BADLY`).
- What the health monitor records for a slot on its timeline (orchestrator/actors/slots.py,
  recovery_record.py): also `DEAD`, `RESTARTING`, `REINTEGRATING`, `LEAVING` and `VACANT`
  (policies/goodput.py `TIMELINE_STATES` says what each one means for goodput).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ENDED_BADLY", "REPORTED", "IslandState"]


class IslandState(str, Enum):
    """One state of an island or of its slot; equal to, and written as, its lower-case value."""

    STARTING = "starting"  # a first start, until the first step
    TRAINING = "training"
    BLOCKED = "blocked"  # waiting for a round (synchronous modes): not a hang
    STOPPED = "stopped"  # stopped on request
    DIVERGED = "diverged"  # the inner loop saw a non-finite loss
    FAILED = "failed"  # the inner loop raised
    DEAD = "dead"  # slot: its incarnation failed and is gone
    RESTARTING = "restarting"  # slot: a start after a failure (or a vacancy), until placed
    REINTEGRATING = "reintegrating"  # slot: placed again, until its first step
    LEAVING = "leaving"  # slot: its node is drained, the island flushes its progress
    VACANT = "vacant"  # slot: an elastic slot with no room in its pool

    # Python 3.11 and 3.12 print a mixed-in Enum as "IslandState.BLOCKED"; every reader of the run's
    # files and logs expects the bare value, so str() and format() give the value on every version.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


REPORTED = (IslandState.STARTING, IslandState.TRAINING, IslandState.BLOCKED, IslandState.STOPPED,
            IslandState.DIVERGED, IslandState.FAILED)
"""The states an island reports in its status (`IslandStatus.state`)."""

ENDED_BADLY = (IslandState.FAILED, IslandState.DIVERGED)
"""An island whose inner loop ended with an error: it raised, or it diverged."""
