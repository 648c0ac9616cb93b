"""The outer optimizer's actor shell (`OuterOptimizerActor`, built in orchestrator/actors/remote.py).

Its heavy dependencies (the tensor core, checkpoints) are imported when the actor is constructed, not
when this module is: Ray imports an actor's class module in every process that gets a handle to the
actor, and the health monitor, which holds one, runs without torch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from islands.messages import FragmentUpdate, Submission
from orchestrator.actors.runtime import quiet_worker
from policies.network import LinkSchedule, NetworkModel

if TYPE_CHECKING:
    from orchestrator.core.outer_optimizer import OuterSettings, RoundResult
    from policies.fragments import FragmentPlan

log = logging.getLogger(__name__)
# Published versions per fragment kept decoded for registering islands (differences down only): a restarted
# island registers a second or two after it fetched latest(), while K = 1 rounds go on.
_REMEMBERED_VERSIONS = 4

# How long a downlink sender waits for an island to confirm a difference before the next goes whole.
_ADOPT_ACK_S = 30.0


class _OuterShell:
    """Async shell: polls islands for submissions, feeds the core, publishes each new version once.

    With a checkpoint URI it saves the core atomically every `checkpoint_every_s` and, when Ray
    restarts it (max_restarts=-1), restores the newest valid checkpoint in __init__ and bumps its
    epoch; the health monitor sees the new epoch, resyncs the islands and registers them again.

    With an EMULATED `network` (policies.network), a submission reaches the core only when its uplink
    transfer on its island's region link completes, and a published fragment reaches an island only
    when its downlink transfer completes (FIFO per link and direction, off the poll loop: the islands
    keep computing). Bytes are counted per link and direction in every scenario.
    """

    def __init__(self, plan: FragmentPlan, settings: OuterSettings, embedding_names: frozenset[str],
                 checkpoint_uri: str, checkpoint_every_s: float = 30.0, checkpoint_keep: int = 3,
                 network: NetworkModel | None = None, island_regions: dict[int, str] | None = None) -> None:
        quiet_worker()
        from orchestrator.core.checkpoint import CheckpointStore
        from orchestrator.core.outer_optimizer import OuterOptimizer
        from policies.downlink import DownlinkCopies, decode_fragment

        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-core")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-ckpt")
        self._t0 = time.monotonic()
        # Start and restart are one path: the driver seeds the store with the initial parameters as
        # checkpoint 0, so no tensor travels in the constructor arguments (which a restart would need).
        self._store = CheckpointStore(checkpoint_uri, keep=checkpoint_keep)
        latest = self._store.load_latest()
        if latest is None:
            raise RuntimeError(f"no valid checkpoint under {checkpoint_uri}; the driver seeds checkpoint 0 before starting")
        initial = latest.parameters()
        self.core = OuterOptimizer(initial, plan, settings=settings, embedding_names=embedding_names, now=0.0)
        self.core.load_state_dict(latest.tensors, latest.meta["outer"])
        self._ckpt_every = checkpoint_every_s
        self._ckpt_step = latest.step
        self._last_ckpt = time.monotonic()
        self.epoch = latest.meta.get("epoch", -1) + 1  # the seed checkpoint carries epoch -1
        self.extra: dict = latest.meta.get("extra", {})  # driver metadata saved with each checkpoint
        self.core.progress = self._progress()
        self._monitor_state: dict | None = None
        # What this incarnation started from, for status(): the checkpoint step and its versions.
        self.restored_from = {"step": latest.step, "versions": list(self.core.versions)}
        if self.epoch:
            log.warning("outer optimizer restored checkpoint %d (versions %s), epoch %d",
                        latest.step, self.core.versions, self.epoch)
        # What each island holds of each fragment, when versions go down as differences (outer.downlink_delta);
        # its `whole` is the format of every whole fragment that goes down.
        self._copies = DownlinkCopies(settings.downlink, settings.downlink_delta, block_size=settings.compression_block_size,
                                     density=settings.topk_density)
        # The latest published version of every fragment, in its wire format: one ray.put each, handed out as [ref].
        wire = [self._copies.whole(self.core.fragment(p)) for p in range(plan.num_fragments)]
        self._refs = [ray.put(w) for w in wire]
        # Bytes of one published fragment on the wire: fixed for the run (shapes and format do not change).
        self._fragment_nbytes = [sum(t.nbytes for t in w) for w in wire]  # torch tensors and Compressed alike
        # With differences down: the last few published versions as islands decode them, per fragment, so that an
        # island registering with one of them gets differences from it at once, not the whole fragment again.
        self._decoded: list[collections.OrderedDict[int, list]] = [collections.OrderedDict() for _ in wire]
        if self._copies.delta is not None:
            for p, w in enumerate(wire):
                self._decoded[p][self.core.versions[p]] = decode_fragment(w)
        self._decode = decode_fragment
        # Island incarnations this shell has sent a difference to: what they hold may then differ from any whole
        # version by rounding, so they are never seeded again (an unregistered incarnation registering anew).
        self._diffed: set[tuple[int, int]] = set()
        self._islands: dict[int, tuple[int, Any]] = {}
        self._pollers: dict[int, asyncio.Task] = {}
        self._ticker: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._finishing = False  # the final flush has begun: pollers end when their island's outbox is empty
        self._events_cursor = (0, 0)
        # Island i's traffic uses its pool region's link; no network = scenario none (count, never delay).
        self._network = network or NetworkModel("none", "local", {}, emulated=False)
        self._links = LinkSchedule(self._network)
        # Counting goes on across a restart from the newest checkpoint (what crossed a link after it is not counted).
        if "links" in latest.meta:
            self._links.restore_counters(latest.meta["links"])
        self._regions = {int(i): r for i, r in (island_regions or {}).items()}
        self._in_transit: dict[Any, Submission] = {}  # submission key -> submission on its uplink
        self._transfers: set[asyncio.Task] = set()
        self._network_wait_s = {"up": 0.0, "down": 0.0}  # delivery delay added by the emulated links
        self._network_wait_s.update(latest.meta.get("network_wait_s", {}))
        # island -> fragment -> (newest waiting update, its float32 tensors: what a difference is taken of)
        self._down_queue: dict[int, dict[int, tuple[FragmentUpdate, list]]] = {}
        self._down_senders: set[int] = set()  # islands whose downlink sender task is running
        # (island, incarnation) -> {"seq": {fragment: highest seq taken}, "cursor": highest data cursor taken}:
        # what a salvaged snapshot is checked against (policies/salvage.py).
        self._taken: dict[tuple[int, int], dict] = {}
        self._resume_floor: dict[int, int] = {}  # island slot -> cursor its next incarnation resumes from at least

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _core(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------ membership

    async def latest(self, island: int | None = None) -> list[FragmentUpdate]:
        """The current version of every fragment, as updates a (re)joining island starts from.

        With `island` (a restarted island, or any island resyncing after this optimizer restarted), the whole
        fragments count as one downlink transfer on that island's region link, and on an EMULATED network the
        answer waits until it arrives: the island fetches the model across the WAN. A run's first start passes
        none, as every island could build the initial model from the seed, which is what data parallel's workers
        do."""
        versions = await self._core(lambda: list(self.core.versions))
        updates = [FragmentUpdate(p, v, [self._refs[p]], epoch=self.epoch, progress=self._progress())
                   for p, v in enumerate(versions)]
        if island is not None:
            await self._down(self._region(island), sum(self._fragment_nbytes))
        return updates

    async def register(self, island: int, incarnation: int, handle: Any) -> None:
        """Admit an island incarnation and start taking its submissions."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self._ticker = asyncio.create_task(self._tick())
        # Asked before it is admitted, while nothing is sent to it, so the answer cannot change until it is.
        fresh = self._islands.get(island, (None,))[0] != incarnation and (island, incarnation) not in self._diffed
        held = await self._held(handle) if fresh else None
        await self._core(self.core.register, island, incarnation)
        self._islands[island] = (incarnation, handle)
        self._copies.forget(island)  # it starts from latest() (or kept what it had): whole fragments first...
        for p, (version, epoch) in enumerate(held or []):  # ...unless it holds a version we published and remember
            if epoch == self.epoch and version in self._decoded[p]:
                self._copies.seed(island, incarnation, p, version, self._decoded[p][version])
        old = self._pollers.pop(island, None)
        if old is not None:
            old.cancel()
        self._pollers[island] = asyncio.create_task(self._poll(island, incarnation, handle))
        log.info("registered island %d incarnation %d", island, incarnation)

    async def _held(self, handle: Any) -> list[tuple[int, int]] | None:
        """(version, epoch) of every fragment an island holds, when differences go down (None: not asked, or no
        answer within 10 s; it then gets whole fragments first)."""
        if self._copies.delta is None:
            return None
        try:
            st = await asyncio.wait_for(handle.status.remote(), timeout=10.0)  # an ObjectRef is awaitable
        except Exception as err:  # noqa: BLE001 - an island that cannot answer gets whole fragments, as before
            log.info("island status for downlink copies unavailable (%s): whole fragments first", err)
            return None
        return list(zip(st.versions, st.epochs)) if len(st.epochs) == len(st.versions) else None

    async def unregister(self, island: int) -> None:
        """Stop taking submissions from an island slot (it died or was stopped)."""
        self._islands.pop(island, None)
        self._copies.forget(island)
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
                if self._finishing:
                    return  # the island stopped and its outbox is empty: nothing more will come
                continue
            taken = self._taken.setdefault((island, incarnation), {"seq": {}, "cursor": 0})
            taken["seq"][sub.fragment] = max(taken["seq"].get(sub.fragment, -1), sub.seq)
            taken["cursor"] = max(taken["cursor"], sub.cursor)
            if self._stopping:
                await self._core(self.core.record_late, sub)
                return
            await self._send_up(island, sub, handle, sent_at=sub.created_at or time.time())

    async def _send_up(self, island: int, sub: Submission, handle: Any, sent_at: float) -> None:
        """A submission on its island's uplink: counted, and handed to the core now or, over an EMULATED
        network, when its transfer from `sent_at` completes (a task, so the caller goes on meanwhile)."""
        region = self._region(island)
        if self._network.emulated:
            done_at = self._links.reserve(region, "up", sub.nbytes, sent_at)
            self._in_transit[sub.key] = sub
            self._spawn(self._arrive(island, sub, handle, done_at))
            return
        self._links.account(region, "up", sub.nbytes)
        await self._receive(island, sub, handle)

    async def _receive(self, island: int, sub: Submission, handle: Any) -> None:
        results, refusal = await self._core(self.core.receive, sub, self._now())
        await self._publish(results)
        if refusal is not None and handle is not None:  # None: a salvage, whose island is gone
            # Resync the refused island's fragment to the current version (or just clear its bookkeeping).
            p = refusal.fragment
            if 0 <= p < len(self._refs):
                version, tensors = await self._core(lambda: (self.core.versions[p], self.core.fragment(p)))
                self._send_down(island, handle, FragmentUpdate(p, version, [self._refs[p]], refused=(refusal.key,),
                                                               epoch=self.epoch, progress=self._progress()), tensors)

    def _progress(self) -> float | None:
        """The run's tokens processed / token budget as the driver last noted it (None before it did)."""
        return self.extra.get("progress")

    def _region(self, island: int) -> str:
        return self._regions.get(island, self._network.hub)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._transfers.add(task)  # keep a reference: the loop only holds tasks weakly
        task.add_done_callback(self._transfer_done)

    def _transfer_done(self, task: asyncio.Task) -> None:
        self._transfers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("emulated network transfer failed: %r", task.exception())

    async def _arrive(self, island: int, sub: Submission, handle: Any, done_at: float) -> None:
        """An uplink transfer: wait until it completes, then hand the submission to the core."""
        wait = done_at - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if self._in_transit.pop(sub.key, None) is None:
            return  # stop() already counted it as in flight
        self._network_wait_s["up"] += max(wait, 0.0)
        if self._stopping:
            await self._core(self.core.record_late, sub)
            return
        await self._receive(island, sub, handle)

    def _send_down(self, island: int, handle: Any, update: FragmentUpdate, tensors: list) -> None:
        """Send a fragment version to an island: now, or over its EMULATED downlink, whole or as a difference.

        `update.tensors` is the version's shared whole-fragment ref; `tensors` are its float32 values,
        from which a difference from the island's copy is taken (outer.downlink_delta).

        Whole fragments with no emulated network go at once (fire and forget). Otherwise each island has
        one sender that always sends the newest version of each fragment: a version published while an
        older one still waits replaces it (its merged/refused keys carried over), so a slow link delays
        adoption but never builds a backlog of versions nobody needs any more.
        """
        region = self._region(island)
        if not self._network.emulated and self._copies.delta is None:
            self._links.account(region, "down", self._fragment_nbytes[update.fragment])
            handle.adopt.remote(update)  # fire and forget: a dead island shows up in its poller
            return
        queue = self._down_queue.setdefault(island, {})
        waiting = queue.get(update.fragment)
        if waiting is not None:
            older, older_tensors = waiting
            if older.version > update.version:
                (older, older_tensors), (update, tensors) = (update, tensors), (older, older_tensors)
            update = dataclasses.replace(update, merged=older.merged + update.merged, refused=older.refused + update.refused)
        queue[update.fragment] = (update, tensors)  # a replaced entry keeps its place in the queue
        if island not in self._down_senders:
            self._down_senders.add(island)
            self._spawn(self._deliver(island, region))

    def _encode(self, island: int, incarnation: int, update: FragmentUpdate, tensors: list) -> tuple[FragmentUpdate, int]:
        """(update as sent, bytes on the wire) for this island's copy: whole or a difference (delta mode only)."""
        enc = self._copies.encode(island, incarnation, update.fragment, update.version, tensors)
        if enc.delta_from is not None:
            self._diffed.add((island, incarnation))
        return dataclasses.replace(update, tensors=[ray.put(enc.payload)], delta_from=enc.delta_from), enc.nbytes

    async def _down(self, region: str, nbytes: int) -> None:
        """`nbytes` on `region`'s downlink: counted, and over an EMULATED network awaited until they arrive
        (queued behind the link's earlier transfers; the wait counts as delivery delay)."""
        if not self._network.emulated:
            self._links.account(region, "down", nbytes)
            return
        wait = self._links.reserve(region, "down", nbytes, time.time()) - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._network_wait_s["down"] += max(wait, 0.0)

    async def _deliver(self, island: int, region: str) -> None:
        """One island's downlink: the oldest waiting fragment first, one transfer at a time.

        With differences (outer.downlink_delta) each one is encoded just before it goes, from the copy
        the island holds after the previous one, and awaited: the island must adopt them in order. A
        send that fails, or whose island changed incarnation meanwhile, makes the next one whole.
        """
        delta = self._copies.delta is not None
        try:
            queue = self._down_queue.get(island, {})
            while queue and not self._stopping:
                fragment = next(iter(queue))
                update, tensors = queue.pop(fragment)
                live = self._islands.get(island)
                if live is None:
                    continue
                if delta:
                    update, nbytes = await self._core(self._encode, island, live[0], update, tensors)
                else:
                    nbytes = self._fragment_nbytes[fragment]
                await self._down(region, nbytes)
                now_live = self._islands.get(island)
                if now_live is None or now_live[0] != live[0] or self._stopping:
                    self._copies.forget(island)  # never delivered: whatever goes next goes whole
                    continue
                ack = now_live[1].adopt.remote(update)
                if not delta:
                    continue  # whole fragments need no order: fire and forget
                try:
                    await asyncio.wait_for(ack, timeout=_ADOPT_ACK_S)  # an ObjectRef is awaitable
                except (asyncio.TimeoutError, RayActorError, RayTaskError) as err:
                    log.warning("island %d did not confirm fragment %d v%d (%s); its next fragments go whole",
                                island, update.fragment, update.version, type(err).__name__)
                    self._copies.forget(island)
        finally:
            self._down_senders.discard(island)

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
            whole = await self._core(self._copies.whole, result.tensors)
            ref = ray.put(whole)
            if self._copies.delta is not None:
                recent = self._decoded[result.fragment]
                recent[result.version] = await self._core(self._decode, whole)
                while len(recent) > _REMEMBERED_VERSIONS:
                    recent.popitem(last=False)
            self._refs[result.fragment] = ref  # dropping the old ref lets the store free it
            update = FragmentUpdate(result.fragment, result.version, [ref], merged=result.merged, epoch=self.epoch,
                                    progress=self._progress())
            if not self._finishing:  # after the final flush nobody trains on it any more
                to = set(result.record.participants) if self.core.settings.publish_to == "participants" else None
                for island, (_, handle) in list(self._islands.items()):
                    if to is None or island in to:
                        self._send_down(island, handle, update, result.tensors)
            await self._core(self.core.observe_publish, time.perf_counter() - t0, result.record.merge_s)

    # ------------------------------------------------------------ control plane

    async def status(self) -> dict:
        """Versions, live islands, round and refusal counts, token ledger, bytes, the checkpoint restored from."""
        def snapshot() -> dict:
            c = self.core
            return {
                "versions": list(c.versions), "islands": dict(c.islands), "rounds": len(c.rounds),
                "refusals": len(c.refusals), "ledger": c.ledger(), "bytes_up": c.bytes_received,
                "step_time_s": c.step_time.value, "sync_time_s": c.sync_time.value,
            }
        out = await self._core(snapshot)
        out["bytes_by_link"] = self._links.bytes_by_link()  # {region: {up, down}}, incl. refused and in flight
        out["bytes_down"] = sum(link["down"] for link in out["bytes_by_link"].values())  # every fragment sent
        out["transfers_by_link"] = self._links.transfers_by_link()
        out["in_transit"] = len(self._transfers)  # emulated transfers not yet delivered, both directions
        out["network_wait_s"] = dict(self._network_wait_s)
        out["network"] = self._network.describe()
        out["network_emulated"] = self._network.emulated
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
        self._last_ckpt = time.monotonic()
        tensors, meta = await self._core(self.core.state_dict)
        self._ckpt_step += 1
        step = self._ckpt_step
        meta = {"outer": meta, "epoch": self.epoch, "extra": dict(self.extra), "saved_at": time.time(),
                "links": self._links.counters(), "network_wait_s": dict(self._network_wait_s)}
        await asyncio.get_running_loop().run_in_executor(self._writer, self._store.save, step, tensors, meta)
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
        """For the health monitor: restart epoch, islands that sent non-finite values, registry."""
        diverged = await self._core(self.core.take_diverged)
        islands = await self._core(lambda: {str(k): v for k, v in self.core.islands.items()})
        return {"epoch": self.epoch, "diverged": sorted(diverged), "islands": islands}

    async def resume_cursor(self, island: int) -> int:
        """Where a new incarnation of the slot resumes its data: after the newest merged submission, or
        after everything taken from or salvaged of the incarnation that died (whichever is later)."""
        merged = await self._core(lambda: self.core.resume_cursor.get(island, 0))
        return max(merged, self._resume_floor.get(island, 0))

    async def salvage(self, island: int, incarnation: int, blob: list[Any]) -> dict:
        """Merge what is still valid of a dead incarnation's progress snapshot (policies/salvage.py).

        `blob`: [ref to the pickled ProgressSnapshot the pool's keeper held, or to None]. The accepted
        submissions take the island's uplink like any other (EMULATED delay included) and join the next
        round of their fragment without counting toward its quorum. Returns {"tokens": per fragment,
        "step", "skipped": {fragment: why}, "seqs": of the salvaged submissions}, or {"keeper_error": why}
        when the keeper could not be asked.
        """
        import pickle

        from policies.salvage import salvageable

        try:
            data = await blob[0]  # an ObjectRef is awaitable
        except (RayActorError, RayTaskError) as err:
            return {"keeper_error": str(err).strip().splitlines()[-1][:200]}
        P = self.core.plan.num_fragments
        taken = self._taken.pop((island, incarnation), {"seq": {}, "cursor": 0})
        floor = taken["cursor"]  # taken work is merged or refused: a new incarnation never reads it again
        tokens = [0] * P
        out: dict = {"tokens": tokens, "step": None, "skipped": {}, "seqs": []}
        if data is not None:
            snapshot = await self._core(pickle.loads, data)
            if (snapshot.island, snapshot.incarnation) != (island, incarnation):
                raise ValueError(f"the keeper handed over island {snapshot.island}/{snapshot.incarnation}'s snapshot "
                                 f"for {island}/{incarnation}")
            result = salvageable(snapshot, taken=taken["seq"], epoch=self.epoch)
            out["step"], out["skipped"] = snapshot.step, {str(p): why for p, why in result.skipped.items()}
            out["seqs"] = [sub.seq for sub in result.submissions]
            for sub in result.submissions:
                tokens[sub.fragment] += sub.tokens
                floor = max(floor, sub.cursor)
                await self._send_up(island, sub, None, sent_at=time.time())  # from the keeper, now
        self._resume_floor[island] = max(self._resume_floor.get(island, 0), floor)
        return out

    async def accounting(self) -> dict:
        """Useful time, version advance times, and per-incarnation received tokens (goodput, token fates)."""
        def take() -> dict:
            c = self.core
            return {"useful_s": c.useful_s, "advances": list(c.advances),
                    "received": [[i, inc, toks] for (i, inc), toks in c.received.items()]}
        return await self._core(take)

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
        while self._in_transit and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        results = await self._core(self.core.close_all, self._now())
        await self._publish(results)
        return len(results)

    async def stop(self) -> dict:
        """Stop polling; submissions already taken count as in flight. Returns the final ledger."""
        self._stopping = True
        self._wake_up()
        tasks = list(self._pollers.values()) + ([self._ticker] if self._ticker else [])
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        # Submissions still on an emulated uplink were taken: they count as in flight at stop.
        late, self._in_transit = list(self._in_transit.values()), {}
        for sub in late:
            await self._core(self.core.record_late, sub)
        for task in list(self._transfers):
            task.cancel()
        return await self._core(self.core.ledger)
