"""A torch optimizer as a fragment's outer step (policies/torch_outer_optimizer.py).

torch's own Nesterov SGD as a plug-in is the built-in step bitwise over full rounds; Adam steps with its lr times
the round's share, checked against Adam written out by hand; the round is stepped once every tensor is given,
averaged tensors (trained buffers) are left to their mean; the state round-trips; a bad factory is one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from policies.outer_optimizer import FragmentOuterOptimizer
from policies.torch_outer_optimizer import TorchOuterOptimizer

SHAPES = [(5, 3), (7,), (2, 2, 2)]


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(rounds: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * 0.1 for s in SHAPES] for _ in range(rounds)]


def _by_tensor(opt, grads, scale=1.0, clock=False) -> None:
    """As orchestrator/core/round_merge.py steps a round: tensor by tensor, each in a workspace reused after."""
    work = torch.empty(64)
    for i, g in enumerate(grads):
        w = work[: g.numel()].view(g.shape)
        w.copy_(g)
        opt.step_tensor(i, w, scale=scale, clock=clock)
        w.fill_(float("nan"))  # the caller reuses its workspace: the optimizer must have copied it


def test_torch_nesterov_sgd_as_a_plugin_is_the_builtin_step_bitwise_over_full_rounds():
    builtin_params, plugin_params = _params(), _params()
    builtin = FragmentOuterOptimizer(builtin_params, lr=0.7, momentum=0.9, nesterov=True)
    plugin = TorchOuterOptimizer(plugin_params, lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True),
                                 name="sgd")
    for grads in _grads(6):
        builtin.step([g.clone() for g in grads])
        _by_tensor(plugin, grads)
    for a, b in zip(builtin_params, plugin_params):
        assert torch.equal(a, b)
    for a, b in zip(builtin.momentum_buffers(), plugin.momentum_buffers()):
        assert a is not None and b is not None and torch.equal(a, b)


def _reference_adam(params, rounds, scales, lr, betas=(0.9, 0.99), eps=1e-8):
    """Adam written out from its definition (Kingma and Ba, with torch's eps placement), lr times each round's share."""
    b1, b2 = betas
    p = [x.double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, (grads, s) in enumerate(zip(rounds, scales), start=1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p[i] = p[i] - (s * lr) * m_hat / (v_hat.sqrt() + eps)
    return p, m


def test_adam_as_a_plugin_steps_with_its_lr_times_the_rounds_share():
    params = _params()
    start = [p.clone() for p in params]
    rounds, scales = _grads(8), [1.0, 0.25, 0.5, 1.0, 0.25, 0.25, 1.0, 0.5]
    opt = TorchOuterOptimizer(params, lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.9, 0.99)), name="adam")
    for grads, s in zip(rounds, scales):
        _by_tensor(opt, grads, scale=s, clock=True)  # clock means nothing more to a plug-in
    want, first_moment = _reference_adam(start, rounds, scales, lr=0.05)
    for got, ref in zip(params, want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert all(g["lr"] == 0.05 for g in opt.optimizer.param_groups), "the share's lr must not stay"
    # The poison guard reads Adam's first moment as the fragment's momentum.
    for got, ref in zip(opt.momentum_buffers(), first_moment):
        assert got is not None
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-7)
    # A partial share does move less than the full one would.
    full = TorchOuterOptimizer([p.clone() for p in start], lambda p: torch.optim.Adam(p, lr=0.05), name="adam")
    part = TorchOuterOptimizer([p.clone() for p in start], lambda p: torch.optim.Adam(p, lr=0.05), name="adam")
    full.step(rounds[0])
    part.step(rounds[0], scale=0.25)
    moved = [torch.linalg.vector_norm(o.params[0] - start[0]).item() for o in (full, part)]
    assert math.isclose(moved[1], 0.25 * moved[0], rel_tol=1e-4)


def test_the_torch_step_runs_once_every_tensor_is_given_and_averaged_tensors_keep_their_mean():
    params = _params()
    calls = []

    class Counting(torch.optim.SGD):
        def step(self, closure=None):
            calls.append([p.grad is not None for p in params])
            return super().step(closure)

    opt = TorchOuterOptimizer(params, lambda p: Counting(p, lr=1.0, momentum=0.9, weight_decay=0.1), name="counting")
    grads = _grads(1)[0]
    before = [p.clone() for p in params]
    opt.step_tensor(2, grads[2].clone())
    opt.average_step_tensor(1, grads[1])  # a trained buffer: its mean, no lr, no momentum, no weight decay
    assert calls == []
    opt.step_tensor(0, grads[0].clone())
    assert calls == [[True, False, True]]
    assert torch.equal(params[1], before[1] - grads[1])
    assert opt.momentum_buffers()[1] is None
    # The final flush averages every tensor: no torch step at all.
    opt.average_step(grads)
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="given twice in one round"):
        opt.step_tensor(0, grads[0].clone())
        opt.step_tensor(0, grads[0].clone())


def test_a_round_with_two_scales_is_refused():
    opt = TorchOuterOptimizer(_params(), lambda p: torch.optim.SGD(p, lr=1.0), name="sgd")
    grads = _grads(1)[0]
    opt.step_tensor(0, grads[0].clone(), scale=0.5)
    with pytest.raises(RuntimeError, match="one scale"):
        opt.step_tensor(1, grads[1].clone(), scale=1.0)
    with pytest.raises(ValueError, match=r"scale=0.0 must be in \(0, 1\]"):
        opt.step_tensor(1, grads[1].clone(), scale=0.0)


def test_the_state_round_trips_and_the_next_step_is_the_same_bitwise():
    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    a = TorchOuterOptimizer(_params(), make, name="adam")
    assert a.state_dict() == {} and a.momentum_buffers() == [None] * len(SHAPES)  # nothing built yet
    rounds = _grads(4)
    for grads in rounds[:3]:
        a.step(grads, scale=0.5)
    b = TorchOuterOptimizer([p.clone() for p in a.params], make, name="adam")
    b.load_state_dict(a.state_dict())
    a.step(rounds[3])
    b.step(rounds[3])
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params))
    other = TorchOuterOptimizer(_params(), lambda p: torch.optim.SGD(p, lr=1.0), name="sgd")
    with pytest.raises(ValueError, match="is a Adam's, and 'sgd' builds a SGD"):
        other.load_state_dict(a.state_dict())


@pytest.mark.parametrize("factory, message", [
    (lambda p: None, "returned a NoneType, not a torch.optim.Optimizer"),
    (lambda p: torch.optim.SGD(p[:1], lr=1.0), "holds 1 tensors, not the 3 parameters"),
    (lambda p: torch.optim.SGD([torch.zeros(3)] + p[1:], lr=1.0), "holds 3 tensors, not the 3 parameters"),
    (lambda p: 1 / 0, "raised ZeroDivisionError: division by zero"),
])
def test_a_bad_factory_is_one_line_naming_it(factory, message):
    opt = TorchOuterOptimizer(_params(), factory, name="mine:make")
    with pytest.raises(ValueError) as err:
        opt.build()
    text = str(err.value)
    assert "'mine:make'" in text and message in text and "\n" not in text, text
