"""LearnerIsland: one learner unit. Trains forever on its shard, never blocking on the network.

Per fragment p the island keeps `base[p]` (the global fragment it last adopted) and counters of the
steps and tokens since its previous submission of p. Every H/P inner steps it cuts the next fragment
in the fixed order p = k mod P as an outer gradient `base[p] - theta[p]` and leaves it in its outbox;
the outer optimizer *calls* `next_submission` to take it, so the outer owns the result. Published
fragments arrive through `adopt` on another thread and are applied at the next step boundary.

This is a plain class: Ray applies `ray.remote` to it in orchestrator/actors/remote.py and injects
`resolve` (ray.get) for list-wrapped refs; tests drive it in process with `step()`. It keeps the inner
loop and the control interface; its collaborators keep the rest: `FragmentState` (islands/fragment_state.py,
per-fragment parameters, bases and counters), `Outbox` (islands/outbox.py, cuts and the cuts in flight),
`Inbox` (islands/inbox.py, received updates and adoption), `SalvageShelf` (islands/salvage_shelf.py,
progress snapshots to the keeper) and `InjectedFaults` (islands/faults.py).

An island of several workers (`spec.workers` > 1, islands/distributed.py) is data-parallel: this
class is rank 0, the leader, and keeps the whole interface; at every step boundary it tells its
followers whether to step and sends them the fragments it just adopted, so all workers hold the
same parameters.

An FSDP island (`spec.shard == "fsdp"`, islands/fsdp.py) runs this class on every worker, each over
its 1/W of the model: rank 0 leads as above and decides (what to adopt, whether to step, when to
cut), ranks >= 1 follow it, so every worker's bookkeeping agrees, and whole fragments pass only
through rank 0, one at a time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from islands.corpus import shown_path
from islands.cursor import DataCursor
from islands.distributed import WorkerGroup, describe_device, island_device
from islands.faults import InjectedFaults
from islands.fragment_state import FragmentState
from islands.fsdp import Boundary, Layout, Order, ShardLink, local_part, without_tensors
from islands.inbox import Inbox
from islands.messages import FragmentUpdate, Submission
from islands.outbox import LoopReadings, Outbox, OutboxSettings
from islands.salvage_shelf import SalvageShelf, Shelve
from islands.spec import IslandSpec, IslandStatus  # noqa: F401 - re-exported: plain values live in islands.spec
from islands.stream import StreamSampler
from islands.trainer import InnerTrainer
from policies.adoption import parse_adoption
from policies.island_states import ENDED_BADLY, IslandState
from policies.quorum import MovingAverage
from policies.sync_schedule import check_sync_every, sync_every_at

log = logging.getLogger(__name__)


FLUSH_TAKE_TIMEOUT_S = 60.0
"""How long an FSDP leader's final flush waits for a cut to be taken before the next: the outer optimizer
keeps a call outstanding per island, so this only bounds a flush that nobody takes any more."""


class IslandFailed(RuntimeError):
    """The island's inner loop stopped with an error (diverged or crashed); carries the reason."""


def _check_spec(spec: IslandSpec, group: WorkerGroup | None) -> None:
    """Refuse a worker group that does not match the spec's workers, or one this island is not rank 0 of."""
    if (group.world_size if group is not None else 1) != spec.workers:
        raise ValueError(f"island {spec.island} has workers={spec.workers} but its worker group has "
                         f"{group.world_size if group else 1}; build a WorkerGroup of world_size=workers (rank 0)")
    if spec.shard == "fsdp" and group is None:
        raise ValueError(f"island {spec.island} shards its model (fsdp) but has no worker group; build a WorkerGroup")
    if group is not None and group.rank != 0 and spec.shard != "fsdp":
        raise ValueError(f"a LearnerIsland is rank 0 of its group, got rank {group.rank}; use IslandFollower")


