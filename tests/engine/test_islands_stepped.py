"""slots.islands_stepped: the wait after which a fresh run's keepers and warm spares start (no Ray)."""

from __future__ import annotations

import asyncio
import time

from orchestrator.actors.slots import SlotState, islands_stepped


def _wait(slots: list[SlotState], *, wait_s: float = 5.0, stopping=lambda: False, step_later: SlotState | None = None,
          after_s: float = 0.2) -> float:
    """Seconds islands_stepped took; `step_later` takes its first step `after_s` into the wait."""

    async def scenario() -> float:
        async def step() -> None:
            await asyncio.sleep(after_s)
            assert step_later is not None
            step_later.steps = 1

        t0 = time.monotonic()
        task = asyncio.get_running_loop().create_task(step()) if step_later is not None else None
        await islands_stepped(slots, wait_s=wait_s, tick_s=0.01, stopping=stopping)
        took = time.monotonic() - t0
        if task is not None:
            task.cancel()
        return took

    return asyncio.run(scenario())


def test_returns_once_the_last_island_steps_not_before():
    slots = [SlotState(island=0, pool="a", steps=3), SlotState(island=1, pool="a")]
    took = _wait(slots, wait_s=30.0, step_later=slots[1], after_s=0.3)
    assert 0.3 <= took < 5.0, took  # bounds far from 30 s: a starved CI worker (nice 19) must not fail it


def test_dead_and_stopped_slots_are_not_waited_for():
    slots = [SlotState(island=0, pool="a", steps=1), SlotState(island=1, pool="a", state="dead"),
             SlotState(island=2, pool="b", state="stopped")]
    assert _wait(slots, wait_s=30.0) < 5.0


def test_gives_up_after_wait_s_and_when_the_run_stops():
    never = [SlotState(island=0, pool="a")]
    took = _wait(never, wait_s=0.3)
    assert 0.3 <= took < 5.0, took
    assert _wait(never, wait_s=30.0, stopping=lambda: True) < 5.0
