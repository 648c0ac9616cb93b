"""What the health monitor saw happen: the slots' timeline, each failure detected, and how fast each slot rejoined.

It is the evidence of a run's recovery (the report's timeline, time to detect, time to rejoin) and part
of the state the monitor parks with the outer optimizer, so that it survives a monitor restart.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from orchestrator.actors.slots import SlotState
from policies.fault_kinds import FAILURE_KINDS
from policies.island_states import IslandState

if TYPE_CHECKING:
    from orchestrator.actors.keepers import ProgressKeepers

__all__ = ["RecoveryRecord", "monitor_snapshot", "parked_state", "restore_parked"]

_NOT_LIVE = (IslandState.DEAD, IslandState.RESTARTING, IslandState.STARTING, IslandState.VACANT)
"""Slot states of no live incarnation that could have died unseen (a first start just starts again)."""

log = logging.getLogger(__name__)


class RecoveryRecord:
    """Timeline, detections, detect and rejoin times, and the faults the chaos injector reported.

    Attributes:
        timeline: (wall time, island, incarnation, state) per state change of a slot.
        detect_s: seconds from an injected fault to its detection, per detected injected fault.
        detections: one dict per failure: island, incarnation, kind, reason, detected_at, fault_at.
        rejoin_s: seconds from a death to the slot's next incarnation being up.
        faults: (island, incarnation) -> {"kind", "at", "recovery_delay_s"} of each injected fault.
        joins: one dict per island placed in an elastic slot that had been vacant: island, incarnation, node, at.
        leaves: one dict per island that left with its drained node: island, incarnation, node, at, deadline,
            merged (its last submissions merged before it went), waited_s, tokens (it processed), received (of them,
            by the outer optimizer: mean over fragments).
    """

    def __init__(self) -> None:
        self.timeline: list[tuple[float, int, int, str]] = []
        self.detect_s: list[float] = []
        self.detections: list[dict] = []
        self.rejoin_s: list[float] = []
        self.faults: dict[tuple[int, int], dict] = {}
        self.joins: list[dict] = []
        self.leaves: list[dict] = []
        self._last: dict[int, tuple[int, str]] = {}  # island -> (incarnation, state) of its latest timeline event

    def mark(self, slot: SlotState, state: IslandState, at: float | None = None) -> None:
        """Move `slot` to `state`, on the timeline at `at` (wall time; now when None); no event if the timeline
        already has the slot's current incarnation in that state."""
        slot.state = state
        # Keyed on the timeline, not on slot.state: a slot is created "starting", and its first start must
        # still put "starting" on the timeline (else goodput would not see the time before its first step).
        if self._last.get(slot.island) != (slot.incarnation, state):
            self._last[slot.island] = (slot.incarnation, state)
            self.timeline.append((at if at is not None else time.time(), slot.island, slot.incarnation, state))

    def mark_lost_in_restart(self, slots: Iterable[SlotState], adopted: set[int]) -> None:
        """After this monitor restarted from parked state: a slot that was live then and was not re-adopted
        died unseen, so it counts as a failure and goes dead. A first start cut short by the restart
        ("starting") is no island failure: it simply starts again."""
        for slot in slots:
            if slot.island not in adopted and slot.state not in _NOT_LIVE:
                slot.failures += 1
                self.mark(slot, IslandState.DEAD)
                log.warning("island %d incarnation %d found dead after a monitor restart", slot.island, slot.incarnation)

    def note_fault(self, island: int, incarnation: int, kind: str, at: float, recovery_delay_s: float) -> None:
        """Remember a fault the chaos injector caused (for time-to-detect and the recovery delay). Only a fault that
        ends the incarnation (FAILURE_KINDS: the kinds whose `failure` is set, policies/fault_kinds.py): a slowdown
        or a dropped submission noted here had dated a later death of the island (its node lost with another
        island's, say) back at that harmless fault."""
        if kind in FAILURE_KINDS:
            self.faults[(island, incarnation)] = {"kind": kind, "at": at, "recovery_delay_s": recovery_delay_s}

    def detect(self, slot: SlotState, kind: str, reason: str) -> tuple[float, float]:
        """Record the failure of `slot`'s current incarnation; returns (when it died, the least restart delay).

        An injected fault dates the death at its injection and may ask for a recovery delay (a node that
        takes a while to come back); any other failure died when it was detected."""
        now_wall = time.time()
        fault = self.faults.get((slot.island, slot.incarnation))
        self.detections.append({"island": slot.island, "incarnation": slot.incarnation, "kind": kind, "reason": reason,
                                "detected_at": now_wall, "fault_at": fault["at"] if fault else None})
        if fault:
            self.detect_s.append(max(0.0, now_wall - fault["at"]))
            return fault["at"], fault.get("recovery_delay_s", 0.0)
        return now_wall, 0.0

    def rejoined(self, died_at: float) -> None:
        """A slot that died at `died_at` (wall time) has a new incarnation up now."""
        self.rejoin_s.append(time.time() - died_at)

    def restore(self, saved: dict) -> None:
        """Take back what a previous monitor parked (the keys the monitor's parked state gives these lists)."""
        self.timeline = list(saved["timeline"])
        self._last = {island: (inc, state) for _, island, inc, state in self.timeline}
        self.detect_s, self.rejoin_s = list(saved["detect_s"]), list(saved["rejoin_s"])
        self.detections = list(saved["detections"])
        self.faults = dict(saved["faults"])
        self.joins, self.leaves = list(saved.get("joins", [])), list(saved.get("leaves", []))


