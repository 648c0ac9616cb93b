"""Waiting out a driver session's start-up: the islands the health monitor starts (and a fresh run's outer
optimizer), reported as they come up.

`Run._start_islands` (orchestrator/run/driver.py) asks the monitor to start the islands, then calls
`wait_for_start`, which reports the "islands" and "first_step" stages (orchestrator/run/startup.py) while
it waits, and says what an elastic pool below its minimum is waiting for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from orchestrator.actors.handles import call
from orchestrator.actors.health_monitor import HealthMonitor
from orchestrator.config import RunConfig
from orchestrator.run.startup import StartupStages, islands_ready, stepped_islands

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


def wait_for_start(started: Any, others: list, *, cfg: RunConfig, monitor: ActorHandle[HealthMonitor], first_inc: dict[int, int],
                   timeout_s: float, get: Callable[..., Any], stages: StartupStages) -> None:
    """Wait for `started` (the monitor's ensure_started call) and `others` (e.g. a fresh run's outer optimizer
    coming up) for `timeout_s`, longer while an elastic pool waits for machines. Process starts, not control
    calls: on a loaded machine they take longer than call_timeout_s.

    `get(ref, timeout=...)` reads a reply. When a caller listens to `stages`, reports "islands ready n of M" as
    islands come up, and "first_step" as soon as one has stepped, while others still start. Raises RuntimeError (one line) when
    the islands failed to start, GetTimeoutError when they are not up in time.
    """
    waits = [started, *others]
    deadline, ready, need, said = time.monotonic() + timeout_s, 0, cfg.required_islands, ""
    elastic, listening = need < cfg.num_islands, stages.listening
    while waits:
        left = max(0.0, deadline - time.monotonic())
        done, waits = ray.wait(waits, num_returns=len(waits),
                               timeout=min(0.25 if listening else 1.0, left) if elastic or listening else left)
        for ref in done:
            try:
                get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except RayTaskError as err:
                if ref != started:
                    raise
                cause = str(err).strip().splitlines()[-1]
                raise RuntimeError(f"islands failed to start: {cause}") from None
        if listening or elastic:
            snap = get(call(monitor, HealthMonitor.snapshot)) if started in waits else None
            now_ready = need if snap is None else min(islands_ready(snap, first_inc), need)
            if now_ready > ready and listening:
                ready = now_ready
                stages("islands", f"islands ready {ready} of {need}" + (" (the elastic pools' minimum)" if elastic else ""),
                       ready, need)
            if snap is not None and snap.get("waiting"):
                # An elastic pool below its minimum waits for machines as long as it takes, and says for what.
                deadline = max(deadline, time.monotonic() + timeout_s)
                text = "; ".join(snap["waiting"])
                if text != said:
                    log.warning("waiting for %s", text)
                    said = text
            if snap is not None and listening:  # islands start at different times
                stages.first_step(stepped_islands(snap, first_inc))
        if waits and time.monotonic() > deadline:
            raise GetTimeoutError(f"islands or the outer optimizer not up after {timeout_s:.0f} s")
