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

Three kinds, one interface (`island_for` in islands/island_kinds.py picks the class from the spec): this
class is an island of one worker; `GroupIsland` (islands/group_island.py) is the leader of a data-parallel
island of several workers, and `ShardedIsland` (islands/sharded_island.py) runs on every worker of an FSDP
island. The kinds override the step boundary and the loop's start and end; the inner step, with its
straggler and divergence checks, is this class's (`_train_step`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from islands.corpus import shown_path
from islands.cursor import DataCursor
from islands.distributed import WorkerGroup, describe_device, island_device
from islands.faults import InjectedFaults
from islands.fragment_state import FragmentState
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


class IslandFailed(RuntimeError):
    """The island's inner loop stopped with an error (diverged or crashed); carries the reason."""


def check_group(spec: IslandSpec, group: WorkerGroup | None) -> None:
    """Refuse a worker group that does not match the spec's workers (the island kinds of several workers)."""
    if (group.world_size if group is not None else 1) != spec.workers:
        raise ValueError(f"island {spec.island} has workers={spec.workers} but its worker group has "
                         f"{group.world_size if group else 1}; build a WorkerGroup of world_size=workers (rank 0)")
    if spec.shard == "fsdp" and group is None:
        raise ValueError(f"island {spec.island} shards its model (fsdp) but has no worker group; build a WorkerGroup")


def build_trainer(spec: IslandSpec, train: Any, *, cursor: DataCursor, group: WorkerGroup | None,
                   device: torch.device) -> InnerTrainer:
    """The island's inner trainer on its shard, its sampler at `cursor` (FSDP: its model is built later)."""
    trainer = InnerTrainer(
        spec.model, train, settings=spec.inner, shard_index=spec.island, num_shards=spec.num_islands,
        seed=spec.seed, group=group, device=device, shard=spec.shard == "fsdp", pool=spec.pool,
    )
    trainer.sampler.seek(cursor)
    if trainer.model is not None:
        check_plan(spec, trainer)
    return trainer


def check_plan(spec: IslandSpec, trainer: InnerTrainer) -> None:
    """The fragment plan must cover every state tensor of the model."""
    missing = set(trainer.params) - {n for frag in spec.plan.fragments for n in frag}
    if missing:
        raise ValueError(f"fragment plan does not cover state tensors {sorted(missing)[:3]}...; rebuild the plan from this model")


