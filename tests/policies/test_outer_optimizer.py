"""Outer optimizer: hand values, a manual Nesterov loop, FedAvg, and exact state round trips."""

import copy

import pytest
import torch

from policies.outer_optimizer import FragmentOuterOptimizer


def _reference(p0, grads, *, lr, momentum, nesterov):
    """Manual SGD-with-momentum loop in float64, written from the docstring's rule."""
    p = [x.double().clone() for x in p0]
    buf = [torch.zeros_like(x) for x in p]
    for g in grads:
        for i, gi in enumerate(g):
            gi = gi.double()
            buf[i] = momentum * buf[i] + gi
            p[i] -= lr * (gi + momentum * buf[i]) if nesterov else lr * buf[i]
    return p


def test_hand_computed_nesterov_and_heavy_ball():
    # Nesterov, lr .5, mu .5, g = 1 twice: buf 1 -> p = 1 - .5 * 1.5 = .25; buf 1.5 -> p = .25 - .5 * 1.75 = -.625
    p = torch.tensor([1.0])
    opt = FragmentOuterOptimizer([p], lr=0.5, momentum=0.5)
    opt.step([torch.tensor([1.0])])
    assert p.item() == 0.25
    opt.step([torch.tensor([1.0])])
    assert p.item() == -0.625
    # Heavy ball: p = 1 - .5 * 1 = .5; p = .5 - .5 * 1.5 = -.25
    q = torch.tensor([1.0])
    opt = FragmentOuterOptimizer([q], lr=0.5, momentum=0.5, nesterov=False)
    opt.step([torch.tensor([1.0])])
    opt.step([torch.tensor([1.0])])
    assert q.item() == -0.25


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_manual_loop(nesterov):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn_like(x) for x in params] for _ in range(6)]
    ref = _reference(params, grads, lr=0.7, momentum=0.9, nesterov=nesterov)
    opt = FragmentOuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=nesterov)
    for g in grads:
        opt.step(g)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_lr_one_momentum_zero_is_fedavg():
    gen = torch.Generator().manual_seed(1)
    global_params = torch.randn(10, generator=gen)
    locals_ = [global_params - 0.1 * torch.randn(10, generator=gen) for _ in range(3)]
    mean_delta = sum(global_params - x for x in locals_) / 3
    expected = global_params - mean_delta
    opt = FragmentOuterOptimizer([global_params], lr=1.0, momentum=0.0)
    opt.step([mean_delta])
    assert torch.equal(global_params, expected)  # bitwise: p - 1 * g
    torch.testing.assert_close(global_params, sum(locals_) / 3)  # parameter averaging


def test_updates_callers_tensors_in_place_without_requires_grad():
    p = torch.ones(3)
    assert not p.requires_grad
    opt = FragmentOuterOptimizer([p], lr=0.1, momentum=0.0)
    assert opt.params[0] is p
    opt.step([torch.ones(3)])
    assert p.tolist() == pytest.approx([0.9] * 3)
    assert p.grad is None


def test_leaf_with_requires_grad_and_grad_not_aliased():
    p = torch.zeros(2, requires_grad=True)
    g = torch.tensor([1.0, 2.0])
    opt = FragmentOuterOptimizer([p], lr=1.0, momentum=0.5)
    opt.step([g])
    opt.step([g])
    assert g.tolist() == [1.0, 2.0]  # the caller's gradient is never written to
    assert p.grad is None
    # buf: g then 1.5 g; p = -(1.5 g) - (g + 0.75 g) = -3.25 g
    assert p.detach().tolist() == pytest.approx([-3.25, -6.5])


def test_low_precision_gradient_is_upcast():
    p = torch.zeros(2)
    FragmentOuterOptimizer([p], lr=1.0, momentum=0.0).step([torch.tensor([0.5, -1.0], dtype=torch.bfloat16)])
    assert p.dtype == torch.float32 and p.tolist() == [-0.5, 1.0]


