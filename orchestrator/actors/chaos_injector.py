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
    """Plain class with an asyncio loop; `ray.remote` is applied in orchestrator/actors/remote.py."""

    def __init__(self, tape: FaultTape, *, namespace: str, monitor_name: str, run_start: float,
                 protected_node: str | None = None, tick_s: float = 0.1) -> None:
        self.pending: list[Fault] = list(tape.faults)
        self.namespace, self.monitor_name = namespace, monitor_name
        self.run_start = run_start  # wall clock (time.time) the tape's at_s counts from
        self.protected_node = protected_node  # never kill this node (the driver's / head node)
        self.tick_s = tick_s
        self.executed: list[dict] = []
        self._task: asyncio.Task | None = None
        self._handles: dict[str, object] = {}

    async def start(self) -> int:
        """Begin executing the tape (idempotent); returns the number of faults on it."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return len(self.pending) + len(self.executed)

    async def _run(self) -> None:
        monitor = ray.get_actor(self.monitor_name, namespace=self.namespace)
        while self.pending:
            await asyncio.sleep(self._next_wait_s())
            for fault in list(self.pending):
                if self._not_due(fault):
                    continue  # a time fault ahead of its time costs no call to the monitor or the GCS
                try:
                    done = await self._maybe_fire(monitor, fault)
                except Exception as err:  # noqa: BLE001 - a target vanishing mid-fault is retried next tick
                    log.info("fault %s on island %d not fired yet: %s", fault.kind, fault.island, err)
                    self._handles.clear()  # the handle may be of an actor that died: look it up again
                    continue
                if done:
                    self.pending.remove(fault)

    def _handle(self, name: str):
        # Cached: a GCS lookup every tick for every waiting fault was most of this actor's idle CPU.
        # Names carry the incarnation (spares a sequence number), so a name never moves to a newer island.
        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=self.namespace)
        return self._handles[name]

    def _not_due(self, fault: Fault) -> bool:
        return fault.at_s is not None and time.time() - self.run_start < fault.at_s

    def _next_wait_s(self) -> float:
        """Sleep until the earliest time fault is due; poll every tick while step faults wait (they need
        the island's step count) or a due fault could not fire yet (its island is down: retry each tick)."""
        elapsed = time.time() - self.run_start
        ahead = [f.at_s - elapsed for f in self.pending if f.at_s is not None and f.at_s > elapsed]
        if len(ahead) < len(self.pending):
            return self.tick_s
        return max(self.tick_s, min(ahead))

    async def _maybe_fire(self, monitor, fault: Fault) -> bool:
        inc, name, node = await monitor.current.remote(fault.island)
        if fault.at_step is not None and inc > fault.incarnation:
            self._record(fault, inc, "skipped: its incarnation is gone")
            return True
        if name is None or (fault.at_step is not None and inc != fault.incarnation):
            return False  # island down or not yet at the target incarnation: wait
        handle = self._handle(name)
        if fault.at_s is None:
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
