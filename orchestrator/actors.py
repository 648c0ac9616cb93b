"""The Ray edge: thin actor shells over the plain classes. `ray.remote` is applied here and only here.

- `IslandActor` wraps islands.island.LearnerIsland (threaded: the inner loop runs in its own thread,
  control calls are served concurrently by the actor's thread pool).
- `OuterOptimizerActor` wraps orchestrator.outer_optimizer.OuterOptimizer (async: it keeps one
  outstanding `next_submission` call per island and takes results as they arrive, so it owns every
  submission ref; core work runs on one executor thread, so the plain class needs no locks).

Ray facts that shape this are in DESIGN.md section 4 and shared/notes/ray-2.60.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import warnings
from typing import Any

import ray
import torch
from ray._private.tensor_serialization_utils import ZeroCopyTensorsWarning
from ray.exceptions import RayActorError, RayTaskError

from islands.island import IslandSpec, LearnerIsland
from islands.messages import FragmentUpdate, Submission
from orchestrator.chaos_injector import ChaosInjector
from orchestrator.checkpoint import CheckpointStore
from orchestrator.health_monitor import HealthMonitor
from orchestrator.outer_optimizer import OuterOptimizer, OuterSettings, RoundResult
from policies.fragments import FragmentPlan

log = logging.getLogger(__name__)

NAMESPACE = "diloco"
# Tensor gets near free; fetched tensors are shared memory and are never modified in place. Arguments
# are deserialized before __init__ runs, so the read-only-array notice is silenced by the environment.
WORKER_ENV = {
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "PYTHONWARNINGS": "ignore:The given NumPy array is not writable:UserWarning",
}


def ignore_zero_copy_warnings() -> None:
    """Silence Ray's zero-copy notices: fetched tensors are copied into our own, never written in place."""
    warnings.filterwarnings("ignore", category=ZeroCopyTensorsWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _quiet_worker() -> None:
    # Actor INFO lines would be forwarded to the driver's console and break its progress line;
    # warnings still reach it.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ignore_zero_copy_warnings()


class _IslandShell:
    """A LearnerIsland process. Created with a spec it trains at once; created without one it is a
    warm spare (imports done, data fetched, no training) until `activate` gives it an island slot.

    Restarting an island cold costs a new worker process and importing torch (~20 s on a busy 2-core
    machine); activating a spare costs building the model (well under a second).
    """

    def __init__(self, spec: IslandSpec | None, data: list[Any], initial: list[FragmentUpdate] | None = None,
                 cursor: int = 0) -> None:
        _quiet_worker()
        self._data = ray.get(data[0])  # fetched once, zero-copy, before any slot needs it
        self._island: LearnerIsland | None = None
        if spec is not None:
            self.activate(spec, initial or [], cursor)

    def activate(self, spec: IslandSpec, initial: list[FragmentUpdate], cursor: int = 0) -> tuple[int, int]:
        """Become island `spec.island`, incarnation `spec.incarnation`, and start training."""
        if self._island is not None:
            raise RuntimeError(f"this process already is island {self._island.spec.island}; it cannot be activated twice")
        torch.set_num_threads(spec.inner.torch_threads)  # the process is this island's alone
        self._island = LearnerIsland(spec, self._data, initial, cursor=cursor, resolve=ray.get)
        self._island.start()
        return spec.island, spec.incarnation

    def _live(self) -> LearnerIsland:
        if self._island is None:
            raise RuntimeError("this island process is a spare and has not been activated")
        return self._island

    def ping(self) -> tuple[int | None, int | None, float]:
        """Liveness probe: (island, incarnation, wall time); (None, None, t) for a spare."""
        if self._island is None:
            return None, None, time.time()
        return self._island.spec.island, self._island.spec.incarnation, time.time()

    def node_id(self) -> str:
        """The Ray node this process runs on (placement checks)."""
        return ray.get_runtime_context().get_node_id()

    # The island's interface, delegated (see islands.island.LearnerIsland for each method).
    def next_submission(self, timeout_s: float = 1.0):
        return self._live().next_submission(timeout_s)

    def adopt(self, update: FragmentUpdate) -> None:
        self._live().adopt(update)

    def status(self):
        return self._live().status()

    def stop(self, timeout_s: float = 30.0):
        return self._live().stop(timeout_s)

    def watch(self, timeout_s: float = 5.0) -> str:
        return self._live().watch(timeout_s)

    def inject(self, kind: str, *, duration_s: float = 0.0, factor: float = 1.0) -> None:
        self._live().inject(kind, duration_s=duration_s, factor=factor)

    def resync(self, latest: list[FragmentUpdate]) -> None:
        self._live().resync(latest)

    def parameters(self) -> dict:
        return self._live().parameters()


class _OuterShell:
    """Async shell: polls islands for submissions, feeds the core, publishes each new version once.

    With a checkpoint URI it saves the core atomically every `checkpoint_every_s` and, when Ray
    restarts it (max_restarts=-1), restores the newest valid checkpoint in __init__ and bumps its
    epoch; the health monitor sees the new epoch, resyncs the islands and registers them again.
    """

    def __init__(self, plan: FragmentPlan, settings: OuterSettings, embedding_names: frozenset[str],
                 checkpoint_uri: str, checkpoint_every_s: float = 30.0, checkpoint_keep: int = 3) -> None:
        _quiet_worker()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-core")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-ckpt")
        self._t0 = time.monotonic()
        # Start and restart are one path: the driver seeds the store with the initial parameters as
        # checkpoint 0, so no tensor travels in the constructor arguments (which a restart would need).
        self._store = CheckpointStore(checkpoint_uri, keep=checkpoint_keep)
        latest = self._store.load_latest()
        if latest is None:
            raise RuntimeError(f"no valid checkpoint under {checkpoint_uri}; the driver seeds checkpoint 0 before starting")
        initial = {name[len("param/"):]: t for name, t in latest.tensors.items() if name.startswith("param/")}
        self.core = OuterOptimizer(initial, plan, settings=settings, embedding_names=embedding_names, now=0.0)
        self.core.load_state_dict(latest.tensors, latest.meta["outer"])
        self._ckpt_every = checkpoint_every_s
        self._ckpt_step = latest.step
        self._last_ckpt = time.monotonic()
        self.epoch = latest.meta.get("epoch", -1) + 1  # the seed checkpoint carries epoch -1
        self.extra: dict = latest.meta.get("extra", {})  # driver metadata saved with each checkpoint
        self._monitor_state: dict | None = None
        if self.epoch:
            log.warning("outer optimizer restored checkpoint %d (versions %s), epoch %d",
                        latest.step, self.core.versions, self.epoch)
        # The latest published version of every fragment: one ray.put each, handed out as [ref].
        self._refs = [ray.put(self.core.fragment(p)) for p in range(plan.num_fragments)]
        self._islands: dict[int, tuple[int, Any]] = {}
        self._pollers: dict[int, asyncio.Task] = {}
        self._ticker: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._bytes_down = 0
        self._events_cursor = (0, 0)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _core(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------ membership

    async def latest(self) -> list[FragmentUpdate]:
        """The current version of every fragment, as updates a (re)joining island starts from."""
        versions = await self._core(lambda: list(self.core.versions))
        return [FragmentUpdate(p, v, [self._refs[p]]) for p, v in enumerate(versions)]

    async def register(self, island: int, incarnation: int, handle: Any) -> None:
        """Admit an island incarnation and start taking its submissions."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self._ticker = asyncio.create_task(self._tick())
        await self._core(self.core.register, island, incarnation)
        self._islands[island] = (incarnation, handle)
        old = self._pollers.pop(island, None)
        if old is not None:
            old.cancel()
        self._pollers[island] = asyncio.create_task(self._poll(island, incarnation, handle))
        log.info("registered island %d incarnation %d", island, incarnation)

    async def unregister(self, island: int) -> None:
        """Stop taking submissions from an island slot (it died or was stopped)."""
        self._islands.pop(island, None)
        task = self._pollers.pop(island, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        await self._core(self.core.unregister, island)
        self._wake_up()

    # ------------------------------------------------------------ data plane

    async def _poll(self, island: int, incarnation: int, handle: Any) -> None:
        while not self._stopping and self._islands.get(island, (None,))[0] == incarnation:
            try:
                sub: Submission | None = await handle.next_submission.remote(1.0)
            except (RayActorError, RayTaskError) as err:
                reason = str(err).strip().splitlines()[-1][:300]
                log.warning("island %d incarnation %d lost: %s", island, incarnation, reason)
                if self._islands.get(island, (None,))[0] == incarnation:
                    await self.unregister(island)
                return
            if sub is None:
                continue
            if self._stopping:
                await self._core(self.core.record_late, sub)
                return
            results, refusal = await self._core(self.core.receive, sub, self._now())
            await self._publish(results)
            if refusal is not None:
                # Resync the refused island's fragment to the current version (or just clear its bookkeeping).
                version = await self._core(lambda: self.core.versions[refusal.fragment]) if 0 <= refusal.fragment < len(self._refs) else None
                if version is not None:
                    handle.adopt.remote(FragmentUpdate(refusal.fragment, version, [self._refs[refusal.fragment]], refused=(refusal.key,)))

    async def _tick(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            wait = await self._core(self.core.next_wakeup_s, self._now())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(wait, 0.25))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                return
            await self._publish(await self._core(self.core.poll, self._now()))
            if time.monotonic() - self._last_ckpt >= self._ckpt_every:
                await self.checkpoint()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _publish(self, results: list[RoundResult]) -> None:
        for result in results:
            t0 = time.perf_counter()
            ref = ray.put(result.tensors)
            self._refs[result.fragment] = ref  # dropping the old ref lets the store free it
            update = FragmentUpdate(result.fragment, result.version, [ref], merged=result.merged)
            nbytes = sum(t.numel() * t.element_size() for t in result.tensors)
            for _, handle in list(self._islands.values()):
                handle.adopt.remote(update)  # fire and forget: a dead island shows up in its poller
                self._bytes_down += nbytes
            await self._core(self.core.observe_publish, time.perf_counter() - t0, result.record.merge_s)

    # ------------------------------------------------------------ control plane

    async def status(self) -> dict:
        """Versions, live islands, round and refusal counts, token ledger, bytes."""
        def snapshot() -> dict:
            c = self.core
            return {
                "versions": list(c.versions), "islands": dict(c.islands), "rounds": len(c.rounds),
                "refusals": len(c.refusals), "ledger": c.ledger(), "bytes_up": c.bytes_received,
                "step_time_s": c.step_time.value, "sync_time_s": c.sync_time.value,
            }
        out = await self._core(snapshot)
        out["bytes_down"] = self._bytes_down
        return out

    async def drain_events(self) -> dict:
        """Rounds and refusals recorded since the previous drain (for the event log)."""
        def take() -> dict:
            r0, f0 = self._events_cursor
            rounds, refusals = self.core.rounds[r0:], self.core.refusals[f0:]
            self._events_cursor = (len(self.core.rounds), len(self.core.refusals))
            return {"rounds": rounds, "refusals": refusals}
        return await self._core(take)

    async def global_parameters(self) -> dict:
        """Copies of all current global parameters by name (evaluation, checkpoints)."""
        return await self._core(self.core.global_parameters)

    async def checkpoint(self) -> int:
        """Save the core now (snapshot on the core thread, write on the writer thread); returns the step."""
        self._last_ckpt = time.monotonic()
        tensors, meta = await self._core(self.core.state_dict)
        self._ckpt_step += 1
        step = self._ckpt_step
        meta = {"outer": meta, "epoch": self.epoch, "extra": dict(self.extra), "saved_at": time.time()}
        await asyncio.get_running_loop().run_in_executor(self._writer, self._store.save, step, tensors, meta)
        return step

    async def note(self, **extra) -> None:
        """Driver metadata to keep with the next checkpoint (tokens processed, run id, ...)."""
        self.extra.update(extra)

    async def restored_extra(self) -> dict:
        """The driver metadata this incarnation restored from its checkpoint ({} when it started fresh)."""
        return dict(self.extra)

    async def keep_monitor_state(self, state: dict) -> None:
        """Hold the health monitor's bookkeeping so a restarted monitor can pick it up."""
        self._monitor_state = state

    async def monitor_state(self) -> dict | None:
        """The bookkeeping the health monitor last parked here (None before the first)."""
        return self._monitor_state

    async def health(self) -> dict:
        """For the health monitor: restart epoch, islands that sent non-finite values, registry."""
        diverged = await self._core(self.core.take_diverged)
        islands = await self._core(lambda: {str(k): v for k, v in self.core.islands.items()})
        return {"epoch": self.epoch, "diverged": sorted(diverged), "islands": islands}

    async def resume_cursor(self, island: int) -> int:
        """The data cursor of the island's newest merged submission (where a new incarnation resumes)."""
        return await self._core(lambda: self.core.resume_cursor.get(island, 0))

    async def accounting(self) -> dict:
        """Useful time, version advance times, and per-incarnation received tokens (goodput, token fates)."""
        def take() -> dict:
            c = self.core
            return {"useful_s": c.useful_s, "advances": list(c.advances),
                    "received": [[i, inc, toks] for (i, inc), toks in c.received.items()]}
        return await self._core(take)

    async def stop(self) -> dict:
        """Stop polling; submissions already taken count as in flight. Returns the final ledger."""
        self._stopping = True
        self._wake_up()
        tasks = list(self._pollers.values()) + ([self._ticker] if self._ticker else [])
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        return await self._core(self.core.ledger)


IslandActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=8)(_IslandShell)
# The outer optimizer restarts itself from its checkpoint; the island actors are rebuilt by the health
# monitor instead (a new incarnation each time), and the monitor re-adopts islands when it restarts.
OuterOptimizerActor = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=64)(_OuterShell)
HealthMonitorActor = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=64)(HealthMonitor)
ChaosInjectorActor = ray.remote(max_restarts=0, max_concurrency=16)(ChaosInjector)
