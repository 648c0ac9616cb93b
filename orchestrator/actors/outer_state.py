"""What the outer-optimizer shell keeps beside its core: the checkpoint writer and the salvage ledger.

`CheckpointWriter` restores the newest valid checkpoint when the shell starts (a Ray restart is the
same path) and saves the core on its own thread every `every_s`. `SalvageLedger` remembers what the
shell took from each island incarnation, which a dead incarnation's salvaged snapshot is checked
against (policies/salvage.py), and where each island slot's next incarnation resumes its data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import pickle
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ray.exceptions import RayActorError, RayTaskError

from islands.cursor import DataCursor
from islands.messages import Submission
from policies.salvage import salvageable

if TYPE_CHECKING:
    from orchestrator.core.checkpoint import Checkpoint
    from orchestrator.core.settings import CheckpointSettings


class CheckpointWriter:
    """Numbered checkpoints under `settings.uri` (the newest `settings.keep` kept), written on a thread of their own."""

    def __init__(self, settings: CheckpointSettings) -> None:
        # torch: imported only in the shell's own process, not where a handle is held.
        from orchestrator.core.checkpoint import CheckpointStore

        self.uri = settings.uri
        self.every_s = settings.every_s
        self.step = 0  # the newest checkpoint's number (restored, then each save's)
        self._store = CheckpointStore(settings.uri, keep=settings.keep)
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outer-ckpt")
        self._last = time.monotonic()

    def load_latest(self) -> Checkpoint:
        """The newest valid checkpoint; the driver seeds checkpoint 0 before starting, so there is one."""
        latest = self._store.load_latest()
        if latest is None:
            raise RuntimeError(f"no valid checkpoint under {self.uri}; the driver seeds checkpoint 0 before starting")
        self.step = latest.step
        self._last = time.monotonic()
        return latest

    def due(self) -> bool:
        """Whether `every_s` has passed since the last save (or the restore)."""
        return time.monotonic() - self._last >= self.every_s

    def mark(self) -> None:
        """A save begins now: the next is due `every_s` from here."""
        self._last = time.monotonic()

    async def save(self, tensors: dict, meta: dict) -> int:
        """Write the next checkpoint on the writer thread; returns its number."""
        self.step += 1
        step = self.step
        await asyncio.get_running_loop().run_in_executor(self._writer, self._store.save, step, tensors, meta)
        return step


@dataclasses.dataclass
class Taken:
    """What the shell took from one island incarnation."""

    seq: dict[int, int] = dataclasses.field(default_factory=dict)  # fragment -> highest seq taken
    cursor: DataCursor = DataCursor()  # highest data cursor taken


@dataclasses.dataclass
class SalvagePlan:
    """What of a dead incarnation's snapshot goes to the core, and the report the caller returns."""

    report: dict  # {"tokens": per fragment, "step", "skipped": {fragment: why}, "seqs"}
    submissions: list[Submission]  # salvaged submissions, to send up the island's link
    floor: DataCursor  # the data cursor the slot's next incarnation resumes from at least


class SalvageLedger:
    """Per island incarnation, what was taken from it; per island slot, the cursor it resumes from at least."""

    def __init__(self) -> None:
        self._taken: dict[tuple[int, int], Taken] = {}
        self._resume_floor: dict[int, DataCursor] = {}

    def took(self, island: int, incarnation: int, sub: Submission) -> None:
        """The shell took `sub` from an island incarnation (merged, refused or in flight: never read again)."""
        taken = self._taken.setdefault((island, incarnation), Taken())
        taken.seq[sub.fragment] = max(taken.seq.get(sub.fragment, -1), sub.seq)
        taken.cursor = max(taken.cursor, DataCursor.of(sub.cursor))

    async def salvage(self, island: int, incarnation: int, blob: list[Any], *,
                      run_on_core: Callable[..., Awaitable[Any]], send_up: Callable[..., Awaitable[None]],
                      epoch: int, fragments: int) -> dict:
        """Send up what is still valid of a dead incarnation's progress snapshot; `blob` is [ref to the pickled
        ProgressSnapshot the keeper held, or to None]. Unpickled via `run_on_core`, each salvaged submission
        goes to `send_up(island, sub, None, sent_at=...)`. Returns the report, or {"keeper_error": why}."""
        try:
            data = await blob[0]  # an ObjectRef is awaitable
        except (RayActorError, RayTaskError) as err:
            return {"keeper_error": str(err).strip().splitlines()[-1][:200]}
        taken = self._taken.pop((island, incarnation), Taken())
        snapshot = None if data is None else await run_on_core(pickle.loads, data)
        plan = self._plan(island, incarnation, snapshot, taken, epoch=epoch, fragments=fragments)
        for sub in plan.submissions:
            await send_up(island, sub, None, sent_at=time.time())  # from the keeper, now
        self._resume_floor[island] = max(self._resume_floor.get(island, DataCursor()), plan.floor)
        return plan.report

    @staticmethod
    def _plan(island: int, incarnation: int, snapshot: Any, taken: Taken, *, epoch: int, fragments: int) -> SalvagePlan:
        # What is still valid of the snapshot (None: the keeper held none), and the floor it sets.
        floor = taken.cursor  # taken work is merged or refused: a new incarnation never reads it again
        tokens = [0] * fragments
        report: dict = {"tokens": tokens, "step": None, "skipped": {}, "seqs": []}
        if snapshot is None:
            return SalvagePlan(report, [], floor)
        if (snapshot.island, snapshot.incarnation) != (island, incarnation):
            raise ValueError(f"the keeper handed over island {snapshot.island}/{snapshot.incarnation}'s snapshot "
                             f"for {island}/{incarnation}")
        result = salvageable(snapshot, taken=taken.seq, epoch=epoch)
        report["step"], report["skipped"] = snapshot.step, {str(p): why for p, why in result.skipped.items()}
        report["seqs"] = [sub.seq for sub in result.submissions]
        for sub in result.submissions:
            tokens[sub.fragment] += sub.tokens
            floor = max(floor, DataCursor.of(sub.cursor))
        return SalvagePlan(report, list(result.submissions), floor)

    def floor(self, island: int) -> DataCursor:
        """The cursor a slot's next incarnation resumes from at least (batch 0: nothing taken or salvaged)."""
        return self._resume_floor.get(island, DataCursor())
