"""The chaos injector fires each fault kind through the mechanism its kind names (policies/fault_kinds.py), stepped
in process with stand-ins for the monitor, the island and `ray.kill` (no Ray cluster).

Pins what each built-in kind does, as the injector's if/elif over kind names did before the kinds named their
mechanism: what the monitor is told (and with which recovery delay), what the island or the run's actor is asked.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from orchestrator.actors import chaos_injector
from orchestrator.actors.chaos_injector import ChaosInjector, mechanism
from policies import fault_kinds
from policies.chaos import Fault, FaultTape


class Remote:
    """A stand-in actor method: records its calls; `.remote(...)` returns an awaitable of `reply`."""

    def __init__(self, calls: list, name: str, reply=None) -> None:
        self.calls, self.name, self.reply = calls, name, reply

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.reply)
        return future


def fire(fault: Fault, monkeypatch, *, node: str = "node-a", protected: str | None = None) -> tuple[list, bool]:
    """Fire `fault` at island 1 incarnation 2 on `node`; returns (every call made, whether the fault is done)."""
    calls: list = []
    monitor = SimpleNamespace(name="monitor", current=Remote(calls, "monitor.current", (2, "island-1-inc2", node)),
                              note_fault=Remote(calls, "monitor.note_fault"))
    island = SimpleNamespace(name="island", inject=Remote(calls, "island.inject"), status=Remote(calls, "island.status"))
    outer = SimpleNamespace(name="outer")
    inj = ChaosInjector(FaultTape((fault,)), namespace="ns", monitor_name="monitor-r1", run_start=time.time(),
                        protected_node=protected)
    inj._handles = {"island-1-inc2": island, "outer-r1": outer}
    monkeypatch.setattr(chaos_injector.ray, "kill", lambda actor, no_restart: calls.append(("ray.kill", actor.name, no_restart)))

    async def drain(node, deadline_s, message):
        calls.append(("drain", node, deadline_s))

    async def join(f):
        calls.append(("join", f.island))
        return True

    monkeypatch.setattr(inj, "_drain", drain)
    monkeypatch.setattr(inj, "_join", join)
    done = asyncio.run(inj._maybe_fire(monitor, fault))
    return [c for c in calls if c[0] != "monitor.current"], done


def noted(kind: str, recovery: float) -> tuple:
    return "monitor.note_fault", (1, 2, kind), recovery


def summary(calls: list) -> list:
    """Calls with note_fault's time left out (it is the clock's)."""
    return [("monitor.note_fault", c[1][:3], c[1][4]) if c[0] == "monitor.note_fault" else c for c in calls]


@pytest.mark.parametrize("kind", ["hang", "drop_submission", "corrupt_submission", *fault_kinds.POISON_KINDS])
def test_island_kinds_are_noted_then_injected_into_the_island(kind, monkeypatch):
    calls, done = fire(Fault(island=1, kind=kind, at_s=0.0, duration_s=3.0), monkeypatch)
    assert done and summary(calls) == [noted(kind, 0.0), ("island.inject", (kind,), {"duration_s": 3.0, "factor": 1.0})]


def test_slow_carries_its_factor(monkeypatch):
    calls, _ = fire(Fault(island=1, kind="slow", at_s=0.0, duration_s=3.0, factor=4.0), monkeypatch)
    assert summary(calls) == [noted("slow", 0.0), ("island.inject", ("slow",), {"duration_s": 3.0, "factor": 4.0})]


def test_kills_report_their_recovery_delay(monkeypatch):
    calls, _ = fire(Fault(island=1, kind="kill_island", at_s=0.0, duration_s=7.0), monkeypatch)
    assert summary(calls) == [noted("kill_island", 7.0), ("ray.kill", "island", True)]
    calls, _ = fire(Fault(island=1, kind="kill_node", at_s=0.0, duration_s=5.0), monkeypatch)
    assert summary(calls) == [noted("kill_node", 5.0), ("island.inject", ("kill_node",), {})]


def test_node_kinds_spare_the_drivers_node(monkeypatch):
    for kind, duration in (("kill_node", 0.0), ("drain_node", 20.0)):
        calls, done = fire(Fault(island=1, kind=kind, at_s=0.0, duration_s=duration), monkeypatch, protected="node-a")
        assert done and calls == []
    calls, _ = fire(Fault(island=1, kind="hang", at_s=0.0), monkeypatch, protected="node-a")
    assert summary(calls)[0] == noted("hang", 0.0)  # an island kind on the driver's node is injected


def test_a_drain_is_not_noted(monkeypatch):
    calls, done = fire(Fault(island=1, kind="drain_node", at_s=0.0, duration_s=12.0), monkeypatch)
    assert done and calls == [("drain", "node-a", 12.0)]


def test_run_and_pool_kinds_look_no_island_up(monkeypatch):
    calls, done = fire(Fault(island=0, kind="kill_outer", at_s=0.0), monkeypatch)
    assert done and calls == [("ray.kill", "outer", False)]
    calls, done = fire(Fault(island=0, kind="kill_monitor", at_s=0.0), monkeypatch)
    assert done and calls == [("ray.kill", "monitor", False)]
    calls, done = fire(Fault(island=3, kind="node_joins", at_s=0.0), monkeypatch)
    assert done and calls == [("join", 3)]


def test_every_kind_names_a_mechanism_the_injector_has():
    inj = ChaosInjector(FaultTape(()), namespace="ns", monitor_name="monitor-r1", run_start=time.time())
    assert {k.injection for k in fault_kinds.kinds()} >= {"on_island", "kill_island", "kill_node", "drain_node"}
    for kind in fault_kinds.kinds():
        assert callable(mechanism(inj, kind)), kind


def test_a_kind_whose_mechanism_the_injector_lacks_is_refused_when_the_tape_is_loaded():
    class Teleport(fault_kinds.FaultKind):
        name = "teleport_island"
        injection = "teleport"

    try:
        with pytest.raises(ValueError, match="'teleport_island' is injected by 'teleport', which ChaosInjector does not "
                                             "implement") as info:
            ChaosInjector(FaultTape((Fault(island=0, kind="teleport_island", at_s=1.0),)), namespace="ns",
                          monitor_name="monitor-r1", run_start=time.time())
        assert "\n" not in str(info.value)
    finally:
        fault_kinds.unregister("teleport_island")


class ByIsland(Remote):
    """A stand-in `monitor.current` whose reply depends on the island asked about."""

    def __init__(self, calls: list, replies: dict) -> None:
        super().__init__(calls, "monitor.current")
        self.replies = replies

    def remote(self, island):
        self.reply = self.replies[island]
        return super().remote(island)


@pytest.mark.parametrize("retarget", [True, False])
def test_a_retargeted_fault_of_a_down_island_hits_the_next_live_one(retarget, monkeypatch):
    calls: list = []
    # Island 1 is down (no actor name); 0 and 3 are live.
    monitor = SimpleNamespace(current=ByIsland(calls, {0: (1, "island-0-inc1", "n0"), 1: (2, None, None),
                                                       3: (4, "island-3-inc4", "n3")}),
                              live_islands=Remote(calls, "monitor.live_islands", [0, 3]),
                              note_fault=Remote(calls, "monitor.note_fault"))
    island3 = SimpleNamespace(name="island-3", inject=Remote(calls, "island.inject"))
    fault = Fault(island=1, kind="hang", at_s=0.0, duration_s=3.0, retarget=retarget)
    inj = ChaosInjector(FaultTape((fault,)), namespace="ns", monitor_name="monitor-r1", run_start=time.time())
    inj._handles = {"island-3-inc4": island3}
    done = asyncio.run(inj._maybe_fire(monitor, fault))
    if not retarget:  # it waits for island 1: nothing fired, nothing recorded
        assert not done and inj.executed == [] and [c[0] for c in calls] == ["monitor.current"]
        return
    assert done
    assert [c[1] for c in calls if c[0] == "monitor.current"] == [(1,), (3,)]
    assert [c[1][:3] for c in calls if c[0] == "monitor.note_fault"] == [(3, 4, "hang")]
    assert [c[:2] for c in calls if c[0] == "island.inject"] == [("island.inject", ("hang",))]
    assert [(r["island"], r["incarnation"], r["outcome"], r["retargeted_from"]) for r in inj.executed] == [(3, 4, "fired", 1)]


def test_a_retargeted_fault_waits_when_no_island_is_live(monkeypatch):
    calls: list = []
    monitor = SimpleNamespace(current=ByIsland(calls, {1: (2, None, None)}),
                              live_islands=Remote(calls, "monitor.live_islands", []))
    fault = Fault(island=1, kind="kill_island", at_s=0.0, retarget=True)
    inj = ChaosInjector(FaultTape((fault,)), namespace="ns", monitor_name="monitor-r1", run_start=time.time())
    assert asyncio.run(inj._maybe_fire(monitor, fault)) is False and inj.executed == []
