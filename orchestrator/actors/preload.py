"""Imported by every worker process of a local Ray that a run's driver starts, before the worker takes work.

`ensure_ray` names this module in Ray's `preload_python_modules` and has the raylet prestart idle workers as
soon as it is up. Ray hands those workers to the first actors whose runtime env is the job's (empty there):
the outer optimizer, the health monitor and the first islands. Preloaded, they import torch while Ray's own
start leaves a core idle, not after placement, when every core is busy (benchmarks/RESULTS.md#startup-prestarted).

Torch only where the worker's environment turns zero-copy tensors on (Ray would import it at the first task
anyway): a control-plane process (the chaos injector; the health monitor in a cluster's job) turns them off
in its runtime env and stays light.
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_on_sigterm(signum, frame) -> None:
    sys.exit(1)


# What Ray's worker main loop does on SIGTERM (it sets its own once the preload is done), from the preload's start:
# a worker stopped while it still imports (a warm spare at the end of a short run) exits quietly rather than
# with Ray's fatal-signal dump on the driver's console.
signal.signal(signal.SIGTERM, _exit_on_sigterm)

if os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS") == "1":
    import torch  # noqa: F401 - the import is the point

    import islands.island  # noqa: F401 - what an island's constructor imports: most prestarted workers become one