def test_state_dict_round_trip_continues_bitwise():
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(7, generator=gen), torch.randn(2, 2, generator=gen)]
    grads = [[torch.randn_like(x) for x in params] for _ in range(5)]
    a = FragmentOuterOptimizer(params, lr=0.7, momentum=0.9)
    for g in grads[:2]:
        a.step(g)
    saved = a.state_dict()
    restored = [x.clone() for x in params]
    no_state = [x.clone() for x in params]
    for g in grads[2:]:
        a.step(g)  # also proves stepping after state_dict() leaves `saved` alone
    b = FragmentOuterOptimizer(restored, lr=0.1, momentum=0.0)  # hyperparameters come from the state
    b.load_state_dict(saved)
    c = FragmentOuterOptimizer(no_state, lr=0.7, momentum=0.9)  # same settings, no momentum state
    for g in grads[2:]:
        b.step(g)
        c.step(g)
    for x, y, z in zip(params, restored, no_state):
        assert torch.equal(x, y)
        assert not torch.equal(x, z)  # the momentum buffers are what made the continuation exact


def test_loaded_state_is_not_aliased():
    p = torch.zeros(3)
    a = FragmentOuterOptimizer([p], lr=1.0, momentum=0.9)
    a.step([torch.ones(3)])
    saved = a.state_dict()
    before = saved["sgd"]["state"][0]["momentum_buffer"].clone()
    b = FragmentOuterOptimizer([torch.zeros(3)], lr=1.0, momentum=0.9)
    b.load_state_dict(saved)
    b.step([torch.ones(3)])
    assert torch.equal(saved["sgd"]["state"][0]["momentum_buffer"], before)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (dict(momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
        (dict(momentum=-0.1), r"momentum must be in \[0, 1\), got -0.1"),
    ],
)
def test_hyperparameter_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FragmentOuterOptimizer([torch.zeros(1)], **kwargs)


def test_param_and_grad_errors():
    with pytest.raises(ValueError, match="no params"):
        FragmentOuterOptimizer([])
    with pytest.raises(ValueError, match=r"params\[0\] has dtype torch.bfloat16"):
        FragmentOuterOptimizer([torch.zeros(1, dtype=torch.bfloat16)])
    opt = FragmentOuterOptimizer([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="outer_grad has 1 tensors but the fragment has 2"):
        opt.step([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"outer_grad\[1\] has shape \(4,\) but params\[1\] has \(3,\)"):
        opt.step([torch.zeros(2), torch.zeros(4)])
    with pytest.raises(ValueError, match="expected 'sgd'"):
        opt.load_state_dict({"state": {}})


def test_average_step_moves_to_the_merged_position_and_keeps_momentum():
    params = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    opt = FragmentOuterOptimizer(params, lr=0.7, momentum=0.9)
    opt.step([torch.tensor([0.5, 0.5]), torch.tensor([[1.0]])])  # builds a momentum buffer
    buffers = copy.deepcopy(opt.state_dict())
    before = [p.clone() for p in params]
    opt.average_step([torch.tensor([0.25, -0.5]), torch.tensor([[2.0]])])
    assert torch.equal(params[0], before[0] - torch.tensor([0.25, -0.5]))
    assert torch.equal(params[1], before[1] - torch.tensor([[2.0]]))
    after = opt.state_dict()["sgd"]["state"]
    assert all(torch.equal(after[k]["momentum_buffer"], v["momentum_buffer"]) for k, v in buffers["sgd"]["state"].items())
    with pytest.raises(ValueError, match="one tensor per parameter"):
        opt.average_step([torch.zeros(2)])


# ------------------------------------------------------------------ the round's step scale


def test_round_step_scale_is_the_share_of_a_full_round():
    from policies.outer_optimizer import round_step_scale

    assert round_step_scale("participation", participants=1, live_islands=4) == 0.25
    assert round_step_scale("participation", participants=3, live_islands=4) == 0.75
    assert round_step_scale("participation", participants=4, live_islands=4) == 1.0
    # More distinct islands than the registry counts (one just deregistered): never above 1.
    assert round_step_scale("participation", participants=5, live_islands=4) == 1.0
    assert round_step_scale("none", participants=1, live_islands=4) == 1.0
    with pytest.raises(ValueError, match="unknown"):
        round_step_scale("half", participants=1, live_islands=2)
    with pytest.raises(ValueError, match=">= 1"):
        round_step_scale("participation", participants=0, live_islands=2)


def test_scaled_step_matches_manual_loop_on_scaled_gradients():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 2, generator=gen)]
    grads = [[torch.randn_like(params[0])] for _ in range(5)]
    scales = [0.25, 1.0, 0.5, 0.25, 0.75]
    ref = _reference(params, [[g[0] * s] for g, s in zip(grads, scales)], lr=0.7, momentum=0.9, nesterov=True)
    opt = FragmentOuterOptimizer(params, lr=0.7, momentum=0.9)
    for g, s in zip(grads, scales):
        opt.step(g, scale=s)
    torch.testing.assert_close(params[0].double(), ref[0], rtol=1e-5, atol=1e-5)
    # The caller's gradient is not scaled in place.
    g = [torch.ones(3, 2)]
    opt.step(g, scale=0.5)
    assert torch.equal(g[0], torch.ones(3, 2))
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="scale"):
            opt.step(g, scale=bad)


