"""The outer optimizer's actor shell (`OuterOptimizerActor`, built in orchestrator/actors/remote.py).

The shell admits islands, polls each for submissions, ticks the core (orchestrator/core/outer_optimizer.py)
on one executor thread and publishes each new version once. Its collaborators: the links to the islands
(transport.py), what it published in the downlink's formats (published.py), and the checkpoint writer
and salvage ledger (outer_state.py).

Its heavy dependencies (the tensor core, checkpoints) are imported when the actor is constructed, not
when this module is: Ray imports an actor's class module in every process that gets a handle to the
actor, and the health monitor, which holds one, runs without torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError

from islands.cursor import DataCursor
from islands.messages import FragmentUpdate, Submission
from orchestrator.actors.handles import call
from orchestrator.actors.islands import _IslandShell
from orchestrator.actors.outer_state import CheckpointWriter, SalvageLedger
from orchestrator.actors.runtime import quiet_worker
from orchestrator.actors.transport import IslandTransport, ShellHooks
from policies.network import NetworkModel

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from orchestrator.actors.published import Prepared
    from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings
    from orchestrator.core.rounds import RoundResult
    from orchestrator.core.settings import CheckpointSettings
    from policies.fragments import FragmentPlan

log = logging.getLogger(__name__)


class _OuterShell:
    """Async shell: polls islands for submissions, feeds the core, publishes each new version once.

    It saves the core atomically under `checkpoints.uri` every `checkpoints.every_s` and, when Ray
    restarts it (max_restarts=-1), restores the newest valid checkpoint in __init__ and bumps its
    epoch; the health monitor sees the new epoch, resyncs the islands and registers them again.

    With an EMULATED `network` (policies.network), a submission reaches the core only when its uplink
    transfer on its island's region link completes, and a published fragment reaches an island only
    when its downlink transfer completes (FIFO per link and direction, off the poll loop: the islands
    keep computing). Bytes are counted per link and direction in every scenario. The driver passes the
    network its config's `network:` section builds; None counts the bytes and delays nothing.
    """

    def __init__(self, plan: FragmentPlan, settings: OuterSettings, embedding_names: frozenset[str],
                 checkpoints: CheckpointSettings, *, network: NetworkModel | None,
                 island_regions: dict[int, str] | None = None, buffer_names: frozenset[str] = frozenset()) -> None:
        quiet_worker("outer optimizer")
        import torch

        from orchestrator.actors.published import PublishedFragments
        from orchestrator.core.outer_optimizer import OuterOptimizer

        # The merge is memory- and compute-bound on one thread (docs/outer.md, Round speed); the actor reserves no
        # CPU (num_cpus=0, so Ray sets OMP_NUM_THREADS=1), so more threads are the operator's choice.
        torch.set_num_threads(settings.torch_threads)

        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-core")
        self._t0 = time.monotonic()
        # Start and restart are one path: the driver seeds the store with the initial parameters as
        # checkpoint 0, so no tensor travels in the constructor arguments (which a restart would need).
        self._checkpoints = CheckpointWriter(checkpoints)
        latest = self._checkpoints.load_latest()
        # Rounds hand out the live global tensors: _closing puts each new version in the object store on the core's
        # thread before anything can change them, so no private copy of a fragment is made per round.
        self.core = OuterOptimizer(latest.parameters(), plan, settings=settings, embedding_names=embedding_names,
                                   buffer_names=buffer_names, now=0.0, copy_results=False)
        self.core.load_state_dict(latest.tensors, latest.meta["outer"])
        self.core.build_optimizers()  # off the first round's path (policies/outer_optimizer.py, build)
        self.epoch = latest.meta.get("epoch", -1) + 1  # the seed checkpoint carries epoch -1
        self.core.epoch = self.epoch  # islands name their base's epoch; the core checks bases of its own only
        self.extra: dict = latest.meta.get("extra", {})  # driver metadata saved with each checkpoint
        self.core.progress = self._progress()
        self._monitor_state: dict | None = None
        # What this incarnation started from, for status(): the checkpoint step and its versions.
        self.restored_from = {"step": latest.step, "versions": list(self.core.versions)}
        if self.epoch:
            log.warning("outer optimizer restored checkpoint %d (versions %s), epoch %d",
                        latest.step, self.core.versions, self.epoch)
        self.published = PublishedFragments(settings, [self.core.fragment(p) for p in range(plan.num_fragments)],
                                            self.core.versions)
        hooks = ShellHooks(run_on_core=self._core, live=self._live, stopping=lambda: self._stopping,
                           arrived=self._arrived)
        self.transport = IslandTransport(network, island_regions, self.published, hooks, saved=latest.meta)
        self._salvage = SalvageLedger()
        self._islands: dict[int, tuple[int, ActorHandle[_IslandShell]]] = {}  # island -> (incarnation, handle) while registered
        self._pollers: dict[int, asyncio.Task] = {}
        self._ticker: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._finishing = False  # the final flush has begun: pollers end when their island's outbox is empty
        self._leaving: set[tuple[int, int]] = set()  # (island, incarnation) leaving with its node: its poller ends when empty
        self._events_cursor = (0, 0)

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _core(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _closing(self, fn, *args) -> tuple[Any, list[Prepared]]:
        """On the core's thread: `fn(*args)` (a core call that may close rounds), then each new version put in the
        object store at once, while the core's tensors it returned cannot change. Returns (fn's result, one
        Prepared per RoundResult, in order)."""
        out = fn(*args)
        results = out[0] if isinstance(out, tuple) else out
        return out, [self.published.put(r.tensors) for r in results]

    def _live(self, island: int) -> tuple[int, ActorHandle[_IslandShell]] | None:
        return self._islands.get(island)

    def _progress(self) -> float | None:
        """The run's tokens processed / token budget as the driver last noted it (None before it did)."""
        return self.extra.get("progress")

    # ------------------------------------------------------------ membership

    async def latest(self, island: int | None = None) -> list[FragmentUpdate]:
        """The current version of every fragment, as updates a (re)joining island starts from.

        With `island` (a restarted island, or any island resyncing after this optimizer restarted), the whole
        fragments count as one downlink transfer on that island's region link, and on an EMULATED network the
        answer waits until it arrives: the island fetches the model across the WAN. A run's first start passes
        none, as every island could build the initial model from the seed, which is what data parallel's workers
        do."""
        # The published refs with their own versions: the core's may be ahead of what is published yet.
        updates = [FragmentUpdate(p, v, [self.published.refs[p]], epoch=self.epoch, progress=self._progress())
                   for p, v in enumerate(self.published.versions)]
        if island is not None:
            await self.transport.down(self.transport.region(island), sum(self.published.nbytes))
        return updates

    async def register(self, island: int, incarnation: int, handle: ActorHandle[_IslandShell]) -> None:
        """Admit an island incarnation and start taking its submissions."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self._ticker = asyncio.create_task(self._tick())
        fresh = self.published.may_seed(island, incarnation, self._islands.get(island, (None,))[0])
        held = await self.published.held(handle) if fresh else None
        await self._core(self.core.register, island, incarnation)
        self._islands[island] = (incarnation, handle)
        self.published.admit(island, incarnation, held, self.epoch)
        old = self._pollers.pop(island, None)
        if old is not None:
            old.cancel()
        self._pollers[island] = asyncio.create_task(self._poll(island, incarnation, handle))
        log.info("registered island %d incarnation %d", island, incarnation)

    async def unregister(self, island: int) -> None:
        """Stop taking submissions from an island slot (it died or was stopped)."""
        self._islands.pop(island, None)
        self.published.forget(island)
        task = self._pollers.pop(island, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        await self._core(self.core.unregister, island)
        self._wake_up()

    async def leave(self, island: int, incarnation: int, timeout_s: float) -> dict:
        """An island leaves the run on purpose (its node is drained): it was stopped with `flush`, so take the rest
        of its outbox, wait for the uplink and for the rounds holding its submissions to close, then unregister it.

        What it cut is merged, not lost, and the slot's resume cursor is where its last merged submission ended, so
        the island that fills the slot next reads on from there (exactly once). Returns {"merged": bool (nothing of
        it still pending), "waited_s": seconds, "received": its tokens received (mean over fragments)}; within
        `timeout_s` whatever the answer."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self._leaving.add((island, incarnation))
        try:
            poller = self._pollers.get(island)
            if poller is not None and not poller.done():
                await asyncio.wait([poller], timeout=max(deadline - time.monotonic(), 0.0))
            async def mine() -> bool:  # on its uplink, or waiting in an open round
                return (any(k.island == island for k in self.transport.in_transit)
                        or await self._core(self.core.pending_from, island, incarnation) > 0)
            while time.monotonic() < deadline and await mine():
                self._wake_up()
                await asyncio.sleep(0.05)
            merged = not await mine()
        finally:
            self._leaving.discard((island, incarnation))
        if self._islands.get(island, (None,))[0] == incarnation:
            await self.unregister(island)
        got = await self._core(lambda: list(self.core.received.get((island, incarnation), [])))
        return {"merged": merged, "waited_s": time.monotonic() - t0,
                "received": round(sum(got) / len(got)) if got else 0}

    # ------------------------------------------------------------ data plane

    async def _poll(self, island: int, incarnation: int, handle: ActorHandle[_IslandShell]) -> None:
        while not self._stopping and self._islands.get(island, (None,))[0] == incarnation:
            try:
                sub: Submission | None = await call(handle, _IslandShell.next_submission, 1.0)
            except (RayActorError, RayTaskError) as err:
                reason = str(err).strip().splitlines()[-1][:300]
                log.info("island %d incarnation %d lost: %s", island, incarnation, reason)  # the monitor says it
                if self._islands.get(island, (None,))[0] == incarnation:
                    await self.unregister(island)
                return
            if sub is None:
                if self._finishing or (island, incarnation) in self._leaving:
                    return  # the island stopped and its outbox is empty: nothing more will come
                continue
            self._salvage.took(island, incarnation, sub)
            if self._stopping:
                await self._core(self.core.record_late, sub)
                return
            await self._send_up(island, sub, handle, sent_at=sub.created_at or time.time())

    async def _send_up(self, island: int, sub: Submission, handle: ActorHandle[_IslandShell] | None, sent_at: float) -> None:
        """A submission on its island's uplink: counted, and handed to the core now or, over an EMULATED
        network, when its transfer from `sent_at` completes (meanwhile the caller goes on)."""
        if self.transport.send_up(island, sub, handle, sent_at):
            await self._receive(island, sub, handle)

    async def _arrived(self, island: int, sub: Submission, handle: ActorHandle[_IslandShell] | None) -> None:
        # Off an emulated uplink: taken after stop began, it counts as in flight, never merged.
        if self._stopping:
            await self._core(self.core.record_late, sub)
            return
        await self._receive(island, sub, handle)

    async def _receive(self, island: int, sub: Submission, handle: ActorHandle[_IslandShell] | None) -> None:
        (results, refusal), prepared = await self._core(self._closing, self.core.receive, sub, self._now())
        await self._publish(results, prepared)
        if refusal is not None and handle is not None:  # None: a salvage, whose island is gone
            # Resync the refused island's fragment to the current version (or just clear its bookkeeping).
            p = refusal.fragment
            if 0 <= p < len(self.published.refs):
                # The float32 values only matter to a difference (outer.downlink_delta); else no copy is made.
                delta = self.published.delta
                # A difference is taken from the core's float32 copy, so it carries the core's version; a whole
                # fragment is the published ref, so it carries the ref's (the core's may not be published yet).
                version, tensors = (await self._core(lambda: (self.core.versions[p], self.core.fragment(p))) if delta
                                    else (self.published.versions[p], None))
                update = FragmentUpdate(p, version, [self.published.refs[p]], refused=(refusal.key,), epoch=self.epoch,
                                        progress=self._progress())
                self.transport.send_down(island, handle, update, tensors)

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
            await self._publish(*await self._core(self._closing, self.core.poll, self._now()))
            if self._checkpoints.due():
                await self.checkpoint()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _publish(self, results: list[RoundResult], prepared: list[Prepared]) -> None:
        # `result.tensors` are the core's live tensors, already put (_closing): only `prepared` is used here.
        for result, ready in zip(results, prepared):
            t0 = time.perf_counter()
            ref = self.published.publish(result.fragment, result.version, ready)
            update = FragmentUpdate(result.fragment, result.version, [ref], merged=result.merged,
                                    refused=result.refused, epoch=self.epoch, progress=self._progress())
            if not self._finishing:  # after the final flush nobody trains on it any more
                to = set(result.record.participants) if self.core.settings.publish_to == "participants" else None
                for island, (_, handle) in list(self._islands.items()):
                    if to is None or island in to:
                        self.transport.send_down(island, handle, update, ready.copy)
            await self._core(self.core.observe_publish, time.perf_counter() - t0 + ready.seconds, result.record.merge_s)

    # ------------------------------------------------------------ control plane

    async def status(self) -> dict:
        """Versions, live islands, round and refusal counts, token ledger and tokens received per incarnation, bytes,
        the checkpoint restored from."""
        out = await self._core(_status_of, self.core)
        out.update(self.transport.status())  # bytes and transfers per link (refused and in flight incl.), delays
        out["restored_from"] = dict(self.restored_from)  # {"step", "versions"} this incarnation loaded
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

    async def served_parameters(self) -> dict:
        """Copies of the run's model by name (evaluation): the moving average under run.average_window, else
        the global parameters."""
        return await self._core(self.core.served_parameters)

    async def checkpoint(self) -> dict:
        """Save the core now (snapshot on the core thread, write on the writer thread).

        Returns {"step", "versions"}: the checkpoint's number and the fragment versions it holds,
        taken in the same snapshot (a status() call afterwards may already see a newer round)."""
        self._checkpoints.mark()
        tensors, meta = await self._core(self.core.state_dict)
        meta = {"outer": meta, "epoch": self.epoch, "extra": dict(self.extra), "saved_at": time.time(),
                **self.transport.saved()}
        step = await self._checkpoints.save(tensors, meta)
        return {"step": step, "versions": list(meta["outer"]["versions"])}

    async def note(self, **extra) -> None:
        """Driver metadata to keep with the next checkpoint (tokens processed, run id, ...)."""
        self.extra.update(extra)
        self.core.progress = self._progress()  # the grace window's tau may follow the run's progress

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
        """For the health monitor: restart epoch, islands that sent non-finite values, islands marked for a restart
        by the poison guard (`outer.poison_restart_after` refusals in a row, or one far out of line), registry."""
        diverged = await self._core(self.core.take_diverged)
        poisoned = await self._core(self.core.take_poisoned)
        islands = await self._core(lambda: {str(k): v for k, v in self.core.islands.items()})
        return {"epoch": self.epoch, "diverged": sorted(diverged), "poisoned": sorted(poisoned), "islands": islands,
                "poison_restart_after": self.core.streaks.restart_after}

    async def resume_cursor(self, island: int) -> DataCursor:
        """Where a new incarnation of the slot resumes its data (an islands.cursor.DataCursor): after the newest
        merged submission, or after everything taken from or salvaged of the incarnation that died (whichever is later)."""
        merged = await self._core(lambda: self.core.resume_cursor.get(island, DataCursor()))
        return max(merged, self._salvage.floor(island))

    async def salvage(self, island: int, incarnation: int, blob: list[Any]) -> dict:
        """Merge what is still valid of a dead incarnation's progress snapshot (policies/salvage.py).

        `blob`: [ref to the pickled ProgressSnapshot the pool's keeper held, or to None]. The accepted
        submissions take the island's uplink like any other (EMULATED delay included) and join the next
        round of their fragment without counting toward its quorum. Returns {"tokens": per fragment,
        "step", "skipped": {fragment: why}, "seqs": of the salvaged submissions}, or {"keeper_error": why}
        when the keeper could not be asked.
        """
        return await self._salvage.salvage(island, incarnation, blob, run_on_core=self._core, send_up=self._send_up,
                                           epoch=self.epoch, fragments=self.core.plan.num_fragments)

    async def accounting(self) -> dict:
        """Useful time, version advance times, and per-incarnation received tokens (goodput, token fates)."""
        return await self._core(_accounting_of, self.core)

    async def hold(self) -> None:
        """Before the islands stop with flush: queue what arrives, close no round until `finish`."""
        await self._core(self.core.hold)

    async def finish(self, timeout_s: float = 60.0) -> int:
        """The final flush, after the islands stopped with `flush=True`: take their last submissions,
        wait for their (emulated) uplinks, then close every round that has any, whatever the quorum
        says. Without it the last H/P steps of every island would end the run unmerged. Returns the
        number of rounds it closed."""
        self._finishing = True
        deadline = time.monotonic() + timeout_s
        pollers = [t for t in self._pollers.values() if not t.done()]
        if pollers:
            await asyncio.wait(pollers, timeout=timeout_s)
        while self.transport.in_transit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        results, prepared = await self._core(self._closing, self.core.close_all, self._now())
        await self._publish(results, prepared)
        return len(results)

    async def stop(self) -> dict:
        """Stop polling; submissions already taken count as in flight. Returns the final ledger."""
        self._stopping = True
        self._wake_up()
        tasks = list(self._pollers.values()) + ([self._ticker] if self._ticker else [])
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        # Submissions still on an emulated uplink were taken: they count as in flight at stop.
        for sub in self.transport.take_in_transit():
            await self._core(self.core.record_late, sub)
        self.transport.cancel()
        return await self._core(self.core.ledger)


def _status_of(core: OuterOptimizer) -> dict:
    """The core's part of `status()` (run on the core's thread). The ledger and the per-incarnation tokens
    received come from one moment, so that the token fates computed from them add up (core/accounting.py)."""
    return {
        "versions": list(core.versions), "islands": dict(core.islands), "rounds": len(core.rounds),
        "refusals": len(core.refusals), "ledger": core.ledger(), "bytes_up": core.bytes_received,
        "received": [[i, inc, list(toks)] for (i, inc), toks in core.received.items()],
        "step_time_s": core.step_time.value, "sync_time_s": core.sync_time.value,
    }


def _accounting_of(core: OuterOptimizer) -> dict:
    """The core's part of `accounting()` (run on the core's thread)."""
    return {"useful_s": core.useful_s, "advances": list(core.advances), "first_merged": dict(core.first_merged),
            "received": [[i, inc, toks] for (i, inc), toks in core.received.items()]}
