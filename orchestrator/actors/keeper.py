"""ProgressKeeper: holds each island's latest progress snapshot outside the island's failure domain.

One keeper per pool, named `<run_id>-keeper-<pool>`, detached and placed in its pool (the snapshots
travel inside the pool, never over the WAN; only a salvage goes on to the outer optimizer), on a node
without the pool's islands when there is one (policies/keeper_placement.py); the monitor moves it, with
what it holds (`dump` / `load`), when a better node comes up. It holds opaque bytes, so its process
never imports torch; the health monitor passes a `take` ref on to the outer optimizer without fetching
it. What is salvageable is decided there (policies/salvage.py).

A keeper that dies (its node failed) loses its snapshots: the islands' unsubmitted progress is then
lost as it would be without salvage, and the monitor (which pings keepers every second) starts a new
one. `ray.remote` is applied in orchestrator/actors/remote.py.
"""

from __future__ import annotations

import time


def keeper_name(run_id: str, pool: str) -> str:
    """The detached actor name of a pool's progress keeper."""
    return f"{run_id}-keeper-{pool}"


class ProgressKeeper:
    """The newest snapshot per island slot: a later incarnation, or a later step of the same one, replaces it."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._held: dict[int, tuple[int, int, bytes, float]] = {}  # island -> (incarnation, step, blob, at)

    def keep(self, island: int, incarnation: int, step: int, blob: bytes) -> bool:
        """Hold `blob` for the island unless a newer one is held; returns whether it was kept."""
        held = self._held.get(island)
        if held is not None and (held[0], held[1]) >= (incarnation, step):
            return False
        self._held[island] = (incarnation, step, blob, time.time())
        return True

    def take(self, island: int, incarnation: int) -> bytes | None:
        """Hand over (and forget) the island's snapshot if it is of `incarnation`; None otherwise."""
        held = self._held.get(island)
        if held is None or held[0] != incarnation:
            return None
        del self._held[island]
        return held[2]

    def held(self) -> dict[int, dict]:
        """What is held, per island: incarnation, step, bytes and age (status and tests)."""
        now = time.time()
        return {i: {"incarnation": inc, "step": step, "bytes": len(blob), "age_s": now - at}
                for i, (inc, step, blob, at) in self._held.items()}

    def dump(self) -> dict[int, tuple[int, int, bytes, float]]:
        """Everything held, for a keeper that replaces this one on another node (the monitor moves keepers)."""
        return dict(self._held)

    def load(self, held: dict[int, tuple[int, int, bytes, float]]) -> int:
        """Adopt a predecessor's `dump()`, entry by entry unless a newer one is already held (an island may
        have shelved here first); returns how many were adopted."""
        adopted = 0
        for island, (incarnation, step, blob, at) in held.items():
            mine = self._held.get(island)
            if mine is None or (mine[0], mine[1]) < (incarnation, step):
                self._held[island] = (incarnation, step, blob, at)
                adopted += 1
        return adopted

    def node(self) -> str:
        """The Ray node this keeper runs on (the monitor checks it against its islands' nodes)."""
        import ray  # only in the actor process: the class itself stays importable without Ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> tuple[None, None, float]:
        """Liveness probe, shaped like an island's (a keeper serves no slot)."""
        return None, None, time.time()
