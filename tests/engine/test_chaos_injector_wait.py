"""The chaos injector's idle wait, stepped in process (no Ray cluster).

It used to ask the health monitor and the GCS about every pending fault ten times a second; a time
fault ahead of its time must now cost nothing but one sleep until it is due.
"""

import time

import pytest

from orchestrator.actors.chaos_injector import ChaosInjector
from policies.chaos import Fault, FaultTape


def _injector(*faults: Fault, started_s_ago: float = 0.0) -> ChaosInjector:
    return ChaosInjector(FaultTape(faults), namespace="ns", monitor_name="monitor",
                         run_start=time.time() - started_s_ago, tick_s=0.1)


def test_sleeps_until_the_earliest_time_fault():
    inj = _injector(Fault(island=0, kind="kill_island", at_s=9.0), Fault(island=1, kind="hang", at_s=5.0),
                    started_s_ago=1.0)
    assert inj._next_wait_s() == pytest.approx(4.0, abs=0.05)
    assert all(inj._not_due(f) for f in inj.pending)


def test_a_due_fault_that_has_not_fired_is_retried_every_tick():
    inj = _injector(Fault(island=0, kind="kill_island", at_s=2.0), Fault(island=1, kind="hang", at_s=50.0),
                    started_s_ago=3.0)
    assert not inj._not_due(next(f for f in inj.pending if f.at_s == 2.0))
    assert inj._next_wait_s() == 0.1


def test_step_faults_are_polled_every_tick():
    inj = _injector(Fault(island=0, kind="kill_island", at_step=40), Fault(island=1, kind="hang", at_s=50.0))
    step_fault = next(f for f in inj.pending if f.at_step is not None)
    assert not inj._not_due(step_fault)  # only the island's step count can tell
    assert inj._next_wait_s() == 0.1


def test_never_sleeps_less_than_a_tick():
    inj = _injector(Fault(island=0, kind="kill_island", at_s=1.0), started_s_ago=0.99)
    assert inj._next_wait_s() == 0.1


def test_progress_faults_wait_for_the_runs_progress_and_are_polled_every_tick():
    inj = _injector(Fault(island=0, kind="kill_island", at_progress=0.3), Fault(island=1, kind="hang", at_s=50.0),
                    started_s_ago=100.0)  # long past any clock: only the budget's progress decides
    fault = next(f for f in inj.pending if f.at_progress is not None)
    assert inj._not_due(fault) and inj._next_wait_s() == 0.1
    inj.note_progress(0.29)
    assert inj._not_due(fault)
    inj.note_progress(0.31)
    assert not inj._not_due(fault)
    inj.note_progress(0.1)  # a late report of an earlier tick never takes progress back
    assert not inj._not_due(fault)
