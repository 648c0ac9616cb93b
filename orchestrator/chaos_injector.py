"""ChaosInjector: executes a fault tape (policies.chaos) against a live run.

Time faults (`at_s`, seconds since the run started) hit whatever incarnation of the island is live
then; step faults (`at_step`) hit the named incarnation once it has taken that many inner steps.
Every executed fault is reported to the health monitor (so it can measure time to detect and honour a
recovery delay) and kept for the run's event log, so tests can assert exact counts.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from policies.chaos import Fault, FaultTape

log = logging.getLogger(__name__)

KILL_KINDS = ("kill_island", "kill_node")


class ChaosInjector:
    """Plain class with an asyncio loop; `ray.remote` is applied in orchestrator/actors.py."""

    def __init__(self, tape: FaultTape, *, namespace: str, monitor_name: str, run_start: float,
                 protected_node: str | None = None, tick_s: float = 0.1) -> None:
        self.pending: list[Fault] = list(tape.faults)
        self.namespace, self.monitor_name = namespace, monitor_name
        self.run_start = run_start  # wall clock (time.time) the tape's at_s counts from
        self.protected_node = protected_node  # never kill this node (the driver's / head node)
        self.tick_s = tick_s
        self.executed: list[dict] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Begin executing the tape (idempotent); returns the number of faults on it."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return len(self.pending) + len(self.executed)

    async def _run(self) -> None:
        monitor = ray.get_actor(self.monitor_name, namespace=self.namespace)
        while self.pending:
            await asyncio.sleep(self.tick_s)
            for fault in list(self.pending):
                try:
                    done = await self._maybe_fire(monitor, fault)
                except Exception as err:  # noqa: BLE001 - a target vanishing mid-fault is retried next tick
                    log.info("fault %s on island %d not fired yet: %s", fault.kind, fault.island, err)
                    continue
                if done:
                    self.pending.remove(fault)

    async def _maybe_fire(self, monitor, fault: Fault) -> bool:
        inc, name, node = await monitor.current.remote(fault.island)
        if fault.at_step is not None and inc > fault.incarnation:
            self._record(fault, inc, "skipped: its incarnation is gone")
            return True
        if name is None or (fault.at_step is not None and inc != fault.incarnation):
            return False  # island down or not yet at the target incarnation: wait
        handle = ray.get_actor(name, namespace=self.namespace)
        if fault.at_s is not None:
            if time.time() - self.run_start < fault.at_s:
                return False
        else:
            status = await handle.status.remote()
            if status.steps < fault.at_step:
                return False
        now = time.time()
        if fault.kind == "kill_node" and node == self.protected_node:
            self._record(fault, inc, "skipped: island shares the driver's node")
            return True
        recovery = fault.duration_s if fault.kind in KILL_KINDS else 0.0
        await monitor.note_fault.remote(fault.island, inc, fault.kind, now, recovery)
        if fault.kind == "kill_island":
            ray.kill(handle, no_restart=True)
        elif fault.kind == "kill_node":
            handle.inject.remote("kill_node")  # no reply: the node dies with it
        else:
            await handle.inject.remote(fault.kind, duration_s=fault.duration_s, factor=fault.factor)
        self._record(fault, inc, "fired", at=now)
        log.warning("chaos: %s on island %d incarnation %d", fault.kind, fault.island, inc)
        return True

    def _record(self, fault: Fault, incarnation: int, outcome: str, at: float | None = None) -> None:
        self.executed.append({"island": fault.island, "incarnation": incarnation, "kind": fault.kind,
                              "outcome": outcome, "at": at or time.time(), "run_s": (at or time.time()) - self.run_start})

    async def report(self) -> list[dict]:
        """Every fault fired or skipped so far, in order."""
        return list(self.executed)

    async def remaining(self) -> int:
        """Faults on the tape not yet fired or skipped."""
        return len(self.pending)
