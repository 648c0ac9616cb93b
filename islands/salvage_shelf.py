"""An island's salvage shelf: every n steps, its unsubmitted progress left with the pool's keeper.

If the island dies, the keeper hands the latest snapshot on, so the progress since the last cuts is
not lost with it (policies/salvage.py says when this pays). The differences are taken on the loop
thread at a step boundary (they must be of that step's parameters); encoding, pickling and handing
them over run on a sender thread, off the compute path.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
import time
from collections.abc import Callable

from islands.fragment_state import FragmentState
from islands.messages import Submission
from islands.outbox import Outbox
from policies.salvage import ProgressSnapshot, salvage_due

log = logging.getLogger(__name__)

Shelve = Callable[[int, bytes], bool | None]
"""`shelve(step, blob)`: leaves a pickled ProgressSnapshot with the keeper; False if it skipped it."""


class SalvageShelf:
    """Progress snapshots of one island incarnation on their way to its pool's keeper."""

    def __init__(self, *, island: int, incarnation: int, every_steps: int, shelve: Shelve,
                 fragments: FragmentState, outbox: Outbox, cv: threading.Condition) -> None:
        self.island, self.incarnation, self.every_steps = island, incarnation, every_steps
        self._shelve = shelve
        self._fragments = fragments
        self._outbox = outbox
        self._cv = cv
        self.shelve_s = 0.0  # inner-loop time spent on progress snapshots (salvage's cost on the compute path)
        self.shelved_bytes = 0
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None  # pickles and sends snapshots
        self._sending: concurrent.futures.Future | None = None  # the snapshot being sent

    def after_step(self, step: int) -> None:
        """Loop thread, at a step boundary: shelve the progress if a snapshot is due after inner step `step`."""
        if salvage_due(step, self.every_steps):
            self.shelve(step)

    def shelve(self, step: int) -> None:
        """Leave every fragment's unsubmitted progress with the pool's keeper.

        If the previous snapshot is still on its way, this waits for it first (it takes milliseconds
        against n steps)."""
        t0 = time.perf_counter()
        if self._sending is not None:
            self._sending.result()
        with self._cv:
            subs: list[Submission] = []
            seq = self._outbox.next_seq
            for p in range(self._fragments.num_fragments):
                if self._fragments.has_progress(p):
                    subs.append(self._outbox.progress(p, seq + len(subs)))  # encoded by the sender
            snapshot = ProgressSnapshot(island=self.island, incarnation=self.incarnation, next_seq=seq,
                                        epochs=list(self._fragments.epoch), step=step, submissions=subs)
        if subs:
            if self._sender is None:
                self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"island-{self.island}-shelve")
            self._sending = self._sender.submit(self._send, snapshot)
        self.shelve_s += time.perf_counter() - t0

    def _send(self, snapshot: ProgressSnapshot) -> None:
        for sub in snapshot.submissions:  # the raw differences were taken at the step boundary; encode them here
            sub.payload = self._outbox.encode(sub.payload)
        blob = pickle.dumps(snapshot, protocol=5)  # bytes: the keeper holds them without importing torch
        try:
            sent = self._shelve(snapshot.step, blob) is not False
        except Exception as err:  # noqa: BLE001 - salvage is best effort; the next snapshot tries again
            log.warning("island %d: could not leave progress with the keeper: %s", self.island, err)
            sent = False
        with self._cv:
            self.shelved_bytes += len(blob) if sent else 0

    def wait(self) -> None:
        """Block until the latest snapshot has been handed over."""
        if self._sending is not None:
            self._sending.result()

    def close(self) -> None:
        """No more snapshots: the outbox or the final flush has the rest."""
        if self._sender is not None:
            self._sender.shutdown(wait=False)
