"""ShardedIsland: every worker of an FSDP island (`spec.shard == "fsdp"`, islands/fsdp.py).

Each worker runs one over its 1/W of the model: rank 0 leads (what to adopt, whether to step, when to
cut) and keeps the island's interface, ranks >= 1 follow it, so every worker's bookkeeping agrees, and
whole fragments pass only through rank 0, one at a time (docs/islands.md, FSDP islands).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from islands.cursor import DataCursor
from islands.distributed import WorkerGroup
from islands.fsdp import Boundary, Layout, Order, ShardLink, local_part, without_tensors
from islands.island import LearnerIsland, check_group, check_plan
from islands.messages import FragmentUpdate
from islands.salvage_shelf import Shelve
from policies.island_states import IslandState

log = logging.getLogger(__name__)

FLUSH_TAKE_TIMEOUT_S = 60.0
"""How long an FSDP leader's final flush waits for a cut to be taken before the next: the outer optimizer
keeps a call outstanding per island, so this only bounds a flush that nobody takes any more."""


class ShardedIsland(LearnerIsland):
    """One worker of an FSDP island; rank 0 leads the others through `ShardLink` messages at each boundary."""

    _group: WorkerGroup
    _link: ShardLink | None = None  # joined by `build_shards`, once the workers are connected
    _cut_after: tuple[int, bool] | None = None  # the cut the leader ordered after this step

    @property
    def _leads(self) -> bool:
        """Rank 0 keeps the interface and decides; ranks >= 1 follow it."""
        return self._group.rank == 0

    # ---------------------------------------------------------------- what this kind changes

    def _check_kind(self, group: WorkerGroup | None, shelve: Shelve | None) -> None:
        check_group(self.spec, group)
        if self.spec.shard != "fsdp":
            raise ValueError(f"island {self.spec.island} does not shard its model (shard {self.spec.shard!r}): "
                             "islands.island_kinds.island_for picks its kind")
        if shelve is not None:
            raise ValueError("an FSDP island leaves no progress snapshots (each would hold the whole model); "
                             "set health.salvage_every_steps: 0")

    def _initial_theta(self) -> list[list[torch.Tensor]]:
        return [[] for _ in self.spec.plan.fragments]  # this worker's parts, once the model is built (`build_shards`)

    def _fragment_transfer(self) -> tuple[Callable | None, Callable | None]:
        return self._gather, self._scatter

    def _adopt_initial(self, initial: list[FragmentUpdate]) -> None:
        # Adopted at the first boundary, once every worker holds its part of the model.
        if self._leads and {u.fragment for u in initial} != set(range(self.spec.plan.num_fragments)):
            raise ValueError("initial global state must cover every fragment; pass the outer optimizer's latest()")

    def _begin(self) -> None:
        self.build_shards()  # joins the group first

    def _loop(self) -> None:
        if self._leads:
            super()._loop()
        else:
            while self.step() or not self._stop:
                pass  # the leader paces this loop, and says stop

    def _cut_if_due(self) -> None:
        if self._cut_after is not None:  # the leader ordered it before the step (`step`)
            self._since_cut = 0
            p, drop = self._cut_after
            self.outbox.cut(p, drop=drop)

    def _end(self) -> None:
        if self._leads:
            self.stop_shards()

    def _stop_unthreaded(self) -> None:
        if self._link is not None and self._leads:
            self.stop_shards()  # what the loop would have told the workers

    def _flush_at_stop(self) -> None:
        pass  # cut by the loop, one fragment at a time (`stop_shards`)

    # ---------------------------------------------------------------- the step, led or followed

    def step(self) -> bool:
        """Adopt what the leader took, step if it says so, cut if it says so. Every worker calls this in step with
        the others (the leader's messages pace them); a follower returns False when the leader took no step, or
        said stop."""
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
        order, blocked = self._order(link)
        if not order.train:
            if self._leads and not blocked:
                time.sleep(0.05)  # injected hang: no progress, control calls still answered
                return True
            return False
        self._cut_after = order.cut
        self._train_step()
        return True

    def _order(self, link: ShardLink) -> tuple[Order, bool]:
        """The leader decides and sends whether to step and what to cut after it; a follower receives it.
        Returns the order and whether the island is blocked (the leader's knowledge; False on a follower)."""
        if not self._leads:
            order = link.receive()
            with self._cv:
                if self._state == IslandState.STARTING:
                    self._state = IslandState.TRAINING
            return order, False
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
        return order, blocked

    def _gather(self, p: int, parts: list[torch.Tensor]) -> list[torch.Tensor] | None:
        assert self._link is not None
        return self._link.gather(p, parts)

    def _scatter(self, p: int, whole: list[torch.Tensor] | None) -> list[torch.Tensor]:
        assert self._link is not None
        return self._link.scatter(p, whole)

    # ---------------------------------------------------------------- joining and leaving

    def build_shards(self) -> None:
        """Join the worker group, build and shard the model, and point the fragments at this worker's parts.

        `run` calls it; a test that drives `step()` by hand calls it on every worker first. Idempotent."""
        if self._link is not None:
            return
        self._group.connect()  # blocks until every worker joined (bounded by the group's timeout)
        # Every worker resumes where the leader does (a restarted worker process starts at the stream's start).
        self.trainer.sampler.seek(DataCursor(*self._group.share_cursor(self.trainer.sampler.data_cursor)))
        self.trainer.materialize()
        check_plan(self.spec, self.trainer)
        params = self.trainer.params
        with self._cv:
            for frag, names in zip(self.fragments.theta, self.spec.plan.fragments):
                frag[:] = [local_part(params[n]) for n in names]
        self._link = ShardLink(self._group, [[Layout.of(params[n]) for n in names] for names in self.spec.plan.fragments])

    def stop_shards(self) -> None:
        """The leader, at the stop: the final flush (when stopping with flush), then tell the workers to stop.

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
        """Every worker at the stop: leave the group."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        # Everyone has read the last message before anyone leaves: once, in about 30 runs of the test, a worker
        # whose peer had already torn its group down aborted at exit ("terminate called without an active exception").
        dist.barrier()
        self._group.close()

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of this worker's part of each parameter by name (rows of dim 0; buffers whole)."""
        return {n: local_part(p).cpu().clone() for n, p in self.trainer.params.items()}
