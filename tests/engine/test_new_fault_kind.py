"""A new fault kind is one class: declared here, in a test, it registers itself, is drawn into tapes, validated by
its own rules and injected into a real in-process island's steps and cuts, with no package file edited
(policies/fault_kinds.py; issue 58 item 3). No Ray.

The kind, a *brownout*: for ``duration_s`` seconds (``> 0``) the island's steps take 3x as long and every
submission it cuts is lost on the way, as a flaky, overloaded machine would.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

import islands.island
from islands.faults import InjectedFaults
from islands.island import LearnerIsland
from policies import fault_kinds
from policies.chaos import FAULT_KINDS, Fault, FaultTape, fixed_tape, parse_chaos_spec, poisson_tape, tape_from_config
from tests.engine.nano import nano_world
from tests.from_config import inner_from_config, outer_from_config, spec_from_config

BROWNOUT_S = 30.0  # a drawn brownout's duration
BROWNOUT_FACTOR = 3.0


def declare_brownout() -> type[fault_kinds.IslandFaultKind]:
    """Declare (and so register) the brownout kind."""

    class Brownout(fault_kinds.IslandFaultKind):
        """``brownout``: steps 3x slower and every submission lost, for ``duration_s`` seconds (``> 0``)."""

        name = "brownout"

        def check(self, fault) -> None:
            if not fault.duration_s > 0:
                raise ValueError(f"Fault.duration_s of a brownout fault must be > 0, got {fault.duration_s}; "
                                 "use e.g. duration_s=30")
            super().check(fault)

        def drawn(self, params: fault_kinds.TapeParams) -> fault_kinds.Drawn:
            return {"duration_s": BROWNOUT_S}

        def inject_island(self, hooks: fault_kinds.IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
            hooks.slow_until(BROWNOUT_FACTOR, now + duration_s)
            hooks.drop_until(now + duration_s)

    return Brownout


@pytest.fixture
def brownout():
    """The brownout kind, registered for one test and taken off the registry after it."""
    kind = declare_brownout()
    yield kind
    fault_kinds.unregister("brownout")


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_kind_registers_itself_after_the_built_in_kinds(brownout):
    assert fault_kinds.names() == (*FAULT_KINDS, "brownout")
    assert isinstance(fault_kinds.fault_kind("brownout"), brownout)
    assert "brownout" not in FAULT_KINDS  # the built-in view is unchanged
    # Equal times sort by declaration order: the new kind after every built-in one.
    tape = FaultTape((Fault(island=0, kind="brownout", at_s=1.0, duration_s=5.0), Fault(island=0, kind="kill_monitor", at_s=1.0)))
    assert [f.kind for f in tape] == ["kill_monitor", "brownout"]


def test_a_second_kind_of_the_same_name_is_refused(brownout):
    assert "'brownout' is declared twice" in one_line_error(declare_brownout)


def test_unregistered_it_is_unknown_again():
    declare_brownout()
    fault_kinds.unregister("brownout")
    assert "brownout" not in fault_kinds.names()
    assert "kind must be one of" in one_line_error(Fault, island=0, kind="brownout", at_s=1.0, duration_s=5.0)
    assert "unknown fault kind 'brownout'; valid kinds are kill_island" in one_line_error(
        fixed_tape, islands=1, failures_per_island=1, horizon_s=10.0, kind="brownout")


def test_faults_of_the_kind_are_validated_by_its_rules(brownout):
    assert Fault(island=2, kind="brownout", at_s=1.0, duration_s=5).duration_s == 5.0
    assert "duration_s of a brownout fault must be > 0, got 0.0" in one_line_error(Fault, island=2, kind="brownout", at_s=1.0)
    # The rules it inherits: no factor (only slow takes one), and Fault's own.
    assert "factor only applies to kind 'slow'" in one_line_error(
        Fault, island=0, kind="brownout", at_s=1.0, duration_s=5.0, factor=2.0)
    assert "at_s must be a finite number" in one_line_error(Fault, island=0, kind="brownout", at_s=-1.0, duration_s=5.0)


def test_tapes_draw_the_kind(brownout, tmp_path):
    tape = poisson_tape(islands=3, horizon_s=600.0, mtbf_s=20.0, seed=4, kinds=("kill_island", "brownout"))
    brownouts = [f for f in tape if f.kind == "brownout"]
    assert 0 < len(brownouts) < len(tape) and {(f.duration_s, f.factor) for f in brownouts} == {(BROWNOUT_S, 1.0)}
    # The kinds' draws are the same with the new kind as with a built-in one in its place: only the kind differs.
    same = poisson_tape(islands=3, horizon_s=600.0, mtbf_s=20.0, seed=4, kinds=("kill_island", "hang"))
    assert [(f.island, f.at_s) for f in tape] == [(f.island, f.at_s) for f in same]
    path = tmp_path / "tape.yaml"
    tape.to_yaml(path)
    assert FaultTape.from_yaml(path) == tape
    fixed = fixed_tape(islands=2, failures_per_island=2, horizon_s=40.0, kind="brownout")
    assert len(fixed) == 4 and {f.duration_s for f in fixed} == {BROWNOUT_S}
    spec = parse_chaos_spec("poisson:mtbf_s=20,seed=4,kinds=kill_island|brownout")
    assert tape_from_config(spec, islands=3, horizon_s=600.0) == tape


def test_the_island_faults_take_the_kind(brownout):
    f = InjectedFaults(0)
    f.inject("brownout", now=10.0, duration_s=5.0)
    assert f.count == 1 and f.slowdown(12.0) == BROWNOUT_FACTOR and f.slowdown(15.0) == 1.0
    assert f.take_drop(now=14.9) and f.take_drop(now=14.9) and not f.take_drop(now=15.0)
    assert "for an island; use kill_node, hang" in one_line_error(f.inject, "kill_outer", now=0.0)


def test_the_kind_is_injected_into_a_real_islands_steps_and_cuts(brownout, monkeypatch):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=math.inf, grace_cap_s=math.inf, poison_guard=False))
    inner = inner_from_config(lr=1e-3, warmup_steps=0, batch_size=2)
    hit, clean = (LearnerIsland(spec_from_config(island=i, incarnation=1, pool="p", num_islands=2, model_config=w.cfg,
                                                 plan=w.plan, inner=inner, sync_every_steps=8, seed=1), w.data, w.latest)
                  for i in range(2))  # P = 2: a cut every 4 steps
    slept: list[float] = []  # the island module's sleeps, recorded instead of slept: a straggler's stretch
    monkeypatch.setattr(islands.island, "time", SimpleNamespace(monotonic=time.monotonic, sleep=slept.append))
    hit.inject("brownout", duration_s=600.0)
    for _ in range(4):
        hit.step()
    assert len(slept) == 4 and all(s > 0 for s in slept), "each step stretched"
    assert hit.status().faults == 1 and hit.status().submitted_tokens[0] > 0
    assert hit.next_submission(0) is None, "its cut was lost on the way"
    slept.clear()
    for _ in range(4):
        clean.step()
    assert slept == [] and clean.next_submission(0) is not None, "the same steps without the fault: no stretch, a cut"