class LearnerIsland:
    """An island of one worker: its model replica, inner loop, per-fragment state and control interface.

    The island kinds of several workers subclass it (module docstring); what they change is in the hooks
    under "what an island kind changes"."""

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
        self._check_kind(group, shelve)
        self._group = group
        device = island_device(spec.accelerator)
        self._device_name = describe_device(device)
        check_sync_every(spec.sync_every_steps, spec.sync_every_schedule, spec.plan.num_fragments)
        cursor = DataCursor.of(cursor)
        self.trainer = build_trainer(spec, resolve(data[0]) if isinstance(data, list) else data, cursor=cursor,
                                     group=group, device=device)
        self.fragments = FragmentState.of(self._initial_theta())
        self._cv = threading.Condition()  # guards the fragments, the outbox, the inbox and the loop's state
        self.faults = InjectedFaults(spec.island)  # a hang stops the inner loop while the control interface answers
        assemble, split = self._fragment_transfer()
        self.outbox = Outbox(OutboxSettings.from_spec(spec), self.fragments, cv=self._cv, faults=self.faults,
                             readings=self._readings, assemble=assemble)
        self.inbox = Inbox(island=spec.island, adoption=parse_adoption(spec.adoption), fragments=self.fragments,
                           outbox=self.outbox, cv=self._cv, device=device, resolve=resolve,
                           hear_progress=self._hear_progress, split=split)
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
        for update in initial:
            self.inbox.queue(update)
        self._adopt_initial(initial)
        self.outbox.started_at_version = max(self.fragments.version)
        log.info("island %d (incarnation %d, pool %s) ready at versions %s, data at %s",
                 spec.island, spec.incarnation, spec.pool, self.fragments.version, cursor)

    # ---------------------------------------------------------------- what an island kind changes

    def _check_kind(self, group: WorkerGroup | None, shelve: Shelve | None) -> None:
        """Refuse a spec or a worker group this kind does not train."""
        spec = self.spec
        if spec.workers != 1 or spec.shard == "fsdp" or group is not None:
            raise ValueError(f"island {spec.island} has workers={spec.workers}, shard {spec.shard!r} and "
                             f"{'a' if group is not None else 'no'} worker group: a LearnerIsland is one worker; "
                             "build it with islands.island_kinds.island_for, which picks the island's kind")

    def _initial_theta(self) -> list[list[torch.Tensor]]:
        """Each fragment's parameter tensors, in the plan's order."""
        return [[self.trainer.params[n] for n in frag] for frag in self.spec.plan.fragments]

    def _fragment_transfer(self) -> tuple[Callable | None, Callable | None]:
        """(assemble, split): how a whole fragment is gathered for a cut and split on adoption; None: held whole."""
        return None, None

    def _adopt_initial(self, initial: list[FragmentUpdate]) -> None:
        """Adopt the initial global state, which must cover every fragment."""
        self.apply_updates()
        if min(self.fragments.version) < 0:
            raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")

    def _begin(self) -> None:
        """The loop thread, before the first step (a group joins its workers here)."""

    def _boundary(self, changed: set[int], train: bool) -> None:
        """At each step boundary, after adopting `changed` fragments, before stepping if `train`."""

    def _cut_if_due(self) -> None:
        """After an inner step, holding `_cv`: cut the next fragment if its turn has come."""
        if self._since_cut >= self.cut_every():  # >=: a schedule may shorten H past the steps already taken
            self._since_cut = 0
            self.outbox.cut()

    def _end(self) -> None:
        """The loop thread, after the last step of a clean stop (a group stops its workers here)."""

    def _stop_unthreaded(self) -> None:
        """`stop()` of an island driven by `step()` by hand (tests), with no loop thread to end it."""

    def _flush_at_stop(self) -> None:
        """`stop(flush=True)` once the loop has ended cleanly, holding `_cv`: cut what was not yet cut."""
        self.outbox.cut_remaining()

    # ---------------------------------------------------------------- inner loop

    def step(self) -> bool:
        """Apply pending updates, then one inner step unless blocked. Returns False when blocked."""
        changed = self.apply_updates()
        with self._cv:
            blocked, hung = self._gate()
        # Told on blocked and hung calls too: a group's followers hear from the leader at least every half second.
        self._boundary(changed, train=not blocked and not hung)
        if blocked:
            return False
        if hung:
            time.sleep(0.05)  # injected hang: no progress, control calls still answered
            return True
        self._train_step()
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

    def _train_step(self) -> None:
        """One inner step, stretched by an injected straggler, refused when its loss is not finite, then counted
        (and the next fragment cut, and the progress shelved, when due). Every island kind steps through here."""
        result = self.trainer.step()
        wall = result.wall_s
        with self._cv:
            slow = self.faults.slowdown(time.monotonic())
        if slow > 1.0:
            time.sleep(wall * (slow - 1.0))  # injected straggler (an FSDP leader's: its workers wait for it)
            wall *= slow
        if not math.isfinite(result.loss):  # an FSDP island's mean loss: every worker sees it
            raise IslandFailed(f"island {self.spec.island} diverged: non-finite training loss at step {self.total_steps}")
        self._loss.update(result.loss)
        self._step_time.update(wall)
        with self._cv:
            self.total_steps += 1
            self.total_tokens += result.tokens
            self.fragments.count_step(result.tokens, wall)
            self._since_cut += 1
            self._cut_if_due()
        if self.shelf is not None:
            self.shelf.after_step(self.total_steps)

    def cut_every(self) -> int:
        """Inner steps between two cuts (one fragment each, round-robin): H/P, H at the run's progress as last heard."""
        h = sync_every_at(self.trainer.progress, self.spec.sync_every_schedule, self.spec.sync_every_steps)
        return int(h) // self.spec.plan.num_fragments

    def _readings(self) -> LoopReadings:
        return LoopReadings(step_time_s=self._step_time.value or 0.0, train_loss=self._loss.value or math.nan,
                            cursor=self.trainer.sampler.data_cursor)

    def _hear_progress(self, progress: float) -> None:
        # The learning rate's progress never runs backwards (late or stale updates).
        self.trainer.progress = max(self.trainer.progress, progress)

    def run(self) -> None:
        """Train until `stop()`; record a failure instead of raising so the control interface can report it."""
        try:
            self._begin()
            self._loop()
            self._end()
        except Exception as err:  # noqa: BLE001 - reported through status() and next_submission()
            with self._cv:
                self._state = IslandState.DIVERGED if isinstance(err, IslandFailed) else IslandState.FAILED
                self._error = f"{type(err).__name__}: {err}"
                self._cv.notify_all()
            log.error("island %d inner loop stopped: %s", self.spec.island, self._error)
            return
        with self._cv:
            self._state = IslandState.STOPPED
            self._cv.notify_all()

    def _loop(self) -> None:
        """Step until stopped; while blocked, wait for an update (or the stop), at most half a second at a time."""
        while True:
            with self._cv:
                if self._stop:
                    break
            if not self.step():
                t0 = time.monotonic()
                with self._cv:
                    self._cv.wait_for(lambda: self._stop or self.inbox.has_updates(), timeout=0.5)
                    self._blocked_s += time.monotonic() - t0

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
        else:
            self._stop_unthreaded()
        if self.shelf is not None:
            self.shelf.close()  # no more snapshots: the outbox or the flush has the rest
        if flush:
            with self._cv:
                stopped = self._thread is None or not self._thread.is_alive()
                if stopped and self._error is None:
                    self._flush_at_stop()
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
        """A copy of the island's current parameters by name (for tests and checkpoints)."""
        return {n: p.detach().cpu().clone() for n, p in self.trainer.params.items()}
