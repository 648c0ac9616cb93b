"""An island cuts its fragments every H/P steps, H following the run progress its published fragments carry.

A real LearnerIsland over the real OuterOptimizer core, stepped in process (no Ray); the outer optimizer's
grace window takes its tau from the same schedule.
"""

from __future__ import annotations

import dataclasses

import pytest

from islands.island import LearnerIsland
from tests.engine.nano import nano_world
from tests.engine.test_outer_refusals import good, make_outer
from tests.from_config import inner_from_config, outer_from_config, spec_from_config


def island(schedule):
    w = nano_world(outer_from_config(min_quorum=1, grace_gamma=0.0, grace_cap_s=0.0, poison_guard=False))
    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=1, model_config=w.cfg, plan=w.plan,
                            inner=inner_from_config(lr=1e-3, batch_size=2), sync_every_steps=8, sync_every_schedule=schedule,
                            seed=1, adoption="rebase")
    return w, LearnerIsland(spec, w.data, w.latest)


def cut_steps(isl: LearnerIsland, steps: int) -> list[int]:
    """The steps (1-based) after which a submission was cut."""
    out = []
    for s in range(1, steps + 1):
        before = sum(isl.status().submitted_tokens)
        isl.step()
        if sum(isl.status().submitted_tokens) > before:
            out.append(s)
    return out


def test_cuts_follow_the_schedule_then_the_final_h_once_the_progress_passes_it():
    w, isl = island(((0.5, 4),))  # H = 4 (a cut every 2 steps, P = 2) until half the budget, then H = 8
    assert isl.cut_every() == 2
    assert cut_steps(isl, 6) == [2, 4, 6]
    isl.adopt(dataclasses.replace(w.latest[0], version=1, progress=0.5))  # a version says: half way
    assert cut_steps(isl, 12) == [4, 8, 12]  # applied at the next step boundary: every 4 steps from the last cut
    assert isl.cut_every() == 4


def test_a_shorter_h_cuts_at_once_when_the_steps_since_the_last_cut_already_reach_it():
    w, isl = island(((0.5, 8), (1.0, 2)))  # H = 8, then H = 2 from half way
    assert cut_steps(isl, 3) == []  # 3 steps into a cut interval of 4
    isl.adopt(dataclasses.replace(w.latest[0], version=1, progress=0.6))
    assert cut_steps(isl, 3) == [1, 2, 3]  # 4 >= 1: cut now, then every step


def test_no_schedule_cuts_every_h_over_p_whatever_the_progress():
    w, isl = island(())
    isl.adopt(dataclasses.replace(w.latest[0], version=1, progress=0.9))
    assert cut_steps(isl, 8) == [4, 8]


def test_a_bad_schedule_is_refused_before_the_island_trains():
    w = nano_world(outer_from_config())
    spec = spec_from_config(island=0, incarnation=1, pool="p", num_islands=1, model_config=w.cfg, plan=w.plan,
                            inner=inner_from_config(batch_size=2), sync_every_steps=8, sync_every_schedule=((0.5, 3),), adoption="overwrite")
    with pytest.raises(ValueError, match="not a multiple of num_fragments"):
        LearnerIsland(spec, w.data, w.latest)


@pytest.mark.parametrize("progress, grace_s", [(None, 0.4), (0.2, 0.4), (0.6, 2.0)])
def test_the_outer_grace_window_takes_tau_from_the_schedule_at_the_run_progress(progress, grace_s):
    # grace = gamma * (tau * step_time - quorum_time - sync_time) = tau * 0.1 s here (quorum at once, no sync yet);
    # tau is 4 steps until half the budget, then tau_steps = 20.
    outer = make_outer(islands=2, grace_gamma=1.0, grace_cap_s=float("inf"), tau_steps=20.0, tau_schedule=((0.5, 4),))
    outer.progress = progress
    assert outer.receive(good(outer), now=0.0) == ([], None)  # quorum (K = 1) reached: the grace window opens
    assert outer.poll(grace_s - 0.01) == []
    (closed,) = outer.poll(grace_s + 0.01)
    assert closed.record.grace_s == pytest.approx(grace_s)