# ------------------------------------------------------------------ the clock rule


def _clock_reference(p0, grads, scales, *, lr, momentum, nesterov, partial_momentum=None):
    """Manual float64 loop of the clock rule, written from the docstring of step(clock=True)."""
    p = [x.double().clone() for x in p0]
    buf = [torch.zeros_like(x) for x in p]
    for g, s in zip(grads, scales):
        mu = momentum if s == 1 or partial_momentum is None else partial_momentum
        decay = mu**s
        for i, gi in enumerate(g):
            gi = gi.double()
            buf[i] = decay * buf[i] + (1 - decay) / (1 - mu) * gi
            p[i] -= s * lr * ((gi + mu * buf[i]) if nesterov else buf[i])
    return p


def test_clock_rule_hand_values():
    # mu .81, s .5: decay .9, gain .1/.19; g = 1.9 -> buf 1.0, p = 1 - .5 * 1 * (1.9 + .81 * 1.0) = -0.355
    p = torch.tensor([1.0], dtype=torch.float32)
    opt = FragmentOuterOptimizer([p], lr=1.0, momentum=0.81)
    opt.step([torch.tensor([1.9])], scale=0.5, clock=True)
    assert p.item() == pytest.approx(-0.355, abs=1e-6)
    # A second share-.5 round with g = 0: buf .9, p = -0.355 - .5 * (0 + .81 * .9) = -0.7195
    opt.step([torch.tensor([0.0])], scale=0.5, clock=True)
    assert p.item() == pytest.approx(-0.7195, abs=1e-6)


@pytest.mark.parametrize("partial_momentum", [None, 0.7])  # None: partial rounds take the full rounds' 0.9
@pytest.mark.parametrize("nesterov", [True, False])
def test_clock_rule_matches_manual_loop_with_mixed_shares(nesterov, partial_momentum):
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn_like(x) for x in params] for _ in range(7)]
    scales = [0.25, 0.25, 1.0, 0.5, 0.75, 0.25, 1.0]  # full rounds go through torch's SGD, shares through ours
    ref = _clock_reference(params, grads, scales, lr=0.7, momentum=0.9, nesterov=nesterov, partial_momentum=partial_momentum)
    opt = FragmentOuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=nesterov, partial_momentum=partial_momentum)
    for g, s in zip(grads, scales):
        opt.step(g, scale=s, clock=True)
    for got, want in zip(params, ref):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_clock_rule_full_rounds_and_zero_momentum_are_the_default_step():
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(4)]
    for momentum, scale in ((0.9, 1.0), (0.0, 0.25)):
        a, b = p0.clone(), p0.clone()
        oa, ob = FragmentOuterOptimizer([a], momentum=momentum), FragmentOuterOptimizer([b], momentum=momentum)
        for g in grads:
            oa.step([g], scale=scale)
            ob.step([g], scale=scale, clock=True)
        assert torch.equal(a, b)


def test_clock_rule_shares_add_up_to_full_rounds_in_momentum_memory():
    # A constant outer gradient for 40 full rounds' worth of time: with the clock rule, 160 rounds of
    # share 1/4 end within 5% of 40 full rounds (the buffers agree exactly at every fourth round); with the participation rule the buffer forgets per
    # round, so the same 160 rounds build it to about twice as far (the K = 1 overshoot it fixes).
    g = torch.ones(1)

    def run(scale, rounds, clock):
        p = torch.zeros(1)
        opt = FragmentOuterOptimizer([p], lr=0.7, momentum=0.9)
        for _ in range(rounds):
            opt.step([g], scale=scale, clock=clock)
        return -p.item()

    full = run(1.0, 40, False)
    assert run(0.25, 160, True) == pytest.approx(full, rel=0.05)
    early_full, early_clock, early_part = run(1.0, 5, False), run(0.25, 20, True), run(0.25, 20, False)
    assert abs(early_clock - early_full) / early_full < 0.15
    assert early_part > 1.3 * early_clock  # the per-round memory builds momentum four times sooner