def _build_trainer(spec: IslandSpec, train: Any, *, cursor: DataCursor, group: WorkerGroup | None,
                   device: torch.device) -> InnerTrainer:
    """The island's inner trainer on its shard, its sampler at `cursor` (FSDP: its model is built later)."""
    trainer = InnerTrainer(
        spec.model, train, settings=spec.inner, shard_index=spec.island, num_shards=spec.num_islands,
        seed=spec.seed, group=group, device=device, shard=spec.shard == "fsdp", pool=spec.pool,
    )
    trainer.sampler.seek(cursor)
    if trainer.model is not None:
        _check_plan(spec, trainer)
    return trainer


def _check_plan(spec: IslandSpec, trainer: InnerTrainer) -> None:
    """The fragment plan must cover every state tensor of the model."""
    missing = set(trainer.params) - {n for frag in spec.plan.fragments for n in frag}
    if missing:
        raise ValueError(f"fragment plan does not cover state tensors {sorted(missing)[:3]}...; rebuild the plan from this model")


class LearnerIsland:
    """One island's model replica, inner loop, per-fragment state and control interface."""

    def __init__(
        self,
        spec: IslandSpec,
        data: Any,
        initial: list[FragmentUpdate],
        *,
        cursor: DataCursor | int = 0,
        resolve: Callable[[Any], Any] = lambda x: x,
        group: WorkerGroup | None = None,
        shelve: Shelve | None = None,
    ) -> None:
        """`shelve(step, blob)`: leaves a pickled ProgressSnapshot with the pool's keeper every
        `spec.salvage_every_steps` steps and returns False if it skipped it (None: no snapshots)."""
        self.spec = spec
        _check_spec(spec, group)
        self._group = group
        # FSDP: every worker runs this class over its part of the model, joined by `_link` once it is built.
        self._sharded = spec.shard == "fsdp"
        self._link: ShardLink | None = None
        if self._sharded and shelve is not None:
            raise ValueError("an FSDP island leaves no progress snapshots (each would hold the whole model); "
                             "set health.salvage_every_steps: 0")
        device = island_device(spec.accelerator)
        self._device_name = describe_device(device)
        adoption = parse_adoption(spec.adoption)
        check_sync_every(spec.sync_every_steps, spec.sync_every_schedule, spec.plan.num_fragments)
        train = resolve(data[0]) if isinstance(data, list) else data
        cursor = DataCursor.of(cursor)
        self.trainer = _build_trainer(spec, train, cursor=cursor, group=group, device=device)
        # FSDP: the fragments get this worker's parts once the model is built (`build_shards`).
        self.fragments = FragmentState.of([[] if self._sharded else [self.trainer.params[n] for n in frag]
                                           for frag in spec.plan.fragments])
        self._cv = threading.Condition()  # guards the fragments, the outbox, the inbox and the loop's state
        self.faults = InjectedFaults(spec.island)  # a hang stops the inner loop while the control interface answers
        self.outbox = Outbox(OutboxSettings.from_spec(spec), self.fragments, cv=self._cv, faults=self.faults,
                             readings=self._readings, assemble=self._gather if self._sharded else None)
        self.inbox = Inbox(island=spec.island, adoption=adoption, fragments=self.fragments, outbox=self.outbox,
                           cv=self._cv, device=device, resolve=resolve, hear_progress=self._hear_progress,
                           split=self._scatter if self._sharded else None)
        self.shelf = None if shelve is None else SalvageShelf(
            island=spec.island, incarnation=spec.incarnation, every_steps=spec.salvage_every_steps, shelve=shelve,
            fragments=self.fragments, outbox=self.outbox, cv=self._cv)
        self._state = IslandState.STARTING
        self._error: str | None = None
        self._stop = False
        self._flush = False  # stop(flush=True): cut every fragment's remaining progress and hand it out
        self._flush_pending = False  # the final cuts are not in the outbox yet
        self._thread: threading.Thread | None = None
        self._loss = MovingAverage(0.1)
        self._step_time = MovingAverage(0.1)
        self._blocked_s = 0.0
        self._since_cut = 0
        self.total_steps = 0
        self.total_tokens = 0
        self._leads = group is None or group.rank == 0  # rank 0 keeps the interface; FSDP ranks >= 1 follow it
        self._cut_after: tuple[int, bool] | None = None  # FSDP: the cut the leader ordered after this step
        for update in initial:
            self.inbox.queue(update)
        if self._sharded:  # adopted at the first boundary, once every worker holds its part of the model
            if self._leads and {u.fragment for u in initial} != set(range(spec.plan.num_fragments)):
                raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")
        else:
            self.apply_updates()
            if min(self.fragments.version) < 0:
                raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")
        log.info("island %d (incarnation %d, pool %s) ready at versions %s, data at %s",
                 spec.island, spec.incarnation, spec.pool, self.fragments.version, cursor)

    # ---------------------------------------------------------------- inner loop

    def step(self) -> bool:
        """Apply pending updates, then one inner step unless blocked. Returns False when blocked.

        In an FSDP island every worker calls this in step with the others (the leader's messages pace them);
        a worker other than the leader returns False when the leader took no step, or said stop.
        """
        if self._sharded:
            return self._step_sharded()
        changed = self.apply_updates()
        with self._cv:
            blocked, hung = self._gate()
        if self._group is not None:
            # Followers adopt exactly what this step boundary adopted, and step only when we do. Sent on
            # blocked and hung calls too, so followers hear from us at least every half second.
            self._group.lead(self.fragments.theta, changed=changed, train=not blocked and not hung,
                             progress=self.trainer.progress)
        if blocked:
            return False
        if hung:
            time.sleep(0.05)  # injected hang: no progress, control calls still answered
            return True
        result = self.trainer.step()
        wall = result.wall_s
        with self._cv:
            slow = self.faults.slowdown(time.monotonic())
        if slow > 1.0:
            time.sleep(wall * (slow - 1.0))  # injected straggler
            wall *= slow
        if not math.isfinite(result.loss):
            raise IslandFailed(f"island {self.spec.island} diverged: non-finite training loss at step {self.total_steps}")
        self._count_step(result.loss, result.tokens, wall)
        if self.shelf is not None:
            self.shelf.after_step(self.total_steps)
        return True

    def _gate(self) -> tuple[bool, bool]:
        """(blocked, hung) at a step boundary, with the state set to match; call it holding `_cv`. Blocked: a
        mode that waits for each round has a submission in flight. Hung: an injected hang is on."""
        blocked = self.spec.wait_for_round and self.outbox.busy()
        if blocked:
            self._state = IslandState.BLOCKED
        elif self._state in (IslandState.STARTING, IslandState.BLOCKED):
            self._state = IslandState.TRAINING
        return blocked, not blocked and self.faults.hung(time.monotonic())

    def _step_sharded(self) -> bool:
        """`step` of an FSDP island's worker: adopt what the leader took, step if it says so, cut if it says so."""
        link = self._link
        if link is None:
            raise RuntimeError("an FSDP island builds its sharded model in run(), once its workers are connected; "
                               "call build_shards() first when driving step() by hand")
        if self._leads:
            forced, updates = self.inbox.take()
            link.send(Boundary(forced=tuple(without_tensors(u) for u, _ in forced),
                               updates=tuple(without_tensors(u) for u, _ in updates)))
        else:
            boundary = link.receive()
            if boundary.cuts or boundary.stop:  # the stop: its final flush, one cut at a time, then the end
                with self._cv:
                    for p, drop in boundary.cuts:
                        self.outbox.cut(p, drop=drop)
                if boundary.stop:
                    self._finish_sharded()
                return False
            forced, updates = [(u, None) for u in boundary.forced], [(u, None) for u in boundary.updates]
        self.inbox.apply(forced, updates)
        if self._leads:
            with self._cv:
                blocked, hung = self._gate()
                train = not blocked and not hung
                # Decided before the step, so the workers know to take part in the cut: nothing between here and
                # the end of the step changes when the cut is due (progress is heard at boundaries only). While a
                # cut waits to be taken the next is postponed, so at most one whole fragment waits here
                # (docs/islands.md, FSDP islands); it is cut, with the steps since, after the first step once taken.
                cut = None
                if train and self._since_cut + 1 >= self.cut_every() and not self.outbox.has_ready():
                    cut = (self.outbox.next_fragment(), self.faults.take_drop())
            order = Order(train=train, cut=cut)
            link.send(order)
        else:
            order = link.receive()
            with self._cv:
                if self._state == IslandState.STARTING:
                    self._state = IslandState.TRAINING
        if not order.train:
            if self._leads and not blocked:
                time.sleep(0.05)  # injected hang: no progress, control calls still answered
                return True
            return False
        self._cut_after = order.cut
        result = self.trainer.step()
        wall = result.wall_s
        with self._cv:
            slow = self.faults.slowdown(time.monotonic())
        if slow > 1.0:
            time.sleep(wall * (slow - 1.0))  # injected straggler (the leader's: its workers wait for it)
            wall *= slow
        if not math.isfinite(result.loss):  # the island's mean loss: every worker sees it
            raise IslandFailed(f"island {self.spec.island} diverged: non-finite training loss at step {self.total_steps}")
        self._count_step(result.loss, result.tokens, wall)
        return True

    def _count_step(self, loss: float, tokens: int, wall_s: float) -> None:
        """Count a finished inner step, and cut the next fragment if its turn has come."""
        self._loss.update(loss)
        self._step_time.update(wall_s)
        with self._cv:
            self.total_steps += 1
            self.total_tokens += tokens
            self.fragments.count_step(tokens, wall_s)
            self._since_cut += 1
            if self._sharded:  # the leader ordered it before the step (`_step_sharded`)
                if self._cut_after is not None:
                    self._since_cut = 0
                    p, drop = self._cut_after
                    self.outbox.cut(p, drop=drop)
            elif self._since_cut >= self.cut_every():  # >=: a schedule may shorten H past the steps already taken
                self._since_cut = 0
                self.outbox.cut()

    def cut_every(self) -> int:
        """Inner steps between two cuts (one fragment each, round-robin): H/P, H at the run's progress as last heard."""
        h = sync_every_at(self.trainer.progress, self.spec.sync_every_schedule, self.spec.sync_every_steps)
        return int(h) // self.spec.plan.num_fragments

    def _gather(self, p: int, parts: list[torch.Tensor]) -> list[torch.Tensor] | None:
        assert self._link is not None
        return self._link.gather(p, parts)

    def _scatter(self, p: int, whole: list[torch.Tensor] | None) -> list[torch.Tensor]:
        assert self._link is not None
        return self._link.scatter(p, whole)

    def _readings(self) -> LoopReadings:
        return LoopReadings(step_time_s=self._step_time.value or 0.0, train_loss=self._loss.value or math.nan,
                            cursor=self.trainer.sampler.data_cursor)

    def _hear_progress(self, progress: float) -> None:
        # The learning rate's progress never runs backwards (late or stale updates).
        self.trainer.progress = max(self.trainer.progress, progress)

    def run(self) -> None:
        """Train until `stop()`; record a failure instead of raising so the control interface can report it."""
        try:
            if self._sharded:
                self.build_shards()  # joins the group first
                if not self._leads:
                    while self.step() or not self._stop:
                        pass  # the leader paces this loop, and says stop
            elif self._group is not None:
                self._group.connect()  # blocks until every follower joined (bounded by the group's timeout)
                # Followers start from our parameters and our place in the data.
                self._group.broadcast_([t for frag in self.fragments.theta for t in frag])
                self._group.share_cursor(self.trainer.sampler.data_cursor)
            while self._leads:
                with self._cv:
                    if self._stop:
                        break
                if not self.step():
                    t0 = time.monotonic()
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or self.inbox.has_updates(), timeout=0.5)
                        self._blocked_s += time.monotonic() - t0
            if self._sharded and self._leads:
                self.stop_shards()
        except Exception as err:  # noqa: BLE001 - reported through status() and next_submission()
            with self._cv:
                self._state = IslandState.DIVERGED if isinstance(err, IslandFailed) else IslandState.FAILED
                self._error = f"{type(err).__name__}: {err}"
                self._cv.notify_all()
            log.error("island %d inner loop stopped: %s", self.spec.island, self._error)
            return
        if not self._sharded:
            self._stop_followers()
        with self._cv:
            self._state = IslandState.STOPPED
            self._cv.notify_all()

    def build_shards(self) -> None:
        """FSDP: join the worker group, build and shard the model, and point the fragments at this worker's parts.

        `run` calls it; a test that drives `step()` by hand calls it on every worker first. Idempotent."""
        if self._link is not None:
            return
        assert self._group is not None
        self._group.connect()  # blocks until every worker joined (bounded by the group's timeout)
        # Every worker resumes where the leader does (a restarted worker process starts at the stream's start).
        self.trainer.sampler.seek(DataCursor(*self._group.share_cursor(self.trainer.sampler.data_cursor)))
        self.trainer.materialize()
        _check_plan(self.spec, self.trainer)
        params = self.trainer.params
        with self._cv:
            for frag, names in zip(self.fragments.theta, self.spec.plan.fragments):
                frag[:] = [local_part(params[n]) for n in names]
        self._link = ShardLink(self._group, [[Layout.of(params[n]) for n in names] for names in self.spec.plan.fragments])

    def stop_shards(self) -> None:
        """FSDP leader, at the stop: the final flush (when stopping with flush), then tell the workers to stop.

        Every worker takes part in each cut, so the flush is cut here, on the loop thread, one fragment at
        a time, each once the previous cut has been taken (the fragment rule, docs/islands.md); a cut not
        taken within FLUSH_TAKE_TIMEOUT_S (no outer optimizer left to take it) ends the flush there."""
        assert self._link is not None and self._leads
        for p in range(self.fragments.num_fragments):
            with self._cv:
                if not (self._flush and self.fragments.has_progress(p)):
                    continue
                if not self._cv.wait_for(lambda: not self.outbox.has_ready(), timeout=FLUSH_TAKE_TIMEOUT_S):
                    log.warning("island %d: a final-flush cut was not taken within %.0f s; fragments %d.. stay unflushed",
                                self.spec.island, FLUSH_TAKE_TIMEOUT_S, p)
                    break
                drop = self.faults.take_drop()
            self._link.send(Boundary(cuts=((p, drop),)))
            with self._cv:
                self.outbox.cut(p, drop=drop)
        self._link.send(Boundary(stop=True))
        self._finish_sharded()

    def _finish_sharded(self) -> None:
        """Every FSDP worker at the stop: leave the group."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        assert self._group is not None
        # Everyone has read the last message before anyone leaves: once, in about 30 runs of the test, a worker
        # whose peer had already torn its group down aborted at exit ("terminate called without an active exception").
        dist.barrier()
        self._group.close()

    def _stop_followers(self) -> None:
        if self._group is None:
            return
        try:
            self._group.lead(self.fragments.theta, changed=(), train=False, stop=True)
            self._group.close()
        except Exception as err:  # noqa: BLE001 - stopping anyway; a dead follower is killed with the island
            log.warning("island %d: could not stop its followers cleanly: %s", self.spec.island, err)

    # ---------------------------------------------------------------- control interface

    def start(self) -> None:
        """Start the inner loop in a background thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name=f"island-{self.spec.island}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 30.0, flush: bool = False) -> IslandStatus:
        """Stop after the current step and return the final status.

        Without `flush` the outbox is frozen from here on. With it (the end of a run) every fragment's
        progress since its last submission is cut into one more submission, and `next_submission` keeps
        handing out the outbox until it is empty, so the outer optimizer can merge the island's last work.
        """
        with self._cv:
            self._stop = True
            self._flush = self._flush_pending = flush
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif self._link is not None and self._leads:
            self.stop_shards()  # FSDP driven by hand (tests): what the loop would have told the workers
        if self.shelf is not None:
            self.shelf.close()  # no more snapshots: the outbox or the flush has the rest
        if flush:
            with self._cv:
                stopped = self._thread is None or not self._thread.is_alive()
                if stopped and self._error is None and not self._sharded:  # FSDP: cut by the loop (`stop_shards`)
                    self.outbox.cut_remaining()
                self._flush_pending = False
                self._cv.notify_all()
        return self.status()

    def next_submission(self, timeout_s: float = 1.0) -> Submission | None:
        """Hand the oldest submission to the caller (the outer optimizer), waiting up to `timeout_s`.

        Returns None on timeout, or once stopped and the outbox is empty (frozen, unless stopped with
        flush); raises IslandFailed if the inner loop died.
        """
        with self._cv:
            self._cv.wait_for(lambda: self.outbox.has_ready() or self._error or (self._stop and not self._flush_pending),
                              timeout=timeout_s)
            if self._error:
                raise IslandFailed(self._error)
            if not self.outbox.has_ready() or (self._stop and not self._flush):
                return None
            self._cv.notify_all()  # an FSDP leader's next cut may wait for this one to be taken
            return self.outbox.take()

    def adopt(self, update: FragmentUpdate) -> None:
        """Receive a published fragment; fetched now (off the compute path), applied at the next step boundary."""
        self.inbox.queue(update)

    def apply_updates(self) -> set[int]:
        """The step boundary: apply every received update in (fragment, version) order. Loop thread only.

        Returns the fragments whose parameters changed (what a multi-worker island's followers must copy).
        """
        return self.inbox.apply_updates()

    def resync(self, latest: list[FragmentUpdate]) -> None:
        """Force-adopt the outer optimizer's state after it restored an older checkpoint.

        Versions may go backwards, so this bypasses the version check: local progress, the outbox and
        every in-flight submission are discarded (their tokens are counted as discarded, i.e. lost).
        """
        self.inbox.resync(latest)

    def status(self) -> IslandStatus:
        """Counters and state for heartbeats, progress and token accounting."""
        f, shelf = self.fragments, self.shelf
        with self._cv:
            return IslandStatus(
                island=self.spec.island, incarnation=self.spec.incarnation, pool=self.spec.pool,
                state=self._state if not self._stop or self._state in ENDED_BADLY else IslandState.STOPPED,
                steps=self.total_steps, tokens=self.total_tokens,
                train_loss=self._loss.value, step_time_s=self._step_time.value,
                versions=list(f.version), unsubmitted_tokens=list(f.tokens), outbox_tokens=self.outbox.waiting_tokens(),
                inflight=self.outbox.taken_inflight(), cursor=self.trainer.sampler.data_cursor,
                skipped_units=dict(getattr(self.trainer.sampler, "skipped", {})),
                data_root=shown_path(self.trainer.sampler.root) if isinstance(self.trainer.sampler, StreamSampler) else None,
                data_read_bytes=getattr(self.trainer.sampler, "bytes_read", 0),
                submitted_tokens=list(f.submitted), discarded_tokens=list(f.discarded),
                overwritten_tokens=list(f.overwritten), blocked_s=self._blocked_s, faults=self.faults.count,
                error=self._error, shelve_s=shelf.shelve_s if shelf else 0.0,
                shelved_bytes=shelf.shelved_bytes if shelf else 0, epochs=list(f.epoch),
                lr=self.trainer.lr_at(self.trainer.steps), device=self._device_name,
            )

    def watch(self, timeout_s: float = 5.0) -> str:
        """Wait up to `timeout_s` for the inner loop to end; returns the state. A liveness probe that
        a caller keeps outstanding: it fails at once with the actor when the process dies."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._state

    def inject(self, kind: str, *, duration_s: float = 0.0, factor: float = 1.0) -> None:
        """Inject a fault into this island (chaos engineering): an island kind of policies/fault_kinds.py (hang, slow,
        drop, corrupt, poison, kill_node). Killing the island itself is done from outside (ray.kill)."""
        now = time.monotonic()
        with self._cv:
            self.faults.inject(kind, now=now, duration_s=duration_s, factor=factor)
        log.warning("island %d: injected fault %s", self.spec.island, kind)

    def wait_shelved(self) -> None:
        """Block until the latest snapshot has been handed over (tests; the inner loop never needs to)."""
        if self.shelf is not None:
            self.shelf.wait()

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the island's current parameters by name (for tests and checkpoints); in an FSDP island,
        this worker's part of each (rows of dim 0; buffers whole)."""
        if self._sharded:
            return {n: local_part(p).cpu().clone() for n, p in self.trainer.params.items()}
        return {n: p.detach().cpu().clone() for n, p in self.trainer.params.items()}
