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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from islands.distributed import WorkerGroup, describe_device, island_device
from islands.faults import InjectedFaults
from islands.fragment_state import FragmentState
from islands.inbox import Inbox
from islands.messages import FragmentUpdate, Submission
from islands.outbox import LoopReadings, Outbox, OutboxSettings
from islands.salvage_shelf import SalvageShelf, Shelve
from islands.spec import IslandSpec, IslandStatus  # noqa: F401 - re-exported: plain values live in islands.spec
from islands.trainer import InnerTrainer
from policies.adoption import parse_adoption
from policies.quorum import MovingAverage
from policies.sync_schedule import check_sync_every, sync_every_at

log = logging.getLogger(__name__)


class IslandFailed(RuntimeError):
    """The island's inner loop stopped with an error (diverged or crashed); carries the reason."""


def _check_spec(spec: IslandSpec, group: WorkerGroup | None) -> None:
    """Refuse a worker group that does not match the spec's workers, or one this island is not rank 0 of."""
    if (group.world_size if group is not None else 1) != spec.workers:
        raise ValueError(f"island {spec.island} has workers={spec.workers} but its worker group has "
                         f"{group.world_size if group else 1}; build a WorkerGroup of world_size=workers (rank 0)")
    if group is not None and group.rank != 0:
        raise ValueError(f"a LearnerIsland is rank 0 of its group, got rank {group.rank}; use IslandFollower")


def _build_trainer(spec: IslandSpec, train: Any, *, cursor: int, group: WorkerGroup | None,
                   device: torch.device) -> InnerTrainer:
    """The island's inner trainer on its shard, its sampler at `cursor`; the plan must cover the model."""
    trainer = InnerTrainer(
        spec.model, train, settings=spec.inner,
        shard_index=spec.island, num_shards=spec.num_islands, seed=spec.seed, group=group, device=device,
    )
    trainer.sampler.load_state_dict({**trainer.sampler.state_dict(), "cursor": cursor})
    missing = set(trainer.params) - {n for frag in spec.plan.fragments for n in frag}
    if missing:
        raise ValueError(f"fragment plan does not cover state tensors {sorted(missing)[:3]}...; rebuild the plan from this model")
    return trainer


