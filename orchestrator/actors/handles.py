"""Typed calls on actor handles: `call(handle, IslandShell.watch, 5.0)` is `handle.watch.remote(5.0)`.

Ray's `handle.method.remote(...)` is an attribute looked up at run time: an editor cannot follow it to the method
and a type checker sees `Any`. `call` names the method itself, so an editor jumps to its definition, and its
signature (argument names, types, keyword-only parameters) and return type are the method's own: a wrong argument
is a type error at the call, and the ref's value has the method's return type (an `async def` method's too).

Handles are annotated `ActorHandle[Shell]` with the plain shell class (orchestrator/actors/remote.py applies
`ray.remote` to those). Nothing changes at run time: `call` looks the method up by name on the handle, as
`handle.<name>.remote` does, so a handle from `ray.get_actor` works the same.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

__all__ = ["call"]

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


@overload
def call(handle: ActorHandle[T], method: Callable[Concatenate[T, P], Coroutine[Any, Any, R]], /,
         *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]: ...


@overload
def call(handle: ActorHandle[T], method: Callable[Concatenate[T, P], R], /,
         *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]: ...


def call(handle: Any, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Submit `method(*args, **kwargs)` to the actor behind `handle`; returns its ObjectRef (await it, or
    `ray.get` it). `method` is the shell class's own function (`OuterShell.register`), not a name."""
    return getattr(handle, method.__name__).remote(*args, **kwargs)
