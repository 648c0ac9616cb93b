"""The health monitor's failure and restart paths under interleaving, driven by asyncio alone (no Ray cluster).

Seen in a full-suite run under load: an island's inner loop failed while a health check was waiting for
its status. The watcher declared the incarnation failed; the check then got its (stale) answer, marked
the slot "training" again and failed it a second time. Two restart tasks raced on one slot: clobbered
actor names, an untracked incarnation left submitting, the island never rebuilt. These tests replay
that interleaving with a status call the test releases by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from islands.model import model_config
from islands.spec import IslandStatus
from orchestrator.actors.health_monitor import HealthMonitor
from orchestrator.actors.monitor_settings import ActorClasses, HealthThresholds, MonitorPools, MonitorTimeouts, RunAddress
from orchestrator.config import PoolConfig
from policies.fragments import plan_fragments
from policies.restart import RestartBudget
from tests.from_config import inner_from_config, spec_from_config


class _Method:
    def __init__(self, fn):
        self.remote = fn


class SlowIsland:
    """An island handle whose status() answers only when the test says so."""

    def __init__(self, status: IslandStatus) -> None:
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self.status = _Method(lambda: self.answer)
        self._status = status

    def release(self) -> None:
        self.answer.set_result(self._status)


def _status(state: str, steps: int) -> IslandStatus:
    return IslandStatus(island=0, incarnation=1, pool="a", state=state, steps=steps, tokens=steps * 512,
                        train_loss=2.0, step_time_s=0.1, versions=[0], unsubmitted_tokens=[0], outbox_tokens=[0],
                        inflight=0, cursor=steps)


def _monitor(gate: asyncio.Event | None = None) -> tuple[HealthMonitor, list, list]:
    cfg = model_config("nano")
    plan = plan_fragments([("w", 4)], 1)
    spec = spec_from_config(island=0, incarnation=1, pool="a", num_islands=1, model_config=cfg, plan=plan,
                            inner=inner_from_config(), sync_every_steps=8, adoption="overwrite")
    mon = HealthMonitor(run=RunAddress(run_id="r", namespace="ns", outer_name="outer-r"),
                        pools=MonitorPools(pools=(PoolConfig(name="a"),), warm_spares=0),
                        specs=[spec], data=[], actors=ActorClasses(island=object),
                        timeouts=MonitorTimeouts(placement_s=10, call_s=5, tick_s=0.25),
                        health=HealthThresholds(factor=3.0, floor_s=30.0, startup_s=60.0, unreachable_s=30.0),
                        restart=RestartBudget())
    teardowns, restarts = [], []

    async def teardown(slot):  # the real one kills actors and awaits the outer optimizer's unregister
        teardowns.append(slot.incarnation)
        if gate is not None:
            await gate.wait()  # the window in which the race happened: the failure is half handled
        await asyncio.sleep(0)

    async def restart(slot, delay, died_at):
        restarts.append(slot.incarnation)

    mon._teardown, mon._restart = teardown, restart
    slot = mon.slots[0]
    slot.incarnation, slot.state, slot.steps = 1, "training", 12
    return mon, teardowns, restarts


def test_a_check_answered_after_the_watcher_failed_the_island_does_not_fail_it_again():
    async def scenario():
        gate = asyncio.Event()
        mon, teardowns, restarts = _monitor(gate)
        slot = mon.slots[0]
        island = SlowIsland(_status("failed", 12))  # its inner loop failed; the process still answers
        mon.handles[0] = island
        loop = asyncio.get_running_loop()
        check = loop.create_task(mon._check(slot))
        await asyncio.sleep(0)  # the check is now waiting for status()
        fail = loop.create_task(mon._fail(slot, "failed", "inner loop failed"))  # the watcher saw it first
        await asyncio.sleep(0)  # the failure is in its teardown, its restart not yet registered
        island.release()  # the check gets its stale answer now, and acts on it (or not)
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(check, fail), timeout=10)
        await asyncio.sleep(0)
        return mon, teardowns, restarts

    mon, teardowns, restarts = asyncio.run(scenario())
    slot = mon.slots[0]
    assert slot.failures == 1 and len(mon.record.detections) == 1, mon.record.detections
    assert teardowns == [1] and restarts == [1], (teardowns, restarts)
    assert slot.state == "dead", "the stale answer must not mark a failed slot training again"
    assert [s for _, _, _, s in mon.record.timeline] == ["dead"]


def test_two_failures_reported_at_once_start_one_restart():
    async def scenario():
        gate = asyncio.Event()
        mon, teardowns, restarts = _monitor(gate)
        slot = mon.slots[0]
        mon.handles[0] = object()
        asyncio.get_running_loop().call_later(0.01, gate.set)
        # The watcher and a check fail the same incarnation in the same tick.
        await asyncio.gather(mon._fail(slot, "failed", "inner loop failed"), mon._fail(slot, "dead", "no answer"))
        await asyncio.sleep(0)
        return mon, teardowns, restarts

    mon, teardowns, restarts = asyncio.run(scenario())
    assert mon.slots[0].failures == 1 and [d["kind"] for d in mon.record.detections] == ["failed"]
    assert teardowns == [1] and restarts == [1]


def test_a_healthy_answer_still_records_progress():
    """The guard must not swallow ordinary checks: a live island's answer updates the slot."""
    async def scenario():
        mon, _, restarts = _monitor()
        slot = mon.slots[0]
        island = SlowIsland(_status("training", 20))
        mon.handles[0] = island
        check = asyncio.get_running_loop().create_task(mon._check(slot))
        await asyncio.sleep(0)
        island.release()
        await check
        return mon, restarts

    mon, restarts = asyncio.run(scenario())
    slot = mon.slots[0]
    assert slot.steps == 20 and slot.status.steps == 20 and slot.state == "training"
    assert restarts == [] and slot.failures == 0


