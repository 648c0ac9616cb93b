"""A Pier-style outer optimizer: Nesterov SGD whose momentum warms up over a fragment's first outer steps.

Pier (Fan and Zhang, arXiv 2511.17849) adds a momentum warm-up and a momentum decay to DiLoCo's outer
optimizer. This file does not reproduce the paper's schedule, which was not checked against its text; it is
"Pier-style" in one exact sense: the momentum of a fragment's outer step ``t`` (0 for its first) is

    mu_t = start_momentum + (momentum - start_momentum) * min(t, warmup_steps) / warmup_steps

a straight line from ``start_momentum`` at step 0 to ``momentum`` at step ``warmup_steps`` and after, with no
decay. Each step is then the Nesterov step that torch's ``SGD(nesterov=True)`` takes, written out so that the
momentum may change between steps:

    buf_t = mu_t * buf_{t-1} + g_t        (buf_{-1} = 0)
    p_t   = p_{t-1} - lr * (g_t + mu_t * buf_t)

where ``g_t`` is the round's merged outer gradient (global minus local parameters, a descent direction). With
``start_momentum == momentum`` it is the built-in outer step's full round.

Why warm up: the first outer gradients are measured from the random initialization and are large and noisy; a
full momentum of 0.9 keeps adding them to the steps of the next rounds (the buffer remembers about 1 / (1 - mu)
of them). A lower momentum early lets the first rounds' directions fade before they have compounded.

Use it by import path, ``--set outer.optimizer=examples.extending.pier_warmup:make``, or from Python,
``DilocoTrainer(..., outer_optimizer=make)``; ``functools.partial(make, warmup_steps=20)`` changes a setting.
The engine builds one optimizer per fragment, so each fragment counts its own steps. The count lives in the
optimizer's per-parameter state (``state[p]["step"]``) and the schedule in its param group, so a checkpoint
(``state_dict()``) restores both and a resumed run continues the ramp where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["LR", "MOMENTUM", "START_MOMENTUM", "WARMUP_STEPS", "PierWarmupSGD", "make", "momentum_at"]

# The defaults: the built-in outer step's lr and momentum (docs/config.md), reached after WARMUP_STEPS of a
# fragment's rounds. The default run closes about 28 rounds per fragment, so 8 is its first quarter or so.
LR = 0.7
MOMENTUM = 0.9
START_MOMENTUM = 0.0
WARMUP_STEPS = 8


def momentum_at(step: int, *, momentum: float, start_momentum: float, warmup_steps: int) -> float:
    """The momentum of outer step `step` (0-based): linear from `start_momentum` to `momentum` over
    `warmup_steps` steps, `momentum` from then on (module docstring)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return momentum
    return start_momentum + (momentum - start_momentum) * step / warmup_steps


class PierWarmupSGD(torch.optim.Optimizer):
    """Nesterov SGD with a linear momentum warm-up (module docstring).

    Args:
        params: the tensors to step (the engine gives one fragment's global parameters).
        lr: the step size (> 0). The engine multiplies it by a partial round's share for that step.
        momentum: the momentum once warmed up, in [0, 1).
        start_momentum: the momentum of the first step, in [0, momentum].
        warmup_steps: steps from `start_momentum` to `momentum` (>= 0; 0: no warm-up).
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float = LR, momentum: float = MOMENTUM,
                 start_momentum: float = START_MOMENTUM, warmup_steps: int = WARMUP_STEPS) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not 0.0 <= start_momentum <= momentum:
            raise ValueError(f"start_momentum must be in [0, momentum={momentum}], got {start_momentum}")
        if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        # The schedule is in the param group, so torch's state_dict() carries it into a checkpoint.
        super().__init__(params, {"lr": lr, "momentum": momentum, "start_momentum": start_momentum,
                                  "warmup_steps": warmup_steps})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One outer step of every parameter with a ``.grad``; those without (trained buffers) are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = int(state.get("step", 0))  # steps this parameter took before this one
                mu = momentum_at(t, momentum=group["momentum"], start_momentum=group["start_momentum"],
                                 warmup_steps=group["warmup_steps"])
                buf = state.get("momentum_buffer")
                if buf is None:
                    # Named as SGD's, so the poison guard's direction rule reads it (docs/outer.md).
                    buf = state["momentum_buffer"] = p.grad.detach().clone()
                else:
                    buf.mul_(mu).add_(p.grad)
                p.add_(p.grad.add(buf, alpha=mu), alpha=-group["lr"])
                state["step"] = t + 1  # a plain int: the checkpoint keeps it in its JSON metadata
        return loss


def make(params: list[torch.Tensor], **settings: Any) -> PierWarmupSGD:
    """The outer optimizer of one fragment: :class:`PierWarmupSGD` over `params` with the module's defaults,
    any of them replaced by `settings` (``lr``, ``momentum``, ``start_momentum``, ``warmup_steps``)."""
    return PierWarmupSGD(params, **settings)
