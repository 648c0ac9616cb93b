"""ChaosInjector: executes a fault tape (policies.chaos) against a live run.

Time faults (`at_s`, seconds since the run started) and progress faults (`at_progress`, a fraction of the
token budget, which the driver reports through `note_progress`) hit whatever incarnation of the island is
live then; step faults (`at_step`) hit the named incarnation once it has taken that many inner steps. A time or
progress fault due while its island is down waits for it, unless it is `retarget`ed: then the next live island
takes it (`policies.chaos.retarget_island`; the soak's tape, whose rate must hold however slow restarts are).
Every executed fault is reported to the health monitor (so it can measure time to detect and honour a
recovery delay) and kept for the run's event log, so tests can assert exact counts.

Each fault's kind (policies/fault_kinds.py) names the mechanism that injects it (`FaultKind.injection`); this
class implements each mechanism once, as `_fire_<injection>`. A kind that hits an island or its node is fired at
the island's live incarnation (`_fire_<injection>(fault, live)`, after the monitor has been told of it when the kind
is `reported`); one that hits the run or a pool fires on its own (`_fire_<injection>(monitor, fault)`, returning
whether it is done). The island kinds (hang, slow, drop, corrupt, the poisons) share one: `on_island`, the island's
`inject`. The mechanisms that need more than the island:

- `kill_island`: the island's actor is killed (`ray.kill(no_restart=True)`); `kill_node`: the island is asked to kill
  its node's raylet (no reply awaited: it dies with the node). Never the driver's node.
- `drain_node`: the island's node is drained through the GCS with a deadline (a preemption notice, as a cloud
  handler or the autoscaler gives it; orchestrator/actors/drains.py), and ended at the deadline by a `NodeEnder`
  placed on it first (a draining node takes no new work), as the cloud ends the VM. Never the driver's node.
- `kill_outer` / `kill_monitor` (run kinds): the run's outer optimizer / health monitor is killed
  with `ray.kill(no_restart=False)`, so Ray restarts it (both restart without limit, remote.py): the outer optimizer
  restores its newest checkpoint, the monitor re-adopts the islands. They name no island (a fault's `island` is 0).
- `node_joins`: EMULATION on the injector's machine: a Ray node labelled for the island's pool is started there
  (`ray start --address ... --labels ... --block`) and stopped with the run (`stop`); with a duration, it is
  drained after it like `drain_node`. On a real cluster capacity joins by the autoscaler or `ray start` on new
  machines (docs/cluster.md); this stands in for that on one machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.actors.drains import drain_node
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.runtime import quiet_worker
from policies.chaos import Fault, FaultTape, retarget_island
from policies.fault_kinds import ISLAND, JOINED_NODE_DEADLINE_S, NODE, FaultKind, fault_kind

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.actors.health_monitor import HealthMonitor

log = logging.getLogger(__name__)

# A joined node's object store: small, as the islands' traffic is (a fragment at a time). The injector waits up to
# JOIN_WAIT_S for one joined node to be up before it starts the next.
JOINED_NODE_OBJECT_STORE_BYTES, JOIN_WAIT_S = 100 << 20, 60.0


@dataclass(frozen=True)
class LiveIsland:
    """The live incarnation of the island a fault hits: its number, actor handle and node."""

    incarnation: int
    handle: ActorHandle[_IslandShell]
    node: str | None


def mechanism(injector: object, kind: FaultKind):
    """`injector`'s implementation of `kind`'s injection mechanism (`_fire_<kind.injection>`); a kind naming one it
    lacks is a one-line error."""
    fire = getattr(injector, f"_fire_{kind.injection}", None)
    if fire is None:
        raise ValueError(f"fault kind {kind.name!r} is injected by {kind.injection!r}, which {type(injector).__name__} "
                         f"does not implement; add _fire_{kind.injection} or use one of its mechanisms")
    return fire


class NodeEnder:
    """Placed on a node before it is drained (`ray.remote` in remote.py): ends the node at its deadline, as a
    cloud reclaims a preempted VM (Ray only marks a drained node; it never ends it)."""

    def end_at(self, deadline: float) -> None:
        """Kill this node's raylet at `deadline` (wall time), from a timer thread; returns at once."""
        quiet_worker("chaos")
        def end() -> None:
            time.sleep(max(deadline - time.time(), 0.0))
            log.warning("the drained node's deadline passed: ending it")
            os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent process is its node's raylet

        threading.Thread(target=end, daemon=True).start()