def _answered(status: IslandStatus) -> SlowIsland:
    """An island handle whose status() has already answered `status`."""
    island = SlowIsland(status)
    island.release()
    return island


def test_time_blocked_on_a_round_does_not_count_towards_a_hang():
    # Seen in sync-diloco under faults: an island waited 30-55 s for its round (state "blocked", no
    # steps), unblocked, and the first check that caught it computing its next step judged it hung,
    # counting the wait as "no progress" (66 failures for 12 injected faults).
    async def scenario():
        mon, teardowns, restarts = _monitor()
        slot = mon.slots[0]
        mon.handles[0] = _answered(_status("blocked", 12))
        slot.last_progress_at -= 100.0  # its last step was long ago: it has been waiting for its round
        await mon._check(slot)  # blocked: healthy, and the hang clock restarts now
        mon.handles[0] = _answered(_status("training", 12))  # unblocked, computing step 13
        await mon._check(slot)
        assert teardowns == [] and restarts == [], "an island that just left a round's wait is not hung"
        # It still is judged hung once it makes no progress for longer than its timeout while training.
        slot.last_progress_at -= 100.0
        await mon._check(slot)
        assert teardowns == [1]

    asyncio.run(scenario())


def test_a_restarted_island_earns_its_backoff_back_by_submitting_not_by_stepping():
    async def check(mon, status):
        mon.handles[0] = _answered(status)
        await mon._check(mon.slots[0])

    async def scenario():
        mon, _, _ = _monitor()
        mon.budget.on_failure(0, now=time.monotonic() - 1.0)  # the previous incarnation failed 1 s ago
        stepping = dataclasses.replace(_status("training", 20), submitted_tokens=[0])
        await check(mon, stepping)
        after_steps = mon.budget.attempt(0)
        await check(mon, dataclasses.replace(stepping, steps=30, submitted_tokens=[4096]))
        return after_steps, mon.budget.attempt(0)

    after_steps, after_submission = asyncio.run(scenario())
    assert after_steps == 1, "stepping alone is what a crash loop does too: the backoff stands"
    assert after_submission == 0, "a submission cut since the restart clears it"


