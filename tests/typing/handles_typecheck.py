"""Read by mypy in .ci/run, never run: `orchestrator.actors.handles.call` takes the method's own signature and return
type. The lines marked `type: ignore[...]` must fail to type-check; `warn_unused_ignores` (pyproject.toml) fails
CI if one of them stops failing, and `assert_type` fails it if a return type changes."""

from __future__ import annotations

from ray import ObjectRef
from ray.actor import ActorHandle
from typing_extensions import assert_type

from orchestrator.actors.handles import call


class Shell:
    def watch(self, timeout_s: float) -> str:
        return "training"

    async def stop(self, timeout_s: float = 30.0, *, flush: bool = False) -> int:
        return 0


def calls(h: ActorHandle[Shell]) -> None:
    assert_type(call(h, Shell.watch, 5.0), ObjectRef[str])
    assert_type(call(h, Shell.watch, timeout_s=5.0), ObjectRef[str])
    assert_type(call(h, Shell.stop, flush=True), ObjectRef[int])  # an async method's ref holds its result
    call(h, Shell.watch, "five")  # type: ignore[call-overload]
    call(h, Shell.stop, 1.0, True)  # type: ignore[call-overload]
    call(h, Shell.stop, flsh=True)  # type: ignore[call-overload]
    call(h, Shell.watch)  # type: ignore[call-overload]
