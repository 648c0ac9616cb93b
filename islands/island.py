"""LearnerIsland: one learner unit. Trains forever on its shard, never blocking on the network.

Per fragment p the island keeps `base[p]` (the global fragment it last adopted) and counters of the
steps and tokens since its previous submission of p. Every H/P inner steps it cuts the next fragment
in the fixed order p = k mod P as an outer gradient `base[p] - theta[p]` and leaves it in its outbox;
the outer optimizer *calls* `next_submission` to take it, so the outer owns the result. Published
fragments arrive through `adopt` on another thread and are applied at the next step boundary.

This is a plain class: Ray applies `ray.remote` to it in orchestrator/actors/remote.py and injects
`resolve` (ray.get) for list-wrapped refs; tests drive it in process with `step()`.

An island of several workers (`spec.workers` > 1, islands/distributed.py) is data-parallel: this
class is rank 0, the leader, and keeps the whole interface; at every step boundary it tells its
followers whether to step and sends them the fragments it just adopted, so all workers hold the
same parameters.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from islands.distributed import WorkerGroup, describe_device, island_device
from islands.messages import FragmentUpdate, Submission, SubmissionKey
from islands.spec import IslandSpec, IslandStatus  # noqa: F401 - re-exported: plain values live in islands.spec
from islands.trainer import InnerTrainer
from policies.adoption import adopt_fragment, parse_adoption
from policies.compression import FEEDBACK_SCHEMES, compress
from policies.downlink import apply_delta, decode_fragment
from policies.error_feedback import ErrorFeedback
from policies.quorum import MovingAverage
from policies.salvage import ProgressSnapshot, salvage_due
from policies.sync_schedule import check_sync_every, sync_every_at

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A cut not yet merged or refused.

    `snapshot` is theta[p] just after the cut: while the cut is in flight the fragment's later progress is
    measured from it, since the cut already carries everything before it. A rebase adoption shifts it with
    theta; an overwrite or mix adoption replaces the parameters it was taken of, so it is dropped (None) and
    the new base is the reference again.
    """

    fragment: int
    snapshot: list[torch.Tensor] | None


