"""The states the health monitor puts on the timeline: a slot's first start is "starting", a start after a
failure "restarting" then "reintegrating" (asyncio alone, no Ray cluster; stand-ins for the island and the
outer optimizer as in test_monitor_races.py)."""

from __future__ import annotations

import asyncio

from orchestrator.actors.recovery_record import RecoveryRecord
from orchestrator.actors.slots import SlotState
from tests.engine.test_monitor_races import _answered, _Method, _monitor, _status


class _Island:
    """A placed island: answers node_id and status (`steps` so far) at once; its watch call never returns
    (the island lives)."""

    def __init__(self) -> None:
        self.steps = 0
        self.node_id = _Method(self._node_id)
        self.status = _Method(self._status)
        self.watch = _Method(lambda timeout: asyncio.get_running_loop().create_future())

    async def _node_id(self) -> str:
        return "node-1"

    async def _status(self):
        return _status("training", self.steps)


class _Outer:
    def __init__(self) -> None:
        self.register = _Method(self._register)

    async def _register(self, island, incarnation, handle) -> None:
        return None


def _startable():
    """A monitor whose slot 0 was never started, with placement and registration stood in for."""
    mon, _, _ = _monitor()
    slot = mon.slots[0]
    slot.incarnation, slot.state, slot.steps = 0, SlotState(0, "a").state, 0
    seen: list[str] = []  # the slot's state while its process is being placed

    async def place(slot, spec, outer, cursor, data, on_wait=None):
        seen.append(slot.state)
        return _Island(), 0

    mon.launcher.place = place
    outer = _Outer()
    mon.outer.handle = lambda: outer

    async def call(ref):
        return await ref

    mon.outer.call = call
    return mon, seen


def _states(mon) -> list[tuple[int, str]]:
    return [(inc, state) for _, island, inc, state in mon.record.timeline if island == 0]


def test_a_first_start_is_starting_until_the_first_step_and_a_restart_reintegrates():
    async def scenario():
        mon, seen = _startable()
        slot = mon.slots[0]
        await mon._start(slot)
        assert seen == ["starting"] and slot.state == "starting" and _states(mon) == [(1, "starting")]
        await mon._check(slot)  # up, no step yet: still starting, and healthy
        assert slot.state == "starting" and slot.failures == 0
        mon.handles[0].steps = 3
        await mon._check(slot)
        assert slot.state == "training"
        # A failure, then the start after it: restarting while placed, reintegrating until its first step.
        slot.failures += 1
        mon.record.mark(slot, "dead")
        await mon._start(slot)
        assert seen == ["starting", "restarting"] and slot.state == "reintegrating"
        mon._stopping = True
        for task in mon.watchers.values():
            task.cancel()
        return _states(mon)

    assert asyncio.run(scenario()) == [(1, "starting"), (1, "training"), (1, "dead"), (2, "restarting"),
                                       (2, "reintegrating")]


def test_a_starting_island_that_answers_stepping_earns_its_health_like_a_reintegrating_one():
    async def scenario():
        mon, _, _ = _monitor()
        slot = mon.slots[0]
        slot.state, slot.steps = "starting", 0
        healthy: list[int] = []
        mon.budget.on_healthy = lambda island, now, submitted=False: healthy.append(island)
        mon.handles[0] = _answered(_status("training", 1))
        await mon._check(slot)
        return slot, healthy

    slot, healthy = asyncio.run(scenario())
    assert slot.state == "training" and healthy[:1] == [0]


def test_the_timeline_records_a_new_slots_first_state_and_each_new_incarnation():
    record, slot = RecoveryRecord(), SlotState(island=2, pool="a")
    assert slot.state == "starting", "a slot that never ran is starting, not restarting"
    record.mark(slot, "starting", at=1.0)  # the slot already reads "starting": the timeline must still get it
    record.mark(slot, "starting", at=2.0)  # a repeat is no event
    slot.incarnation = 1
    record.mark(slot, "starting", at=3.0)  # the same state in a new incarnation is one
    assert record.timeline == [(1.0, 2, 0, "starting"), (3.0, 2, 1, "starting")]
    restored = RecoveryRecord()
    restored.restore({"timeline": record.timeline, "detect_s": [], "rejoin_s": [], "detections": [], "faults": {}})
    restored.mark(slot, "starting", at=4.0)  # a restarted monitor knows what the timeline already says
    assert restored.timeline == record.timeline


def test_a_harmless_fault_does_not_date_a_later_death():
    # Soak (benchmarks/soak.py): an island slowed at t, then lost with its node to another island's kill_node, was
    # dated dead at t, the slow fault's time (its training time counted as dead, its detection and rejoin times long).
    record, slot = RecoveryRecord(), SlotState(island=1, pool="a")
    slot.incarnation = 1
    record.note_fault(1, 1, "slow", at=100.0, recovery_delay_s=0.0)
    record.note_fault(1, 1, "drop_submission", at=101.0, recovery_delay_s=0.0)
    died_at, delay = record.detect(slot, "dead", "its node died")
    assert died_at > 1e9 and delay == 0.0 and record.detect_s == []  # dated when detected, as an unexplained death
    assert record.detections[-1]["fault_at"] is None
    slot.incarnation = 2
    record.note_fault(1, 2, "slow", at=200.0, recovery_delay_s=0.0)
    record.note_fault(1, 2, "kill_node", at=201.0, recovery_delay_s=3.0)
    record.note_fault(1, 2, "drop_submission", at=202.0, recovery_delay_s=0.0)
    assert record.detect(slot, "dead", "killed") == (201.0, 3.0)  # the kill dates it


def test_an_answer_puts_blocked_training_or_the_slots_own_state_on_the_timeline():
    from orchestrator.actors.health_monitor import observed_state

    assert observed_state("blocked", stepped=True, was="training") == "blocked"
    assert observed_state("training", stepped=True, was="reintegrating") == "training"
    assert observed_state("starting", stepped=False, was="reintegrating") == "reintegrating", "no step yet"