class RestartedOuter:
    """An outer-optimizer handle that reports a new epoch, logging each call in the order it was made."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.health = _Method(self._health)
        self.latest = _Method(lambda island=None: log.append(("latest", island)) or ("fetched", island))
        self.register = _Method(self._register)

    async def _health(self):
        return {"epoch": 1, "diverged": [], "islands": {}}

    async def _register(self, island, incarnation, handle):
        self.log.append(("register", island))


class Resyncing:
    def __init__(self, island: int, log: list) -> None:
        self.resync = _Method(self._resync)
        self.island, self.log = island, log

    async def _resync(self, fetched):
        self.log.append(("resync", self.island, fetched))
        await asyncio.sleep(0.01)  # a fetch takes a while: the others' must already be under way


def test_after_an_outer_restart_every_island_fetches_the_model_on_its_own_link_at_once():
    """Each island's resync fetch is its own latest(island) (counted on its link and, on an EMULATED network,
    delayed), and all are asked for before the first resync waits on one, so the transfers overlap."""
    async def scenario():
        cfg, plan = model_config("nano"), plan_fragments([("w", 4)], 1)
        specs = [spec_from_config(island=i, incarnation=1, pool="a", num_islands=3, model_config=cfg, plan=plan,
                                  inner=inner_from_config(), sync_every_steps=8, adoption="overwrite") for i in range(3)]
        mon = HealthMonitor(run=RunAddress(run_id="r", namespace="ns", outer_name="outer-r"),
                            pools=MonitorPools(pools=(PoolConfig(name="a", islands=3),), warm_spares=0),
                            specs=specs, data=[], actors=ActorClasses(island=object),
                            timeouts=MonitorTimeouts(placement_s=10, call_s=5, tick_s=0.25),
                            health=HealthThresholds(factor=3.0, floor_s=30.0, startup_s=60.0, unreachable_s=30.0),
                            restart=RestartBudget())
        log: list = []
        outer = RestartedOuter(log)
        mon.outer.handle = lambda: outer
        mon.outer.epoch = 0
        for i in range(3):
            mon.slots[i].incarnation, mon.slots[i].state = 1, "training"
            mon.handles[i] = Resyncing(i, log)
        await mon._check_outer()
        return mon, log

    mon, log = asyncio.run(scenario())
    assert log[:3] == [("latest", 0), ("latest", 1), ("latest", 2)], log
    assert [e for e in log if e[0] == "resync"] == [("resync", i, ("fetched", i)) for i in range(3)]
    assert [e[1] for e in log if e[0] == "register"] == [0, 1, 2]
    assert mon.outer.epoch == 1


class PoisonReportingOuter:
    """An outer-optimizer handle whose health names island 0's incarnation 1 as refused as poisoned 3 times in a row."""

    def __init__(self) -> None:
        self.health = _Method(self._health)
        self.register = _Method(self._noop)

    async def _health(self):
        return {"epoch": 0, "diverged": [], "poisoned": [[0, 1]], "islands": {"0": 1}, "poison_restart_after": 3}

    async def _noop(self, *args):
        return None


def test_an_island_the_outer_optimizer_found_poisoned_is_restarted_as_a_diverged_one():
    async def scenario():
        mon, teardowns, restarts = _monitor()
        outer = PoisonReportingOuter()
        mon.outer.handle = lambda: outer
        mon.outer.epoch = 0
        mon.handles[0] = object()
        await mon._check_outer()
        await asyncio.sleep(0)
        return mon, teardowns, restarts

    mon, teardowns, restarts = asyncio.run(scenario())
    assert teardowns == [1] and restarts == [1]
    assert [(d["kind"], d["reason"]) for d in mon.record.detections] == [
        ("diverged", "outer gradients refused as poisoned (3 in a row, or one far out of line)")]