def monitor_snapshot(slots: dict[int, SlotState], record: RecoveryRecord, keepers: ProgressKeepers, *,
                     spares: dict, waiting: list[str]) -> dict:
    """What HealthMonitor.snapshot answers: slots with their latest statuses, the timeline so far, detect and rejoin
    times, salvages, keeper restarts and moves, joins and leaves, the warm `spares` counts and what the run is
    `waiting` for."""
    r, k = record, keepers
    return {
        "slots": {i: dataclasses.asdict(s) | {"status": s.status, "finals": list(s.finals)} for i, s in slots.items()},
        "timeline": list(r.timeline), "detect_s": list(r.detect_s), "rejoin_s": list(r.rejoin_s),
        "spares": spares, "detections": list(r.detections),
        "salvages": list(k.salvages), "keeper_restarts": dict(k.restarts), "keeper_moves": dict(k.moves),
        "joins": list(r.joins), "leaves": list(r.leaves), "waiting": waiting,
    }


def parked_state(slots: dict[int, SlotState], record: RecoveryRecord, keepers: ProgressKeepers) -> dict:
    """What the monitor parks with the outer optimizer: its record, salvages, keeper counts and slot counts."""
    r, k = record, keepers
    return {"timeline": list(r.timeline), "detect_s": list(r.detect_s), "rejoin_s": list(r.rejoin_s),
            "detections": list(r.detections), "salvages": list(k.salvages),
            "keeper_restarts": dict(k.restarts), "keeper_moves": dict(k.moves),
            "slots": {i: {"failures": s.failures, "restarts": s.restarts, "finals": list(s.finals),
                          "incarnation": s.incarnation, "state": s.state} for i, s in slots.items()},
            "faults": dict(r.faults), "joins": list(r.joins), "leaves": list(r.leaves)}


def restore_parked(saved: dict, slots: dict[int, SlotState], record: RecoveryRecord, keepers: ProgressKeepers) -> None:
    """Take back what `parked_state` gave a previous monitor of this run."""
    record.restore(saved)
    keepers.restore(saved)
    for i, st in saved["slots"].items():
        slot = slots[int(i)]
        slot.failures, slot.restarts, slot.finals = st["failures"], st["restarts"], list(st["finals"])
        slot.incarnation = st["incarnation"]  # a slot found dead restarts above this
        slot.state = IslandState(st.get("state", slot.state))
