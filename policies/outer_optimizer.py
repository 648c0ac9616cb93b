"""The outer step of one fragment: SGD with Nesterov momentum (docs/architecture.md section 3, step 6).

``torch.optim.SGD`` holds the hyperparameters and momentum buffers, as torchft's ``local_sgd.py`` uses it;
the arithmetic is torch's single-tensor SGD step written out operation for operation, so that it runs in
place of a gradient buffer the caller owns, tensor by tensor (the outer optimizer merges and steps each
tensor while it is in cache) instead of through ``p.grad`` copies; a test pins it bitwise to torch's step.
A partial round under the ``clock`` step scale (:meth:`FragmentOuterOptimizer.step`) has its own formula,
pinned to torch's step at share 1. One instance per fragment owns that fragment's global parameters."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from policies.torch_optimizers import SGD

__all__ = ["FragmentOuterOptimizer", "STEP_SCALES", "is_clock_rule", "round_step_scale"]

STEP_SCALES = ("participation", "clock", "none")


def round_step_scale(rule: str, *, participants: int, live_islands: int) -> float:
    """The factor a round's merged outer gradient is multiplied by before the Nesterov step.

    ``participation`` and ``clock``: ``min(1, participants / live_islands)``, the round's share of a
    full round. With K = 1 a fragment gets about one round per island per H steps, each merging about one
    island; unscaled, those rounds add up to M times the step that synchronous DiLoCo takes once
    per H steps from the average of the same M deltas (and Nesterov amplifies the excess by up to
    1 / (1 - momentum)). Scaled, the rounds of one H add up to the synchronous step in expectation.
    A round with every live island (K = all) gets 1, so the degenerate settings of docs/architecture.md
    section 3 are unchanged. ``none``: always 1 (the paper's plain rule).

    The two scaled rules differ in what the factor scales (:meth:`FragmentOuterOptimizer.step`):
    ``participation`` scales the gradient a round feeds into the momentum buffer, and every round
    still decays the buffer by ``momentum``, so the buffer's memory is about 1 / (1 - momentum)
    *rounds*: with K = 1 that is M times fewer inner steps than with K = all, and the buffer builds to
    its full amplification M times sooner. ``clock`` treats the round as a fraction ``s`` of a full
    round in time as well: the buffer decays by ``momentum ** s`` and the parameters move ``s`` times
    a full round's step, so 1 / s rounds of share ``s`` behave like one full round, momentum
    included (see :meth:`FragmentOuterOptimizer.step`).

    Args:
        rule: one of :data:`STEP_SCALES`.
        participants: distinct islands merged in the round, ``>= 1``.
        live_islands: islands the outer optimizer counts as live, ``>= 1``.
    """
    _check_rule(rule)
    if participants < 1 or live_islands < 1:
        raise ValueError(f"participants={participants} and live_islands={live_islands} must both be >= 1")
    if rule == "none":
        return 1.0
    return min(1.0, participants / live_islands)


def is_clock_rule(rule: str) -> bool:
    """Whether a round's step scale also scales its momentum decay and displacement (the ``clock`` rule)."""
    _check_rule(rule)
    return rule == "clock"


def _check_rule(rule: str) -> None:
    if rule not in STEP_SCALES:
        raise ValueError(f"step scale {rule!r} is unknown; use one of {', '.join(STEP_SCALES)}")


class FragmentOuterOptimizer:
    """Nesterov SGD over the global parameters of one fragment, updated in place.

    Given the merged outer gradient ``g`` (global minus local parameters, so a descent direction),
    each :meth:`step` applies, per tensor, with ``buf`` starting at 0:

    - ``buf = momentum * buf + g``
    - with Nesterov: ``p -= lr * (g + momentum * buf)``
    - without (or ``momentum == 0``): ``p -= lr * buf``

    ``lr=1, momentum=0`` gives ``p -= g``, i.e. FedAvg when ``g`` is the mean delta.

    Args:
        params: the fragment's global parameters, float32 leaf tensors. They are updated in
            place and stay the caller's tensors; ``requires_grad`` may be False.
        lr: outer learning rate, ``> 0``.
        momentum: ``0 <= momentum < 1``.
        nesterov: use Nesterov momentum (ignored when ``momentum == 0``).
        partial_momentum: momentum of the clock rule's partial rounds (``step(clock=True)`` with
            ``scale < 1``), ``0 <= partial_momentum < 1``, capped at the momentum in effect (after
            :meth:`load_state_dict`, the loaded one); ``None`` = ``momentum``.
            A partial round merges some islands' outer gradients measured from versions that others
            have since moved; such stale updates carry a momentum of their own (asynchronous SGD
            behaves like momentum SGD: Mitliagkas et al. 2016, arXiv:1605.09774), so explicit momentum
            on top of it overshoots. Full rounds keep ``momentum``.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        partial_momentum: float | None = None,
    ) -> None:
        if math.isnan(lr) or lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}; the outer default is 0.7")
        if math.isnan(momentum) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}; the outer default is 0.9")
        if partial_momentum is not None and (math.isnan(partial_momentum) or not 0.0 <= partial_momentum < 1.0):
            raise ValueError(f"partial_momentum must be in [0, 1) or None (= momentum), got {partial_momentum}")
        params = list(params)
        if not params:
            raise ValueError("FragmentOuterOptimizer got no params; pass the fragment's tensors")
        for i, p in enumerate(params):
            if p.dtype != torch.float32:
                raise ValueError(
                    f"params[{i}] has dtype {p.dtype}, must be torch.float32; keep global parameters in float32"
                )
            if not p.is_leaf:
                raise ValueError(f"params[{i}] is not a leaf tensor; pass p.detach() so it can be updated in place")
        self._params = params
        self._lr, self._momentum, self._nesterov = lr, momentum, nesterov and momentum > 0
        # Built on first use (a process that only writes a fresh optimizer's checkpoint, the driver's checkpoint
        # 0, never needs it). policies/torch_optimizers.SGD: torch's SGD without its compiler import (~1.1 s of CPU).
        self._built: torch.optim.SGD | None = None
        # Kept as asked and capped at step time: load_state_dict may bring another momentum.
        self._partial_momentum = partial_momentum

    def build(self) -> None:
        """Build the torch optimizer now rather than at the first step: the outer optimizer's actor calls this at
        start, so whatever the build costs (little since policies/torch_optimizers; torch.optim.SGD imported the
        compiler, ~1.1 s of CPU) never delays a round, which with K = 1 would let a backlog of submissions close
        rounds in a burst and leave a waiting submission too stale."""
        _ = self._sgd

    @property
    def _sgd(self) -> torch.optim.SGD:
        if self._built is None:
            # torch accepts leaves with requires_grad=False; the step runs under no_grad either way.
            self._built = SGD(self._params, lr=self._lr, momentum=self._momentum, nesterov=self._nesterov)
        return self._built

    @property
    def params(self) -> list[Tensor]:
        """The parameters this optimizer updates, the very tensors passed in."""
        return list(self._params)

    def step(self, outer_grad: Sequence[Tensor], *, scale: float = 1.0, clock: bool = False) -> None:
        """Apply one outer step with ``scale * outer_grad[i]`` as the gradient of ``params[i]``.

        ``scale`` in (0, 1] is the round's share of a full round (:func:`round_step_scale`). By
        default it scales the gradient that enters the momentum buffer, not the buffer already there.

        With ``clock=True`` the round counts as ``scale`` of a full round in time (momentum ``mu``,
        ``s = scale``, ``g`` the merged outer gradient), per tensor::

            buf = mu**s * buf + (1 - mu**s) / (1 - mu) * g
            p  -= s * lr * (g + mu * buf)          # Nesterov; without it: p -= s * lr * buf

        The buffer's weight on ``g`` makes it, at every full round's worth of time, what the plain
        rule's buffer would be after that many full rounds of the same ``g``: its memory decays per
        unit of round time, not per round. The Nesterov look-ahead stays one full round (``mu``), so
        under a steady ``g`` the parameters move as far per unit of time as with full rounds. ``s = 1``
        is exactly the plain step (torch's SGD), and with ``mu = 0`` it is ``p -= s * lr * g``, the
        same as the default. For ``s < 1``, ``mu`` is the constructor's ``partial_momentum`` capped at the
        momentum in effect (default: that momentum); the buffer is the one full rounds use.

        The caller's tensors are never written to; :meth:`step_tensor` steps one tensor in place of its gradient.
        """
        self._check_scale(scale)
        outer_grad = list(outer_grad)
        if len(outer_grad) != len(self._params):
            raise ValueError(
                f"outer_grad has {len(outer_grad)} tensors but the fragment has {len(self._params)}; "
                "pass one gradient per parameter, in order"
            )
        for i, (p, g) in enumerate(zip(self._params, outer_grad)):
            if g.shape != p.shape:
                raise ValueError(
                    f"outer_grad[{i}] has shape {tuple(g.shape)} but params[{i}] has {tuple(p.shape)}; "
                    "merge the same fragment the optimizer owns"
                )
        for i, (p, g) in enumerate(zip(self._params, outer_grad)):
            # A private float32 copy, as torch's SGD got one through p.grad: the step works in it.
            self._step_one(i, g.detach().to(device=p.device, dtype=torch.float32, copy=True), scale, clock)

    def step_tensor(self, i: int, grad: Tensor, *, scale: float = 1.0, clock: bool = False) -> None:
        """:meth:`step` for ``params[i]`` alone, using `grad` (contiguous float32, the parameter's shape) as
        its workspace: `grad` is overwritten. Stepping every tensor of a fragment this way, in any order, is
        bitwise :meth:`step` (each tensor's update reads only its own gradient, buffer and parameter), without
        a copy of the gradient; the outer optimizer's round steps each tensor as soon as it is merged."""
        self._check_scale(scale)
        p = self._params[i]
        if grad.shape != p.shape or grad.dtype != torch.float32 or grad.device != p.device:
            raise ValueError(f"grad for params[{i}] must be float32 of shape {tuple(p.shape)} on {p.device}, got "
                             f"{grad.dtype} {tuple(grad.shape)} on {grad.device}; use step() for other gradients")
        self._step_one(i, grad, scale, clock)

    @staticmethod
    def _check_scale(scale: float) -> None:
        if not 0.0 < scale <= 1.0:
            raise ValueError(f"scale={scale} must be in (0, 1]; pass round_step_scale(...)")

    def _step_one(self, i: int, g: Tensor, scale: float, clock: bool) -> None:
        """One tensor's step, in place on `g` (float32, owned by this call). The plain step is torch's
        ``_single_tensor_sgd`` (torch 2.x, on CPU) operation for operation, so its rounding is torch's:
        ``buf.mul_(mu).add_(g)``, then ``g + mu * buf`` (Nesterov), then ``p.add_(., alpha=-lr)``; the first
        step starts the buffer as a copy of the gradient. tests/policies/test_outer_optimizer.py pins it
        bitwise to ``torch.optim.SGD``."""
        group = self._sgd.param_groups[0]
        if group["weight_decay"] != 0 or group["dampening"] != 0 or group["maximize"]:
            raise ValueError("the outer SGD state carries weight_decay, dampening or maximize; "
                             "load a state written by FragmentOuterOptimizer.state_dict()")
        lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        p = self._params[i]
        with torch.no_grad():
            if clock and scale != 1.0 and momentum > 0:
                self._clock_one(p, g, scale, lr, momentum, nesterov)
                return
            if scale != 1.0:
                g.mul_(scale)
            if momentum != 0:
                state = self._sgd.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.detach().clone()
                else:
                    buf.mul_(momentum).add_(g)
                if nesterov:
                    g.add_(buf, alpha=momentum)
                else:
                    g = buf
            p.add_(g, alpha=-lr)

    def _clock_one(self, p: Tensor, g: Tensor, s: float, lr: float, momentum: float, nesterov: bool) -> None:
        """The ``clock=True`` step of one tensor for ``0 < s < 1`` and ``momentum > 0`` (see :meth:`step`), in
        place on `g`. The buffers stay in torch's SGD state, so :meth:`state_dict` and later plain steps see them."""
        mu = momentum if self._partial_momentum is None else min(self._partial_momentum, momentum)
        decay = mu**s
        gain = (1.0 - decay) / (1.0 - mu)
        state = self._sgd.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:  # torch's first step starts the buffer at g, i.e. from zero with gain 1
            buf = torch.zeros_like(p)
        buf.mul_(decay).add_(g, alpha=gain)
        state["momentum_buffer"] = buf
        direction = g.add_(buf, alpha=mu) if nesterov else buf
        p.sub_(direction, alpha=s * lr)

    def _clock_step(self, outer_grad: list[Tensor], s: float) -> None:
        """The ``clock=True`` step for ``0 < s < 1`` of a whole fragment, on private copies of `outer_grad`."""
        group = self._sgd.param_groups[0]
        with torch.no_grad():
            for p, g in zip(self._params, outer_grad):
                g = g.detach().to(device=p.device, dtype=torch.float32, copy=True)
                self._clock_one(p, g, s, group["lr"], group["momentum"], group["nesterov"])

    def average_step(self, outer_grad: Sequence[Tensor]) -> None:
        """``params -= outer_grad``: move to the merged islands' position (their weighted mean), without lr or momentum.

        The last step of a run (the final flush): with the islands stopped there is no next round
        for momentum to accelerate, so one more Nesterov step would only overshoot by lr * mu^2 * buf.
        The momentum buffers are left as they are (a resumed run continues from them).
        """
        outer_grad = list(outer_grad)
        if len(outer_grad) != len(self._params) or any(g.shape != p.shape for p, g in zip(self._params, outer_grad)):
            raise ValueError("outer_grad must have one tensor per parameter of the fragment, same shapes, in order")
        with torch.no_grad():
            for p, g in zip(self._params, outer_grad):
                p.sub_(g.to(device=p.device, dtype=p.dtype))

    def average_step_tensor(self, i: int, grad: Tensor) -> None:
        """:meth:`average_step` for ``params[i]`` alone (`grad` is read, not written)."""
        p = self._params[i]
        if grad.shape != p.shape:
            raise ValueError(f"grad for params[{i}] has shape {tuple(grad.shape)}, the parameter {tuple(p.shape)}")
        with torch.no_grad():
            p.sub_(grad.to(device=p.device, dtype=p.dtype))

    def state_dict(self) -> dict[str, Any]:
        """Momentum buffers and hyperparameters, deep-copied so later steps do not alter it."""
        return {"sgd": copy.deepcopy(self._sgd.state_dict())}

    def momentum_buffers(self) -> list[Tensor | None]:
        """Each parameter's momentum buffer (None before its first step), not copied; builds nothing new."""
        if self._built is None:
            return [None] * len(self._params)
        return [self._built.state.get(p, {}).get("momentum_buffer") for p in self._params]

    def load_momentum(self, buffers: Sequence[Tensor | None]) -> None:
        """Set each parameter's momentum buffer to a copy of `buffers[i]` (None: no buffer, as before a first step)."""
        buffers = list(buffers)
        if len(buffers) != len(self._params):
            raise ValueError(f"got {len(buffers)} momentum buffers for {len(self._params)} parameters; pass one per parameter")
        if self._built is None and all(b is None for b in buffers):
            return  # torch's state of an optimizer not yet built is empty already
        sgd = self.state_dict()["sgd"]
        sgd["state"] = {i: {"momentum_buffer": b} for i, b in enumerate(buffers) if b is not None}
        self.load_state_dict({"sgd": sgd})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (hyperparameters included); parameters are not touched."""
        if "sgd" not in state_dict:
            raise ValueError(
                f"state_dict has keys {sorted(state_dict)}, expected 'sgd'; "
                "pass what FragmentOuterOptimizer.state_dict() returned"
            )
        # Deep copy: torch would otherwise alias the caller's buffers and mutate them on step().
        self._sgd.load_state_dict(copy.deepcopy(state_dict["sgd"]))
