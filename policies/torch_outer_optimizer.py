"""A user's ``torch.optim.Optimizer`` as the outer step of one fragment (``outer.optimizer``; docs/outer.md,
"Your own outer optimizer").

The built-in outer step is Nesterov SGD (policies/outer_optimizer.py). :class:`TorchOuterOptimizer` has the
same interface over any optimizer a factory ``factory(params)`` builds over the fragment's global parameters:
the merged outer gradient (global minus local parameters, a descent direction) becomes each parameter's
``.grad`` and the optimizer's own ``step()`` moves the parameters, so ``torch.optim.SGD(params, lr=1)`` is
FedAvg and ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`` is the built-in's full round.

A round's share ``scale`` in (0, 1] (policies.outer_optimizer.round_step_scale) multiplies every param
group's learning rate for that one step: scaling the gradient instead would do nothing to Adam-like
optimizers, which divide it by its own running size. ``clock`` has no further meaning here: the built-in's
clock rule (momentum decayed by ``mu ** s``) is a statement about SGD's buffer, which a plug-in does not
expose; under ``clock`` and ``participation`` alike the step is the optimizer's own with ``lr * s``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["OuterStep", "TorchOuterOptimizer", "first_moments"]


class OuterStep(Protocol):
    """What a round (orchestrator/core/round_merge.py) and the core ask of a fragment's outer optimizer."""

    @property
    def params(self) -> list[Tensor]: ...  # noqa: D102 - the fragment's global tensors, updated in place

    def build(self) -> None: ...  # noqa: D102 - build the torch optimizer now, off a round's path

    def step_tensor(self, i: int, grad: Tensor, *, scale: float = 1.0, clock: bool = False) -> None: ...  # noqa: D102

    def average_step_tensor(self, i: int, grad: Tensor) -> None: ...  # noqa: D102 - params[i] -= grad

    def momentum_buffers(self) -> list[Tensor | None]: ...  # noqa: D102 - the poison guard's direction


def first_moments(state: dict[Any, dict[str, Any]], params: Sequence[Tensor]) -> list[Tensor | None]:
    """Per parameter: its optimizer state's ``momentum_buffer`` (SGD), else ``exp_avg`` (Adam's first moment),
    else None. Both are running means of the outer gradient, the direction the poison guard compares with."""
    out: list[Tensor | None] = []
    for p in params:
        found = [v for v in (state.get(p, {}).get(k) for k in ("momentum_buffer", "exp_avg")) if isinstance(v, Tensor)]
        out.append(found[0] if found else None)
    return out


