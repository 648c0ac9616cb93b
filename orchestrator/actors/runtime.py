"""What every actor process of a run shares: the namespace, the worker environment, quiet logging.

Imports neither torch nor the islands, so the control-plane processes stay light.
"""

from __future__ import annotations

import logging
import warnings

import ray
from ray._private.tensor_serialization_utils import ZeroCopyTensorsWarning

NAMESPACE = "diloco"
# Tensor gets near free; fetched tensors are shared memory and are never modified in place. Arguments
# are deserialized before __init__ runs, so the read-only-array notice is silenced by the environment.
WORKER_ENV = {
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "PYTHONWARNINGS": "ignore:The given NumPy array is not writable:UserWarning",
}

# The health monitor and the chaos injector never hold a tensor. With zero-copy tensors on, Ray
# imports torch in every worker it starts (to register the tensor reducer): ~3 s of CPU per process
# on a 2-core machine, on the critical path of a run's start and of a monitor restart. Their actors
# get this runtime env (merged with the job's) and start without torch; the monitor only where the job has a
# runtime env of its own (orchestrator/run/setup.py, monitor_runtime_env).
CONTROL_PLANE_RUNTIME_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "0"}}
# Actors inherit their creator's runtime env: the islands the monitor creates turn zero-copy back on.
DATA_PLANE_RUNTIME_ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


def ignore_zero_copy_warnings() -> None:
    """Silence Ray's zero-copy notices: fetched tensors are copied into our own, never written in place."""
    warnings.filterwarnings("ignore", category=ZeroCopyTensorsWarning)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def placement_group_id() -> str | None:
    """The id (hex) of the placement group the calling actor runs in, or None."""
    pg = ray.get_runtime_context().get_placement_group_id()
    return pg or None


class RoleFormatter(logging.Formatter):
    """An actor's console line: its role in words, then the message (`health monitor: island 0 ... dead: ...`);
    errors say so (`health monitor: error: ...`). No time, module or class name: Ray forwards these lines to the
    driver's console without its `(ClassName pid=...)` prefix (orchestrator/__init__.py), so the role is the
    line's only source, and the user reads it."""

    def __init__(self, role: str) -> None:
        super().__init__("%(message)s")
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        # islands/ names its island in its own lines (it logs the same way outside an actor): not twice.
        if text.startswith(f"{self.role}: "):
            text = text[len(self.role) + 2:]
        return f"{self.role}: {'error: ' if record.levelno >= logging.ERROR else ''}{text}"


def quiet_worker(role: str = "diloco") -> None:
    """Log set-up of an actor process: warnings only, each line led by the actor's `role` (RoleFormatter), Ray's
    zero-copy notices silenced. Called again (a warm spare that becomes an island), it renames the role."""
    # Actor INFO lines would be forwarded to the driver's console and break its progress line;
    # warnings still reach it.
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h.formatter, RoleFormatter)]
    if ours:
        for h in ours:
            h.setFormatter(RoleFormatter(role))
    elif not root.handlers:  # an actor process: nothing configured it (in a test or a notebook, leave theirs alone)
        handler = logging.StreamHandler()
        handler.setFormatter(RoleFormatter(role))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    ignore_zero_copy_warnings()