class IslandFailed(RuntimeError):
    """The island's inner loop stopped with an error (diverged or crashed); carries the reason."""


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
        shelve: Callable[[int, bytes], bool | None] | None = None,
    ) -> None:
        """`shelve(step, blob)`: leaves a pickled ProgressSnapshot with the pool's keeper every
        `spec.salvage_every_steps` steps and returns False if it skipped it (None: no snapshots)."""
        self.spec = spec
        self._shelve = shelve
        self._shelve_s = 0.0  # inner-loop time spent on progress snapshots (salvage's cost on the compute path)
        self._shelved_bytes = 0
        self._snapshot_sender: concurrent.futures.ThreadPoolExecutor | None = None  # pickles and sends snapshots
        self._shelving: concurrent.futures.Future | None = None  # the snapshot being sent
        self._resolve = resolve
        if (group.world_size if group is not None else 1) != spec.workers:
            raise ValueError(f"island {spec.island} has workers={spec.workers} but its worker group has "
                             f"{group.world_size if group else 1}; build a WorkerGroup of world_size=workers (rank 0)")
        if group is not None and group.rank != 0:
            raise ValueError(f"a LearnerIsland is rank 0 of its group, got rank {group.rank}; use IslandFollower")
        self._group = group
        self._device = island_device(spec.accelerator)
        self._device_name = describe_device(self._device)
        self._adoption = parse_adoption(spec.adoption)
        P = spec.plan.num_fragments
        check_sync_every(spec.sync_every_steps, spec.sync_every_schedule, P)
        train = resolve(data[0]) if isinstance(data, list) else data
        self.trainer = InnerTrainer(
            spec.model_config, np.asarray(train), settings=spec.inner,
            shard_index=spec.island, num_shards=spec.num_islands, seed=spec.seed, group=group, device=self._device,
        )
        self.trainer.sampler.load_state_dict({**self.trainer.sampler.state_dict(), "cursor": cursor})
        missing = set(self.trainer.params) - {n for frag in spec.plan.fragments for n in frag}
        if missing:
            raise ValueError(f"fragment plan does not cover parameters {sorted(missing)[:3]}...; rebuild the plan from this model")
        # theta[p]: the live parameter tensors of fragment p, in fragment order.
        self._theta = [[self.trainer.params[n] for n in frag] for frag in spec.plan.fragments]
        self._base: list[list[torch.Tensor]] = [[] for _ in range(P)]
        self._version = [-1] * P
        self._epoch = [-1] * P  # epoch of the outer optimizer that sent each fragment's base (delta downlink)
        self._steps = [0] * P
        self._tokens = [0] * P
        self._compute = [0.0] * P  # wall seconds of steps since the previous cut of each fragment
        self._submitted = [0] * P
        self._discarded = [0] * P
        self._overwritten = [0] * P  # per fragment: progress an overwrite adoption replaced (never merged)
        # Top-k, int2 and sign drop much of each outer gradient: what a cut does not carry is owed to the next.
        self._feedback = ErrorFeedback(P, spec.feedback_decay) if spec.compression in FEEDBACK_SCHEMES else None
        self._blocked_s = 0.0
        # Injected faults (chaos): a hang stops the inner loop while the control interface still answers.
        self._hang_until = 0.0
        self._slow_until = 0.0
        self._slow_factor = 1.0
        self._drop_next = 0
        self._corrupt_next = 0
        self._faults = 0
        self._k = 0  # submissions cut so far
        self._since_cut = 0
        self._inflight: dict[SubmissionKey, _InFlight] = {}
        self._outbox: collections.deque[Submission] = collections.deque()
        self._updates: list[tuple[FragmentUpdate, list[torch.Tensor]]] = []
        self._resync_pending: list[tuple[FragmentUpdate, list[torch.Tensor]]] = []
        self._cv = threading.Condition()
        self._state = "starting"
        self._error: str | None = None
        self._stop = False
        self._flush = False  # stop(flush=True): cut every fragment's remaining progress and hand it out
        self._flush_pending = False  # the final cuts are not in the outbox yet
        self._thread: threading.Thread | None = None
        self._loss = MovingAverage(0.1)
        self._step_time = MovingAverage(0.1)
        self.total_steps = 0
        self.total_tokens = 0
        for update in initial:
            self._queue_update(update)
        self.apply_updates()
        if min(self._version) < 0:
            raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")
        log.info("island %d (incarnation %d, pool %s) ready at versions %s, cursor %d",
                 spec.island, spec.incarnation, spec.pool, self._version, cursor)

    # ---------------------------------------------------------------- inner loop

    def step(self) -> bool:
        """Apply pending updates, then one inner step unless blocked. Returns False when blocked."""
        changed = self.apply_updates()
        with self._cv:
            blocked = self.spec.wait_for_round and self._inflight_or_outbox()
            if blocked:
                self._state = "blocked"
            elif self._state in ("starting", "blocked"):
                self._state = "training"
        hung = not blocked and time.monotonic() < self._hang_until
        if self._group is not None:
            # Followers adopt exactly what this step boundary adopted, and step only when we do. Sent on
            # blocked and hung calls too, so followers hear from us at least every half second.
            self._group.lead(self._theta, changed=changed, train=not blocked and not hung, progress=self.trainer.progress)
        if blocked:
            return False
        if hung:
            time.sleep(0.05)  # injected hang: no progress, control calls still answered
            return True
        result = self.trainer.step()
        wall = result.wall_s
        if self._slow_factor > 1.0 and time.monotonic() < self._slow_until:
            time.sleep(wall * (self._slow_factor - 1.0))  # injected straggler
            wall *= self._slow_factor
        if not math.isfinite(result.loss):
            raise IslandFailed(f"island {self.spec.island} diverged: non-finite training loss at step {self.total_steps}")
        self._loss.update(result.loss)
        self._step_time.update(wall)
        with self._cv:
            self.total_steps += 1
            self.total_tokens += result.tokens
            for p in range(len(self._steps)):
                self._steps[p] += 1
                self._tokens[p] += result.tokens
                self._compute[p] += wall
            self._since_cut += 1
            if self._since_cut >= self.cut_every():  # >=: a schedule may shorten H past the steps already taken
                self._since_cut = 0
                self._cut_submission()
        if self._shelve is not None and salvage_due(self.total_steps, self.spec.salvage_every_steps):
            self._shelve_progress()
        return True

    def cut_every(self) -> int:
        """Inner steps between two cuts (one fragment each, round-robin): H/P, H at the run's progress as last heard."""
        h = sync_every_at(self.trainer.progress, self.spec.sync_every_schedule, self.spec.sync_every_steps)
        return int(h) // self.spec.plan.num_fragments

    def _inflight_or_outbox(self) -> bool:
        return bool(self._inflight) or bool(self._outbox)

    def _progress(self, p: int, seq: int) -> Submission:
        """Fragment p's progress since its last cut as a submission numbered `seq` (no counter changes).

        The payload is raw float32 differences (plus what error feedback still owes, under top-k) for the
        caller to encode (`_encode`); a progress snapshot encodes on its sender thread, off the inner loop:
        it covers every fragment, and quantizing it on the loop thread took about 1% of a run's step time at
        the default salvage interval."""
        with torch.no_grad():
            deltas = [(a - t.detach()).cpu() for a, t in zip(self._anchor(p), self._theta[p])]  # .cpu(): no-op on CPU
            payload = deltas if self._feedback is None else self._feedback.owed(p, deltas)
        return Submission(
            island=self.spec.island, incarnation=self.spec.incarnation, seq=seq, fragment=p,
            base_version=self._version[p], tokens=self._tokens[p], inner_steps=self._steps[p],
            step_time_s=self._step_time.value or 0.0, train_loss=self._loss.value or math.nan,
            payload=payload, created_at=time.time(), compute_s=self._compute[p], cursor=self.trainer.sampler.cursor,
        )

    def _encode(self, deltas: list[torch.Tensor]) -> list:
        """The wire form of a fragment's differences (the run's outer-gradient compression)."""
        return [compress(d, self.spec.compression, block_size=self.spec.compression_block_size, density=self.spec.topk_density)
                for d in deltas]

    def _anchor(self, p: int) -> list[torch.Tensor]:
        """What fragment p's unsubmitted progress is measured from (caller holds self._cv).

        The parameters at its newest cut still in flight, if they are still the reference (see `_InFlight`),
        else the base it last adopted. Measured from the base, a cut, snapshot or final flush made while an
        earlier cut is in flight would carry that cut's progress a second time.
        """
        flights = [(k.seq, f.snapshot) for k, f in self._inflight.items() if f.fragment == p and f.snapshot is not None]
        return max(flights, key=lambda sf: sf[0])[1] if flights else self._base[p]

    def _shelve_progress(self) -> None:
        """Leave every fragment's unsubmitted progress with the pool's keeper (policies/salvage.py says why).

        Loop thread only, at a step boundary: the differences are taken here (they must be of this step's
        parameters); encoding, pickling and handing them over run on a sender thread, off the compute path. If the
        previous snapshot is still on its way, this waits for it first (it takes milliseconds against n steps)."""
        t0 = time.perf_counter()
        if self._shelving is not None:
            self._shelving.result()
        with self._cv:
            subs: list[Submission] = []
            for p in range(self.spec.plan.num_fragments):
                if self._steps[p] > 0 and self._base[p]:
                    subs.append(self._progress(p, self._k + len(subs)))  # encoded by the sender
            snapshot = ProgressSnapshot(island=self.spec.island, incarnation=self.spec.incarnation, next_seq=self._k,
                                        epochs=list(self._epoch), step=self.total_steps, submissions=subs)
        if subs:
            if self._snapshot_sender is None:
                self._snapshot_sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"island-{self.spec.island}-shelve")
            self._shelving = self._snapshot_sender.submit(self._send_snapshot, snapshot)
        self._shelve_s += time.perf_counter() - t0

    def _send_snapshot(self, snapshot: ProgressSnapshot) -> None:
        for sub in snapshot.submissions:  # the raw differences were taken at the step boundary; encode them here
            sub.payload = self._encode(sub.payload)
        blob = pickle.dumps(snapshot, protocol=5)  # bytes: the keeper holds them without importing torch
        try:
            assert self._shelve is not None
            sent = self._shelve(snapshot.step, blob) is not False
        except Exception as err:  # noqa: BLE001 - salvage is best effort; the next snapshot tries again
            log.warning("island %d: could not leave progress with the keeper: %s", self.spec.island, err)
            sent = False
        with self._cv:
            self._shelved_bytes += len(blob) if sent else 0

    def wait_shelved(self) -> None:
        """Block until the latest snapshot has been handed over (tests; the inner loop never needs to)."""
        if self._shelving is not None:
            self._shelving.result()

    def _cut_submission(self, fragment: int | None = None) -> None:
        # Caller holds self._cv. Fragments go round-robin (fragment = seq mod P) until the final flush names one.
        p = self._k % self.spec.plan.num_fragments if fragment is None else fragment
        seq = self._k
        self._k += 1
        sub = self._progress(p, seq)
        owed = sub.payload
        sub.payload = self._encode(owed)
        if self._feedback is not None:  # what this cut does not carry is owed to the next one
            self._feedback.settle(p, owed, decode_fragment(sub.payload))
        self._submitted[p] += sub.tokens
        self._steps[p] = 0
        self._tokens[p] = 0
        self._compute[p] = 0.0
        if self._drop_next:  # injected fault: the submission is lost on the way (its tokens are lost)
            self._drop_next -= 1
            log.warning("island %d: dropping submission %d (injected fault)", self.spec.island, seq)
            return
        if self._corrupt_next:  # injected fault: NaN on the wire; the outer optimizer must refuse it
            self._corrupt_next -= 1
            sub.payload = [_corrupt(c) for c in sub.payload]
            log.warning("island %d: corrupting submission %d (injected fault)", self.spec.island, seq)
        self._inflight[sub.key] = _InFlight(p, [t.detach().clone() for t in self._theta[p]])
        self._outbox.append(sub)
        self._cv.notify_all()

    def run(self) -> None:
        """Train until `stop()`; record a failure instead of raising so the control interface can report it."""
        try:
            if self._group is not None:
                self._group.connect()  # blocks until every follower joined (bounded by the group's timeout)
                self._group.broadcast_([t for frag in self._theta for t in frag])  # followers start from our parameters
            while True:
                with self._cv:
                    if self._stop:
                        break
                if not self.step():
                    t0 = time.monotonic()
                    with self._cv:
                        self._cv.wait_for(lambda: self._stop or bool(self._updates), timeout=0.5)
                        self._blocked_s += time.monotonic() - t0
        except Exception as err:  # noqa: BLE001 - reported through status() and next_submission()
            with self._cv:
                self._state = "diverged" if isinstance(err, IslandFailed) else "failed"
                self._error = f"{type(err).__name__}: {err}"
                self._cv.notify_all()
            log.error("island %d inner loop stopped: %s", self.spec.island, self._error)
            return
        if self._group is not None:
            try:
                self._group.lead(self._theta, changed=(), train=False, stop=True)
                self._group.close()
            except Exception as err:  # noqa: BLE001 - stopping anyway; a dead follower is killed with the island
                log.warning("island %d: could not stop its followers cleanly: %s", self.spec.island, err)
        with self._cv:
            self._state = "stopped"
            self._cv.notify_all()

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
        if self._snapshot_sender is not None:
            self._snapshot_sender.shutdown(wait=False)  # no more snapshots: the outbox or the flush has the rest
        if flush:
            with self._cv:
                stopped = self._thread is None or not self._thread.is_alive()
                if stopped and self._error is None:
                    for p in range(self.spec.plan.num_fragments):
                        if self._steps[p] > 0 and self._base[p]:
                            self._cut_submission(p)
                self._flush_pending = False
                self._cv.notify_all()
        return self.status()

    def next_submission(self, timeout_s: float = 1.0) -> Submission | None:
        """Hand the oldest submission to the caller (the outer optimizer), waiting up to `timeout_s`.

        Returns None on timeout, or once stopped and the outbox is empty (frozen, unless stopped with
        flush); raises IslandFailed if the inner loop died.
        """
        with self._cv:
            self._cv.wait_for(lambda: self._outbox or self._error or (self._stop and not self._flush_pending),
                              timeout=timeout_s)
            if self._error:
                raise IslandFailed(self._error)
            if not self._outbox or (self._stop and not self._flush):
                return None
            return self._outbox.popleft()

    def adopt(self, update: FragmentUpdate) -> None:
        """Receive a published fragment; fetched now (off the compute path), applied at the next step boundary."""
        self._queue_update(update)

    def status(self) -> IslandStatus:
        """Counters and state for heartbeats, progress and token accounting."""
        P = self.spec.plan.num_fragments
        with self._cv:
            outbox = [0] * P
            for sub in self._outbox:
                outbox[sub.fragment] += sub.tokens
            taken = sum(1 for k in self._inflight if all(s.key != k for s in self._outbox))
            return IslandStatus(
                island=self.spec.island, incarnation=self.spec.incarnation, pool=self.spec.pool,
                state=self._state if not self._stop or self._state in ("failed", "diverged") else "stopped",
                steps=self.total_steps, tokens=self.total_tokens,
                train_loss=self._loss.value, step_time_s=self._step_time.value,
                versions=list(self._version), unsubmitted_tokens=list(self._tokens), outbox_tokens=outbox,
                inflight=taken, cursor=self.trainer.sampler.cursor, submitted_tokens=list(self._submitted),
                discarded_tokens=list(self._discarded), overwritten_tokens=list(self._overwritten), blocked_s=self._blocked_s, faults=self._faults,
                error=self._error, shelve_s=self._shelve_s, shelved_bytes=self._shelved_bytes, epochs=list(self._epoch),
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
            self._faults += 1
            if kind == "hang":
                self._hang_until = now + duration_s if duration_s > 0 else math.inf
            elif kind == "slow":
                if factor <= 1.0:
                    raise ValueError(f"slow fault needs factor > 1, got {factor}")
                self._slow_factor, self._slow_until = factor, now + (duration_s if duration_s > 0 else math.inf)
            elif kind == "drop_submission":
                self._drop_next += 1
            elif kind == "corrupt_submission":
                self._corrupt_next += 1
            elif kind == "kill_node":
                log.warning("island %d: killing its node's raylet (injected fault)", self.spec.island)
                os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent process is its node's raylet
            else:
                raise ValueError(f"unknown fault kind {kind!r} for an island; use hang, slow, drop_submission, "
                                 "corrupt_submission or kill_node")
        log.warning("island %d: injected fault %s", self.spec.island, kind)

    def resync(self, latest: list[FragmentUpdate]) -> None:
        """Force-adopt the outer optimizer's state after it restored an older checkpoint.

        Versions may go backwards, so this bypasses the version check: local progress, the outbox and
        every in-flight submission are discarded (their tokens are counted as discarded, i.e. lost).
        """
        for u in latest:
            if u.delta_from is not None:
                raise ValueError(f"resync needs whole fragments, got a difference for fragment {u.fragment}; "
                                 "pass the outer optimizer's latest()")
        fetched = [(u, self._to_device(self._resolve(u.tensors[0]))) for u in latest]
        with self._cv:
            # Outbox tokens were counted as submitted; dropping them makes them "taken, never received".
            self._outbox.clear()
            self._inflight.clear()
            self._updates.clear()
            for p in range(len(self._tokens)):
                self._discarded[p] += self._tokens[p]
                self._tokens[p], self._steps[p], self._compute[p] = 0, 0, 0.0
            self._resync_pending = fetched
            self._cv.notify_all()

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the island's current parameters by name (for tests and checkpoints)."""
        return {n: p.detach().cpu().clone() for n, p in self.trainer.params.items()}

    # ---------------------------------------------------------------- adoption

    def _to_device(self, tensors: Any) -> list[torch.Tensor]:
        # A compressed downlink (outer.downlink) is decoded here, off the compute path, to float32.
        tensors = decode_fragment(tensors)
        # On CPU the fetched (read-only, shared) tensors are used as they are; on a GPU, copied over once.
        if self._device.type == "cpu":
            return list(tensors)
        return [t.to(self._device) for t in tensors]

    def _queue_update(self, update: FragmentUpdate) -> None:
        tensors = self._to_device(self._resolve(update.tensors[0]))
        with self._cv:
            self._updates.append((update, tensors))
            self._cv.notify_all()

    def apply_updates(self) -> set[int]:
        """The step boundary: apply every received update in (fragment, version) order. Loop thread only.

        Returns the fragments whose parameters changed (what a multi-worker island's followers must copy).
        """
        with self._cv:
            updates, self._updates = self._updates, []
            forced, self._resync_pending = self._resync_pending, []
        changed: set[int] = set()
        for update, _ in forced + updates:  # the learning rate's progress never runs backwards (late or stale updates)
            if update.progress is not None:
                self.trainer.progress = max(self.trainer.progress, update.progress)
        for update, tensors in forced:
            with torch.no_grad():
                for t, g in zip(self._theta[update.fragment], tensors):
                    t.copy_(g)
            self._base[update.fragment] = [g.detach().to(torch.float32).clone() for g in tensors]
            self._version[update.fragment] = update.version
            self._epoch[update.fragment] = update.epoch
            changed.add(update.fragment)
        # In version order per fragment, so a chain of differences applies link by link.
        for update, tensors in sorted(updates, key=lambda u: (u[0].fragment, u[0].version)):
            if update.delta_from is not None:
                tensors = self._undelta(update, tensors)
            if self._apply_one(update, tensors):
                changed.add(update.fragment)
        return changed

    def _undelta(self, update: FragmentUpdate, delta: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The global fragment a downlink difference stands for, or None if it is not for our copy."""
        p = update.fragment
        if update.epoch != self._epoch[p] or update.version <= self._version[p]:
            return None  # from an outer optimizer that has since restarted, or nothing new: bookkeeping only
        if update.delta_from == self._version[p]:
            return apply_delta(self._base[p], delta)
        # The sender encodes each difference from what it last sent us and awaits our adoption before the
        # next, so a gap is a bug, not a race; failing makes the monitor rebuild us from whole fragments.
        raise RuntimeError(f"island {self.spec.island}: a downlink difference for fragment {p} is from version "
                           f"{update.delta_from}, but this island holds version {self._version[p]}")

    def _apply_one(self, update: FragmentUpdate, global_: list[torch.Tensor] | None) -> bool:
        p = update.fragment
        mine = [k for k in update.merged if k in self._inflight]
        with self._cv:
            for key in update.refused:
                self._inflight.pop(key, None)
        # A version from an outer optimizer that has since restarted (a lower epoch) may come from a
        # lineage the restart rolled back: never adopt it over what the new one sent.
        if global_ is None or update.version <= self._version[p] or update.epoch < self._epoch[p]:
            with self._cv:  # an older update that arrived late: bookkeeping only
                for key in mine:
                    self._inflight.pop(key, None)
            return False
        # The parameters that not-yet-merged local progress is measured from: just after this
        # island's newest merged submission if it took part, else the fragment's base.
        anchor = self._base[p]
        if mine and self._adoption.kind == "rebase":  # rebase never drops a cut's snapshot
            anchor = self._inflight[max(mine, key=lambda k: k.seq)].snapshot
        with torch.no_grad():
            if not self._base[p]:  # first adoption: nothing local to keep
                new = [g.detach().to(t.dtype).clone() for g, t in zip(global_, self._theta[p])]
            else:
                new = adopt_fragment(self._adoption, local=[t.detach() for t in self._theta[p]], anchor=anchor, global_=global_)
            shift = [n - t.detach() for n, t in zip(new, self._theta[p])]
            for t, n in zip(self._theta[p], new):
                t.copy_(n)  # in place: the optimizer holds these tensors; never modify `global_`
        with self._cv:
            if self._adoption.kind == "overwrite" and self._steps[p]:
                # The fragment's progress since its last cut was just replaced: it never reaches the global
                # parameters, so its tokens and compute are not the next cut's (DESIGN.md section 6, useful).
                self._overwritten[p] += self._tokens[p]
                self._tokens[p], self._steps[p], self._compute[p] = 0, 0, 0.0
            for key in mine:
                self._inflight.pop(key, None)
            for flight in self._inflight.values():
                if flight.fragment != p or flight.snapshot is None:
                    continue
                if self._adoption.kind == "rebase":  # keep "theta - snapshot" invariant for later rounds
                    for s, d in zip(flight.snapshot, shift):
                        s.add_(d)
                else:  # the progress it was the reference for was replaced: measure from the new base
                    flight.snapshot = None
            self._base[p] = [g.detach().to(torch.float32).clone() for g in global_]
            self._version[p] = update.version
            self._epoch[p] = update.epoch
            self._cv.notify_all()
        return True


def _corrupt(c):
    """A copy of a compressed tensor whose decoded values are all NaN (injected corruption)."""
    if c.scales is not None:
        return dataclasses.replace(c, scales=torch.full_like(c.scales, math.nan))
    return dataclasses.replace(c, payload=torch.full_like(c.payload, math.nan))
