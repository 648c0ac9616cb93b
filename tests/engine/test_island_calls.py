"""The monitor's calls to every island at the end of a run (orchestrator/actors/launcher.py) are bounded by one
control-call timeout however many islands do not answer: a driver that waits `call_timeout_s + 30` for them
must not time out because two islands on a lost node each held the call for the whole timeout.

Stand-in handles (no Ray): each `.remote()` is a coroutine that answers, fails or never answers.
"""

from __future__ import annotations

import asyncio
import time

from orchestrator.actors.launcher import island_statuses, stop_islands


class _Method:
    def __init__(self, behaviour):
        self.behaviour = behaviour

    def remote(self, **_):
        return self.behaviour()


class Handle:
    def __init__(self, behaviour):
        self.status = self.stop = _Method(behaviour)


def answers(value):
    async def call():
        return value
    return call


async def never():
    await asyncio.sleep(3600)


async def dies():
    raise RuntimeError("the actor died")


# Seven silent islands: asked one after the other they would take 3.5 s at 0.5 s each, at once 0.5 s; the bound
# between leaves a starved CI worker (nice 19) two seconds.
HANDLES = {0: Handle(answers("s0")), 1: Handle(never), 2: Handle(dies), 3: Handle(never), 4: Handle(answers("s4")),
           **{i: Handle(never) for i in range(5, 10)}}


def test_statuses_and_stops_of_islands_that_do_not_answer_take_one_timeout_not_one_each():
    for call in (island_statuses(HANDLES, timeout_s=0.5), stop_islands(HANDLES, flush=True, timeout_s=0.5)):
        t0 = time.monotonic()
        got = asyncio.run(call)
        assert got == {0: "s0", 4: "s4"}, "those that answered; the silent and the dead are left out"
        assert time.monotonic() - t0 < 2.5, "the silent islands held the call for a timeout each"