class ChaosInjector:
    """Plain class with an asyncio loop; `ray.remote` is applied in orchestrator/actors/remote.py."""

    def __init__(self, tape: FaultTape, *, namespace: str, monitor_name: str, run_start: float,
                 protected_node: str | None = None, tick_s: float = 0.1, ender_cls: Any = None,
                 join_nodes: dict[int, dict] | None = None, outer_name: str | None = None) -> None:
        """`ender_cls`: the NodeEnder actor class (drain_node); `join_nodes`: island -> what a node_joins node of its
        pool offers: {"labels": {...}, "num_cpus": float, "resources": {...}}; `outer_name`: the outer optimizer's
        actor name (kill_outer), by default the driver's `outer-<run id>` beside the monitor's `monitor-<run id>`."""
        quiet_worker("chaos")
        self.outer_name = outer_name or "outer-" + monitor_name.removeprefix("monitor-")
        self.ender_cls, self.join_nodes = ender_cls, join_nodes or {}
        self.joined: list[subprocess.Popen] = []  # node_joins nodes started on this machine, stopped by `stop`
        self.pending: list[Fault] = list(tape.faults)
        for fault in self.pending:  # here, not at fire time: a mechanism this class lacks would be retried forever
            mechanism(self, fault_kind(fault.kind))
        self.namespace, self.monitor_name = namespace, monitor_name
        self.run_start = run_start  # wall clock (time.time) the tape's at_s counts from
        self.protected_node = protected_node  # never kill this node (the driver's / head node)
        self.tick_s = tick_s
        self.progress = 0.0  # fraction of the token budget processed, as the driver last reported it
        self.executed: list[dict] = []
        self._task: asyncio.Task | None = None
        self._handles: dict[str, ActorHandle[Any]] = {}  # the islands' and the outer optimizer's, by name

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

    def _handle(self, name: str) -> ActorHandle[Any]:
        # Cached: a GCS lookup every tick for every waiting fault was most of this actor's idle CPU.
        # Names carry the incarnation (spares a sequence number), so a name never moves to a newer island.
        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=self.namespace)
        return self._handles[name]

    def note_progress(self, fraction: float) -> None:
        """The run's progress: the fraction of its token budget processed (the driver's every tick)."""
        self.progress = max(self.progress, float(fraction))

    def _not_due(self, fault: Fault) -> bool:
        if fault.at_progress is not None:
            return self.progress < fault.at_progress
        return fault.at_s is not None and time.time() - self.run_start < fault.at_s

    def _next_wait_s(self) -> float:
        """Sleep until the earliest time fault is due; poll every tick while step or progress faults wait (they
        need the island's step count, the run's progress) or a due fault could not fire yet (its island is down:
        retry each tick)."""
        elapsed = time.time() - self.run_start
        ahead = [f.at_s - elapsed for f in self.pending if f.at_s is not None and f.at_s > elapsed]
        if len(ahead) < len(self.pending):
            return self.tick_s
        return max(self.tick_s, min(ahead))

    async def _maybe_fire(self, monitor: ActorHandle[HealthMonitor], fault: Fault) -> bool:
        # Imported here, not with this module: it brings the run's config module (~0.2 s of imports) to the
        # injector's start, which the driver waits for once the run's clock runs.
        from orchestrator.actors.health_monitor import HealthMonitor

        kind = fault_kind(fault.kind)
        fire = mechanism(self, kind)
        if kind.target not in (ISLAND, NODE):  # the run's actors, a pool's new node: no incarnation to look up
            return await fire(monitor, fault)
        inc, name, node = await call(monitor, HealthMonitor.current, fault.island)
        if name is None and fault.retarget:  # its island is down: the next live one takes it (Fault.retarget)
            target = retarget_island(fault.island, await call(monitor, HealthMonitor.live_islands))
            if target is None:
                return False
            moved_from, fault = fault.island, dataclasses.replace(fault, island=target)
            inc, name, node = await call(monitor, HealthMonitor.current, target)
        else:
            moved_from = None
        if fault.at_step is not None and inc > fault.incarnation:
            self._record(fault, inc, "skipped: its incarnation is gone")
            return True
        if name is None or (fault.at_step is not None and inc != fault.incarnation):
            return False  # island down or not yet at the target incarnation: wait
        handle = self._handle(name)
        if fault.at_step is not None:
            status = await call(handle, _IslandShell.status)
            if status.steps < fault.at_step:
                return False
        now = time.time()
        if kind.target == NODE and node == self.protected_node:
            self._record(fault, inc, "skipped: island shares the driver's node")
            return True
        if kind.reported:
            await call(monitor, HealthMonitor.note_fault, fault.island, inc, fault.kind, now, kind.recovery_delay_s(fault))
        await fire(fault, LiveIsland(inc, handle, node))
        self._record(fault, inc, "fired", at=now, retargeted_from=moved_from)
        if kind.reported:
            log.info("%s on island %d incarnation %d", fault.kind, fault.island, inc)  # the monitor's line says it, once
        return True

    # ------------------------------------------------------------ mechanisms (FaultKind.injection)

    async def _fire_on_island(self, fault: Fault, live: LiveIsland) -> None:
        """An island kind: the island injects it into itself (LearnerIsland.inject, islands/faults.py)."""
        await call(live.handle, _IslandShell.inject, fault.kind, duration_s=fault.duration_s, factor=fault.factor)

    async def _fire_kill_island(self, fault: Fault, live: LiveIsland) -> None:
        """Kill the island's actor for good: the monitor restarts the island as a new incarnation."""
        ray.kill(live.handle, no_restart=True)

    async def _fire_kill_node(self, fault: Fault, live: LiveIsland) -> None:
        """The island kills its node's raylet."""
        call(live.handle, _IslandShell.inject, fault.kind)  # no reply: the node dies with it

    async def _fire_drain_node(self, fault: Fault, live: LiveIsland) -> None:
        """Drain the island's node with deadline `duration_s`, and end it then."""
        await self._drain(live.node, fault.duration_s, f"chaos: drain_node of island {fault.island}")

    async def _fire_kill_outer(self, monitor: ActorHandle[HealthMonitor], fault: Fault) -> bool:
        return self._kill_run_actor(self._handle(self.outer_name), fault)  # restarts keep the actor's id

    async def _fire_kill_monitor(self, monitor: ActorHandle[HealthMonitor], fault: Fault) -> bool:
        return self._kill_run_actor(monitor, fault)

    async def _fire_node_joins(self, monitor: ActorHandle[HealthMonitor], fault: Fault) -> bool:
        return await self._join(fault)

    def _kill_run_actor(self, target: ActorHandle[Any], fault: Fault) -> bool:
        """kill_outer / kill_monitor: kill the actor and let Ray restart it (as a crash of its process would)."""
        now = time.time()
        # Asynchronous: the old process may answer a call or two more. A kill while the actor is still restarting
        # from the last one is one more restart, which is what a crash then would be.
        ray.kill(target, no_restart=False)
        self._record(fault, 0, "fired", at=now)
        log.info("%s: killed, Ray restarts it", fault.kind)
        return True

    async def _drain(self, node: str, deadline_s: float, message: str) -> None:
        """Drain `node` with a deadline `deadline_s` from now, and end it then (NodeEnder, placed first)."""
        deadline = time.time() + deadline_s
        if self.ender_cls is not None:
            ender = self.ender_cls.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            await call(ender.remote(), NodeEnder.end_at, deadline)
        await asyncio.get_running_loop().run_in_executor(None, drain_node, node, deadline_s, message)
        log.warning("drained node %s with a %.0f s deadline", node, deadline_s)

    async def _join(self, fault: Fault) -> bool:
        """EMULATION: start a Ray node for `fault.island`'s pool on this machine (module docstring)."""
        spec = self.join_nodes.get(fault.island)
        if spec is None:
            self._record(fault, 0, "skipped: no pool to join for this island")
            return True
        before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        labels = ",".join(f"{k}={v}" for k, v in spec.get("labels", {}).items())
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--address", ray.get_runtime_context().gcs_address,
               "--num-cpus", str(math.ceil(spec.get("num_cpus", 1))),  # `ray start` takes whole CPUs only
               "--object-store-memory", str(JOINED_NODE_OBJECT_STORE_BYTES),
               "--block", "--disable-usage-stats"]
        cmd += ["--labels", labels] if labels else []
        cmd += ["--resources", json.dumps(spec["resources"])] if spec.get("resources") else []
        out = os.path.join(tempfile.gettempdir(), f"diloco-joined-node-{os.getpid()}-{len(self.joined)}.log")
        with open(out, "wb") as f:  # what `ray start` says, if the node does not come up
            self.joined.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        now = time.time()
        self._record(fault, 0, "fired", at=now)
        log.warning("a node joins for island %d's pool (EMULATION: on this machine, labels %s; log %s)",
                    fault.island, labels, out)
        # One node starts at a time: four raylets started at once on a small machine timed out in their start-up.
        proc, waited = self.joined[-1], time.monotonic()
        while proc.poll() is None and time.monotonic() - waited < JOIN_WAIT_S:
            if any(n["Alive"] and n["NodeID"] not in before for n in ray.nodes()):
                break
            await asyncio.sleep(0.5)
        else:
            log.error("the node_joins node did not join (ray start %s); see %s",
                      "exited" if proc.poll() is not None else f"not up after {JOIN_WAIT_S:.0f} s", out)
        if fault.duration_s > 0:
            asyncio.get_running_loop().create_task(self._drain_joined(before, fault))
        return True

    async def _drain_joined(self, before: set[str], fault: Fault) -> None:
        # The new node is the one that was not there before; it is drained once its duration is over.
        await asyncio.sleep(fault.duration_s)
        new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]
        for node in new[:1]:
            await self._drain(node, JOINED_NODE_DEADLINE_S, f"chaos: the node joined for island {fault.island} leaves")

    async def stop(self) -> int:
        """Stop the nodes `node_joins` started (with the run: they must not outlive it); returns how many."""
        for proc in self.joined:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
        for proc in self.joined:
            try:
                await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        return len(self.joined)

    def _record(self, fault: Fault, incarnation: int, outcome: str, at: float | None = None,
                retargeted_from: int | None = None) -> None:
        # retargeted_from: the tape's island, down when the fault was due (Fault.retarget), else None; in every
        # record, so the event log's column is there whichever record comes first.
        self.executed.append({"island": fault.island, "incarnation": incarnation, "kind": fault.kind, "outcome": outcome,
                              "at": at or time.time(), "run_s": (at or time.time()) - self.run_start,
                              "retargeted_from": retargeted_from})

    async def report(self) -> list[dict]:
        """Every fault fired or skipped so far, in order."""
        return list(self.executed)

    async def remaining(self) -> int:
        """Faults on the tape not yet fired or skipped."""
        return len(self.pending)