class TorchOuterOptimizer:
    """The outer step of one fragment by an optimizer ``factory(params)`` builds (module docstring).

    Args:
        params: the fragment's global parameters, float32 leaf tensors, updated in place (``requires_grad``
            may be False: the gradient is set as ``.grad`` and the step runs under no_grad).
        factory: called once, with the list of `params`, at :meth:`build` or the first step (so a process
            that only writes a fresh checkpoint never calls it); must return a ``torch.optim.Optimizer``
            holding exactly `params`. Anything else is a one-line ValueError naming `name` and the fix.
        name: how messages name the factory (its import path, else its qualified name).

    Each parameter keeps a ``.grad`` buffer once stepped (a float32 copy of the fragment, reused every round).
    """

    def __init__(self, params: Sequence[Tensor], factory: Callable[[list[Tensor]], Any], *, name: str) -> None:
        params = list(params)
        if not params:
            raise ValueError(f"outer optimizer {name!r} got no params; pass the fragment's tensors")
        for i, p in enumerate(params):
            if p.dtype != torch.float32 or not p.is_leaf:
                raise ValueError(f"params[{i}] must be a float32 leaf tensor, got {p.dtype}, leaf={p.is_leaf}; pass "
                                 "p.detach().float()")
        self._params, self._factory, self.name = params, factory, name
        self._built: torch.optim.Optimizer | None = None
        self._seen: set[int] = set()  # indices of the round in progress, stepped or averaged
        self._graded: set[int] = set()  # of those, the ones whose gradient waits for the torch step
        self._scale: float | None = None  # the round's share, the same for all its tensors

    @property
    def params(self) -> list[Tensor]:
        """The parameters this optimizer updates, the very tensors passed in."""
        return list(self._params)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer, built by the factory on first use."""
        if self._built is None:
            self._built = self._make()
        return self._built

    def build(self) -> None:
        """Call the factory now rather than at the first round (the outer optimizer's actor does at start)."""
        _ = self.optimizer

    def _make(self) -> torch.optim.Optimizer:
        try:
            opt = self._factory(list(self._params))
        except Exception as err:  # noqa: BLE001 - the user's factory failed: one line, the traceback chained
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(f"outer optimizer {self.name!r} raised {type(err).__name__}: {first}; fix it (it is "
                             "called with the list of one fragment's parameters)") from err
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"outer optimizer {self.name!r} returned a {type(opt).__name__}, not a "
                             "torch.optim.Optimizer; make it return e.g. torch.optim.Adam(params, lr=...)")
        held = [p for g in opt.param_groups for p in g["params"]]
        if len(held) != len(self._params) or {id(p) for p in held} != {id(p) for p in self._params}:
            raise ValueError(f"outer optimizer {self.name!r} holds {len(held)} tensors, not the {len(self._params)} "
                             "parameters it was given; build it over exactly the list it is called with")
        return opt

    def step(self, outer_grad: Sequence[Tensor], *, scale: float = 1.0, clock: bool = False) -> None:
        """One outer step of the whole fragment with `outer_grad[i]` as the gradient of ``params[i]`` (read, not
        written) and every group's lr times `scale` for this step; `clock` changes nothing (module docstring)."""
        outer_grad = list(outer_grad)
        if len(outer_grad) != len(self._params):
            raise ValueError(f"outer_grad has {len(outer_grad)} tensors but the fragment has {len(self._params)}; "
                             "pass one gradient per parameter, in order")
        for i, (p, g) in enumerate(zip(self._params, outer_grad)):
            self.step_tensor(i, g.detach().to(device=p.device, dtype=torch.float32).contiguous(), scale=scale,
                             clock=clock)

    def step_tensor(self, i: int, grad: Tensor, *, scale: float = 1.0, clock: bool = False) -> None:
        """Take `grad` (float32, the parameter's shape; copied, so the caller may reuse it) as ``params[i]``'s
        gradient; once every tensor of the fragment has been given (here or to :meth:`average_step_tensor`),
        step the torch optimizer once with every group's lr times `scale`. A round gives each tensor once."""
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"scale={scale} must be in (0, 1]; pass round_step_scale(...)")
        p = self._params[i]
        if grad.shape != p.shape or grad.dtype != torch.float32 or grad.device != p.device:
            raise ValueError(f"grad for params[{i}] must be float32 of shape {tuple(p.shape)} on {p.device}, got "
                             f"{grad.dtype} {tuple(grad.shape)} on {grad.device}; use step() for other gradients")
        if self._scale is not None and scale != self._scale:
            raise RuntimeError(f"params[{i}] got scale {scale} in a round stepped at {self._scale}; give every "
                               "tensor of a round the round's one scale")
        self._note(i)
        self._scale = scale
        if p.grad is None or p.grad.shape != p.shape:
            p.grad = grad.detach().clone()
        else:
            p.grad.copy_(grad)
        self._graded.add(i)
        self._finish_if_complete()

    def average_step_tensor(self, i: int, grad: Tensor) -> None:
        """``params[i] -= grad`` with no optimizer (a trained buffer's mean, or the final flush; `grad` is read);
        counts as the tensor's part of the round."""
        p = self._params[i]
        if grad.shape != p.shape:
            raise ValueError(f"grad for params[{i}] has shape {tuple(grad.shape)}, the parameter {tuple(p.shape)}")
        self._note(i)
        with torch.no_grad():
            p.sub_(grad.to(device=p.device, dtype=p.dtype))
        self._finish_if_complete()

    def average_step(self, outer_grad: Sequence[Tensor]) -> None:
        """``params -= outer_grad``: the final flush's move to the islands' mean; the optimizer's state stays."""
        outer_grad = list(outer_grad)
        if len(outer_grad) != len(self._params):
            raise ValueError("outer_grad must have one tensor per parameter of the fragment, in order")
        for i, g in enumerate(outer_grad):
            self.average_step_tensor(i, g)

    def _note(self, i: int) -> None:
        if not 0 <= i < len(self._params):
            raise IndexError(f"tensor index {i} is outside the fragment's {len(self._params)} parameters")
        if i in self._seen:
            raise RuntimeError(f"params[{i}] was given twice in one round; a round gives each tensor of the "
                               "fragment once (step_tensor or average_step_tensor)")
        self._seen.add(i)

    def _finish_if_complete(self) -> None:
        if len(self._seen) < len(self._params):
            return
        graded, scale = self._graded, self._scale or 1.0
        self._seen, self._graded, self._scale = set(), set(), None
        if graded:
            self._step(graded, scale)

    def _step(self, graded: set[int], scale: float) -> None:
        """The torch step over the tensors given a gradient this round (the others hold no .grad, so torch skips
        them: an averaged buffer gets no momentum and no weight decay), lr times `scale` for this step only."""
        opt = self.optimizer
        for i, p in enumerate(self._params):
            if i not in graded:
                p.grad = None
        lrs = [g["lr"] for g in opt.param_groups]
        try:
            if scale != 1.0:
                for g, lr in zip(opt.param_groups, lrs):
                    g["lr"] = lr * scale
            with torch.no_grad():
                opt.step()
        finally:
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr  # the very object it was (a float, or a tensor lr)

    def momentum_buffers(self) -> list[Tensor | None]:
        """Per parameter: ``momentum_buffer`` (SGD), else ``exp_avg`` (Adam), else None (:func:`first_moments`),
        not copied; what the poison guard compares a submission's direction with. Builds nothing."""
        if self._built is None:
            return [None] * len(self._params)
        return first_moments(self._built.state, self._params)

    def state_dict(self) -> dict[str, Any]:
        """``{"kind": the optimizer's class, "torch": its state_dict()}``, deep-copied; empty before it is built."""
        if self._built is None:
            return {}
        return {"kind": type(self._built).__qualname__, "torch": copy.deepcopy(self._built.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (the optimizer's hyperparameters too, as torch's
        load_state_dict does); ``{}`` leaves a fresh optimizer. A state of another optimizer class is refused."""
        if not state_dict:
            return
        kind = type(self.optimizer).__qualname__
        if state_dict.get("kind") != kind:
            raise ValueError(f"the outer optimizer state is a {state_dict.get('kind')}'s, and {self.name!r} builds a "
                             f"{kind}; load a state this factory's optimizer wrote")
        # Deep copy: torch would otherwise alias the caller's tensors and step them in place.
        self.optimizer.load_state_dict(copy.deepcopy(state_dict["torch"]))