class LearnerIsland:
    """One island's model replica, inner loop, per-fragment state and control interface."""

    def __init__(
        self,
        spec: IslandSpec,
        data: Any,
        initial: list[FragmentUpdate],
        *,
        cursor: int = 0,
        resolve: Callable[[Any], Any] = lambda x: x,
        group: WorkerGroup | None = None,
        shelve: Shelve | None = None,
    ) -> None:
        """`shelve(step, blob)`: leaves a pickled ProgressSnapshot with the pool's keeper every
        `spec.salvage_every_steps` steps and returns False if it skipped it (None: no snapshots)."""
        self.spec = spec
        _check_spec(spec, group)
        self._group = group
        device = island_device(spec.accelerator)
        self._device_name = describe_device(device)
        adoption = parse_adoption(spec.adoption)
        check_sync_every(spec.sync_every_steps, spec.sync_every_schedule, spec.plan.num_fragments)
        train = resolve(data[0]) if isinstance(data, list) else data
        self.trainer = _build_trainer(spec, train, cursor=cursor, group=group, device=device)
        self.fragments = FragmentState.of([[self.trainer.params[n] for n in frag] for frag in spec.plan.fragments])
        self._cv = threading.Condition()  # guards the fragments, the outbox, the inbox and the loop's state
        self.faults = InjectedFaults(spec.island)  # a hang stops the inner loop while the control interface answers
        self.outbox = Outbox(OutboxSettings.from_spec(spec), self.fragments, cv=self._cv, faults=self.faults,
                             readings=self._readings)
        self.inbox = Inbox(island=spec.island, adoption=adoption, fragments=self.fragments, outbox=self.outbox,
                           cv=self._cv, device=device, resolve=resolve, hear_progress=self._hear_progress)
        self.shelf = None if shelve is None else SalvageShelf(
            island=spec.island, incarnation=spec.incarnation, every_steps=spec.salvage_every_steps, shelve=shelve,
            fragments=self.fragments, outbox=self.outbox, cv=self._cv)
        self._state = "starting"
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
        self.apply_updates()
        if min(self.fragments.version) < 0:
            raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")
        log.info("island %d (incarnation %d, pool %s) ready at versions %s, cursor %d",
                 spec.island, spec.incarnation, spec.pool, self.fragments.version, cursor)

    # ---------------------------------------------------------------- inner loop

    def step(self) -> bool:
        """Apply pending updates, then one inner step unless blocked. Returns False when blocked."""
        changed = self.apply_updates()
        with self._cv:
            blocked = self.spec.wait_for_round and self.outbox.busy()
            if blocked:
                self._state = "blocked"
            elif self._state in ("starting", "blocked"):
                self._state = "training"
            hung = not blocked and self.faults.hung(time.monotonic())
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

    def _count_step(self, loss: float, tokens: int, wall_s: float) -> None:
        """Count a finished inner step, and cut the next fragment if its turn has come."""
        self._loss.update(loss)
        self._step_time.update(wall_s)
        with self._cv:
            self.total_steps += 1
            self.total_tokens += tokens
            self.fragments.count_step(tokens, wall_s)
            self._since_cut += 1
            if self._since_cut >= self.cut_every():  # >=: a schedule may shorten H past the steps already taken
                self._since_cut = 0
                self.outbox.cut()

    def cut_every(self) -> int:
        """Inner steps between two cuts (one fragment each, round-robin): H/P, H at the run's progress as last heard."""
        h = sync_every_at(self.trainer.progress, self.spec.sync_every_schedule, self.spec.sync_every_steps)
        return int(h) // self.spec.plan.num_fragments

    def _readings(self) -> LoopReadings:
        return LoopReadings(step_time_s=self._step_time.value or 0.0, train_loss=self._loss.value or math.nan,
                            cursor=self.trainer.sampler.cursor)

    def _hear_progress(self, progress: float) -> None:
        # The learning rate's progress never runs backwards (late or stale updates).
        self.trainer.progress = max(self.trainer.progress, progress)

    def run(self) -> None:
        """Train until `stop()`; record a failure instead of raising so the control interface can report it."""
        try:
            if self._group is not None:
                self._group.connect()  # blocks until every follower joined (bounded by the group's timeout)
                # Followers start from our parameters.
                self._group.broadcast_([t for frag in self.fragments.theta for t in frag])
            while True:
                with self._cv:
                    if self._stop:
                        break
                if not self.step():
                    t0 = time.monotonic()
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or self.inbox.has_updates(), timeout=0.5)
                        self._blocked_s += time.monotonic() - t0
        except Exception as err:  # noqa: BLE001 - reported through status() and next_submission()
            with self._cv:
                self._state = "diverged" if isinstance(err, IslandFailed) else "failed"
                self._error = f"{type(err).__name__}: {err}"
                self._cv.notify_all()
            log.error("island %d inner loop stopped: %s", self.spec.island, self._error)
            return
        self._stop_followers()
        with self._cv:
            self._state = "stopped"
            self._cv.notify_all()

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
        if self.shelf is not None:
            self.shelf.close()  # no more snapshots: the outbox or the flush has the rest
        if flush:
            with self._cv:
                stopped = self._thread is None or not self._thread.is_alive()
                if stopped and self._error is None:
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
                state=self._state if not self._stop or self._state in ("failed", "diverged") else "stopped",
                steps=self.total_steps, tokens=self.total_tokens,
                train_loss=self._loss.value, step_time_s=self._step_time.value,
                versions=list(f.version), unsubmitted_tokens=list(f.tokens), outbox_tokens=self.outbox.waiting_tokens(),
                inflight=self.outbox.taken_inflight(), cursor=self.trainer.sampler.cursor,
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
        """Inject a fault into this island (chaos engineering). Kinds: hang, slow, drop_submission,
        corrupt_submission, kill_node. Killing the island itself is done from outside (ray.kill)."""
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