@pytest.mark.parametrize("nesterov", [True, False])
def test_clock_formula_at_share_one_is_torchs_step(nesterov):
    # step() hands full rounds to torch; the formula it uses for partial ones must reduce to torch's at s = 1.
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(5, generator=gen)
    grads = [torch.randn(5, generator=gen) for _ in range(4)]
    a, b = p0.clone(), p0.clone()
    oa, ob = FragmentOuterOptimizer([a], nesterov=nesterov), FragmentOuterOptimizer([b], nesterov=nesterov)
    for g in grads:
        oa.step([g])
        ob._clock_step([g], 1.0)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_clock_rule_buffers_survive_state_dict():
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4, generator=gen)
    b = a.clone()
    oa = FragmentOuterOptimizer([a])
    grads = [torch.randn(4, generator=gen) for _ in range(4)]
    oa.step([grads[0]], scale=0.25, clock=True)
    ob = FragmentOuterOptimizer([b])
    ob.load_state_dict(oa.state_dict())
    b.copy_(a)
    for g in grads[1:]:
        oa.step([g], scale=0.5, clock=True)
        ob.step([g], scale=0.5, clock=True)
    assert torch.equal(a, b)


def test_is_clock_rule():
    from policies.outer_optimizer import is_clock_rule

    assert is_clock_rule("clock") and not is_clock_rule("participation") and not is_clock_rule("none")
    with pytest.raises(ValueError, match="unknown"):
        is_clock_rule("Clock")


# ------------------------------------------------------------------ partial-round momentum


def test_partial_momentum_hand_values():
    # Partial mu .81 under full mu .9, s .5: decay .9, gain .1/.19; g = 1.9 -> buf 1.0, p = 1 - .5 (1.9 + .81) = -0.355
    p = torch.tensor([1.0], dtype=torch.float32)
    opt = FragmentOuterOptimizer([p], lr=1.0, momentum=0.9, partial_momentum=0.81)
    opt.step([torch.tensor([1.9])], scale=0.5, clock=True)
    assert p.item() == pytest.approx(-0.355, abs=1e-6)
    # A full round with g = 0 uses mu .9 on the same buffer: buf .9, p = -0.355 - (0 + .9 * .9) = -1.165
    opt.step([torch.tensor([0.0])], scale=1.0, clock=True)
    assert p.item() == pytest.approx(-1.165, abs=1e-6)


def test_partial_momentum_leaves_full_rounds_and_the_other_rules_alone():
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(4)]
    for scale, clock in ((1.0, True), (0.25, False)):  # full clock rounds; participation-scaled rounds
        a, b = p0.clone(), p0.clone()
        oa = FragmentOuterOptimizer([a], momentum=0.9)
        ob = FragmentOuterOptimizer([b], momentum=0.9, partial_momentum=0.5)
        for g in grads:
            oa.step([g], scale=scale, clock=clock)
            ob.step([g], scale=scale, clock=clock)
        assert torch.equal(a, b)


def test_partial_momentum_is_capped_at_momentum():
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(4)]
    for momentum in (0.0, 0.5):  # a partial momentum above the full one never adds momentum
        a, b = p0.clone(), p0.clone()
        oa = FragmentOuterOptimizer([a], momentum=momentum)
        ob = FragmentOuterOptimizer([b], momentum=momentum, partial_momentum=0.7)
        for g in grads:
            oa.step([g], scale=0.25, clock=True)
            ob.step([g], scale=0.25, clock=True)
        assert torch.equal(a, b)


def test_partial_momentum_cap_follows_a_loaded_momentum():
    # A state saved with momentum 0.5 loaded into an optimizer built with 0.9 (partial 0.7): the loaded
    # hyperparameters win, so partial rounds must be capped at 0.5 like an optimizer built with 0.5.
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(4)]
    a, b = p0.clone(), p0.clone()
    oa = FragmentOuterOptimizer([a], momentum=0.5, partial_momentum=0.7)
    ob = FragmentOuterOptimizer([b], momentum=0.9, partial_momentum=0.7)
    ob.load_state_dict(FragmentOuterOptimizer([p0.clone()], momentum=0.5).state_dict())
    for g in grads:
        oa.step([g], scale=0.25, clock=True)
        ob.step([g], scale=0.25, clock=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan")])
def test_partial_momentum_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="partial_momentum"):
        FragmentOuterOptimizer([torch.zeros(2)], partial_momentum=bad)
