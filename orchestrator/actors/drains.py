"""Nodes being drained, as the GCS knows them: a preemption notice, or the autoscaler taking a node back.

Ray 2.60 drains a node through one GCS call (`GcsClient.drain_node`), which `ray drain-node`, the autoscaler
and cloud preemption handlers all use: the node accepts no new work from then on, and whoever asked ends it at
the deadline (Ray itself does not). The GCS answers `get_draining_nodes` with every draining node's deadline,
so the health monitor polls that once a second (one small RPC, no torch) and has its islands there leave in
time (ElasticMembership in membership.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

__all__ = ["DrainWatch", "drain_node", "draining_nodes"]

log = logging.getLogger(__name__)


def _gcs():
    return ray._private.worker.global_worker.gcs_client  # the driver's or this worker's own connection


def draining_nodes(timeout_s: float = 5.0) -> dict[str, float | None]:
    """Node id (hex) -> its drain deadline (wall time, seconds) or None when drained without one."""
    raw = _gcs().get_draining_nodes(timeout=timeout_s)
    return {node: (ms / 1000.0 if ms else None) for node, ms in raw.items()}


def drain_node(node_id: str, deadline_s: float | None, message: str, *, reason: str = "preemption") -> None:
    """Ask the GCS to drain node `node_id` (hex) with a deadline `deadline_s` seconds from now (None: none), as a
    cloud preemption handler does. Raises RuntimeError when the GCS refuses (e.g. the node is already dead)."""
    from ray.core.generated import autoscaler_pb2

    kind = {"preemption": "DRAIN_NODE_REASON_PREEMPTION", "idle": "DRAIN_NODE_REASON_IDLE_TERMINATION"}[reason]
    deadline_ms = int((time.time() + deadline_s) * 1000) if deadline_s else 0
    accepted, why = _gcs().drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(kind), message, deadline_ms, timeout=5)
    if not accepted:
        raise RuntimeError(f"the GCS refused to drain node {node_id}: {why}")


class DrainWatch:
    """The draining nodes, asked of the GCS at most every `period_s` (a failed ask keeps the last answer)."""

    def __init__(self, period_s: float = 1.0, read: Callable[[], dict[str, float | None]] = draining_nodes) -> None:
        self.period_s, self.read = max(period_s, 1.0), read
        self.nodes: dict[str, float | None] = {}
        self._asked = -float("inf")

    async def poll(self) -> dict[str, float | None]:
        """Node id -> deadline (wall time, or None) of every node being drained."""
        if time.monotonic() - self._asked >= self.period_s:
            self._asked = time.monotonic()
            try:
                self.nodes = await asyncio.get_running_loop().run_in_executor(None, self.read)
            except Exception as err:  # noqa: BLE001 - a GCS hiccup: ask again next period
                log.info("could not read the draining nodes: %s", err)
        return self.nodes
