"""torch's AdamW and SGD, built and stepped without importing torch's compiler.

Why: in torch 2.13 every ``torch.optim.Optimizer`` imports ``torch._dynamo`` on its first
``add_param_group`` (called by its constructor), ``zero_grad``, ``state_dict``, ``load_state_dict``
and ``step``: the methods are wrapped to turn the compiler off inside them, and the wrapper imports
the compiler to do it. That import costs about 1.1 s of CPU in every process that builds an
optimizer (measured in benchmarks/startup.py's runs), which at a run's start is every island and
the outer optimizer at once, and after a failure every restarted island, on the path to its first
step. Outside a compiled region the wrappers do nothing else, so these subclasses call the wrapped
methods directly and keep the wrappers for code that torch.compile traces.

The arithmetic is torch's own (the same functions run); tests/policies/test_torch_optimizers.py
checks the steps bitwise against ``torch.optim`` and that a fresh process building and stepping
them never imports ``torch._dynamo``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` without torch's decorators (each keeps the function it wraps in ``__wrapped__``)."""
    return inspect.unwrap(fn)


_ADD_PARAM_GROUP = _unwrapped(Optimizer.add_param_group)
_ZERO_GRAD = _unwrapped(Optimizer.zero_grad)
_STATE_DICT = _unwrapped(Optimizer.state_dict)
_LOAD_STATE_DICT = _unwrapped(Optimizer.load_state_dict)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class _NoCompilerImport(Optimizer):
    """Optimizer methods that skip torch's compiler-disabling wrappers unless torch.compile is tracing."""

    _raw_step: Callable[..., Any]  # the optimizer class's step without its wrapper (set by each subclass)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group (the constructor calls it once per group)."""
        if _compiling():
            return super().add_param_group(param_group)
        return _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad."""
        if _compiling():
            return super().zero_grad(set_to_none)
        return _ZERO_GRAD(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict (hooks included)."""
        if _compiling():
            return super().state_dict()
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict (hooks included)."""
        if _compiling():
            return super().load_state_dict(state_dict)
        return _LOAD_STATE_DICT(self, state_dict)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """torch's step, under the grad mode its wrapper sets (off unless the optimizer is `differentiable`)."""
        if _compiling():
            return super().step(closure)
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return type(self)._raw_step(self, closure)
        finally:
            torch.set_grad_enabled(previous)


class AdamW(_NoCompilerImport, torch.optim.AdamW):
    """``torch.optim.AdamW``, same arguments and arithmetic, without the compiler import (module docstring)."""

    _raw_step = staticmethod(_unwrapped(torch.optim.AdamW.step))


class SGD(_NoCompilerImport, torch.optim.SGD):
    """``torch.optim.SGD``, same arguments and arithmetic, without the compiler import (module docstring)."""

    _raw_step = staticmethod(_unwrapped(torch.optim.SGD.step))
