"""The worked outer optimizer examples/extending/pier_warmup.py: its schedule and two steps against numbers worked
out by hand, torch's Nesterov SGD when it does not warm up, a state_dict that resumes the ramp where it stopped,
and the config's import path building it and training through the real outer optimizer core (no Ray)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from examples.extending.pier_warmup import PierWarmupSGD, make, momentum_at
from orchestrator.config import ConfigError, load_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.run.workload import _check_outer_optimizer
from policies.fragments import plan_fragments
from tests.engine.nano import feed_rounds
from tests.from_config import outer_from_config

PATH = "examples.extending.pier_warmup:make"


def _stepped(opt: torch.optim.Optimizer, p: torch.Tensor, grads: list[list[float]]) -> list[list[float]]:
    """`p` after each step of `opt` with each of `grads` as its gradient."""
    out = []
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
        out.append(p.tolist())
    return out


def test_the_momentum_ramps_linearly_then_holds():
    # By hand: 0.5 + 0.4 * t / 4 for t = 0..4, then 0.9.
    ramp = [momentum_at(t, momentum=0.9, start_momentum=0.5, warmup_steps=4) for t in range(7)]
    assert ramp == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9], abs=1e-15)
    assert momentum_at(0, momentum=0.9, start_momentum=0.0, warmup_steps=0) == 0.9, "0 steps: no warm-up"


def test_two_steps_against_a_hand_computation():
    p = torch.tensor([1.0, -2.0])
    opt = PierWarmupSGD([p], lr=0.5, momentum=0.8, start_momentum=0.0, warmup_steps=2)
    # Step 0, mu 0: buf = g0 = [0.5, 0.25]; p -= 0.5 * g0 -> [0.75, -2.125].
    # Step 1, mu 0.4: buf = 0.4 * [0.5, 0.25] + [0.1, -0.3] = [0.3, -0.2];
    #   p -= 0.5 * (g1 + 0.4 * buf) = 0.5 * [0.22, -0.38] -> [0.64, -1.935].
    # Step 2, mu 0.8 (warmed up): buf = 0.8 * [0.3, -0.2] + [0, 0] = [0.24, -0.16];
    #   p -= 0.5 * 0.8 * buf = [0.096, -0.064] -> [0.544, -1.871].
    after = _stepped(opt, p, [[0.5, 0.25], [0.1, -0.3], [0.0, 0.0]])
    assert after == [pytest.approx(x, abs=1e-6) for x in ([0.75, -2.125], [0.64, -1.935], [0.544, -1.871])]
    assert opt.state[p]["step"] == 3
    assert opt.state[p]["momentum_buffer"].tolist() == pytest.approx([0.24, -0.16], abs=1e-6)


def test_without_a_warm_up_it_is_torchs_nesterov_sgd_bitwise():
    grads = [[0.5, -0.25, 1.0], [0.125, 0.75, -0.5], [-1.0, 0.5, 0.25], [0.3, 0.1, -0.2]]
    a, b = torch.tensor([1.0, 2.0, -3.0]), torch.tensor([1.0, 2.0, -3.0])
    ours = _stepped(PierWarmupSGD([a], lr=0.7, momentum=0.9, start_momentum=0.9), a, grads)
    torchs = _stepped(torch.optim.SGD([b], lr=0.7, momentum=0.9, nesterov=True), b, grads)
    assert ours == torchs


def test_a_state_dict_resumes_the_ramp_where_it_stopped():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, generator=gen).tolist() for _ in range(6)]
    p = torch.zeros(5)
    opt = make([p], warmup_steps=4)
    _stepped(opt, p, grads[:2])
    saved = opt.state_dict()
    assert saved["state"][0]["step"] == 2 and saved["param_groups"][0]["warmup_steps"] == 4
    q = p.clone()
    resumed = make([q], warmup_steps=100)  # the checkpoint's schedule wins, as torch's hyperparameters do
    resumed.load_state_dict(copy.deepcopy(saved))  # torch's state_dict() shares the live buffers: copy, as a checkpoint does
    assert _stepped(resumed, q, grads[2:]) == _stepped(opt, p, grads[2:])
    assert resumed.state[q]["step"] == 6


@pytest.mark.parametrize("settings, message", [
    ({"lr": 0.0}, "lr must be > 0"),
    ({"momentum": 1.0}, "momentum must be in [0, 1)"),
    ({"start_momentum": 0.95}, "start_momentum must be in [0, momentum=0.9]"),
    ({"warmup_steps": 2.5}, "warmup_steps must be an int >= 0"),
])
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(ValueError) as err:
        make([torch.zeros(2)], **settings)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- through the engine: the config's import path, the outer optimizer core, its checkpoint --------------------


def _core(optimizer=PATH, islands: int = 3) -> OuterOptimizer:
    """A core over two fragments with `islands` registered and full rounds (K = every island); `optimizer` an import path
    (through the config) or a callable (as the API passes one)."""
    init = {"a": torch.linspace(-1, 1, 24).reshape(6, 4), "b": torch.linspace(0, 1, 8), "c": torch.ones(3, 3)}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    outer: dict = {}
    kwargs: dict = {"min_quorum": islands}
    if isinstance(optimizer, str):
        outer["optimizer"] = optimizer
    else:
        kwargs["optimizer"] = optimizer
    core = OuterOptimizer(init, plan, settings=outer_from_config({"outer": outer}, grace_gamma=0.0, **kwargs))
    for island in range(islands):
        core.register(island, 1)
    return core


def test_the_config_path_builds_it_and_it_trains_through_the_core():
    cfg = load_config(None, [f"outer.optimizer={PATH}"])
    assert cfg.outer.optimizer == PATH
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    _check_outer_optimizer(cfg, None, model)  # the preflight `diloco train` runs before Ray: passes
    core = _core()
    feed_rounds(core, rounds=3)
    assert core.versions == [3, 3]
    for opt in core._opts:
        built = opt.optimizer
        assert isinstance(built, PierWarmupSGD)
        # Each fragment counts its own steps: three rounds each, so the next step's momentum is 0.9 * 3 / 8.
        assert {built.state[p]["step"] for p in opt.params} == {3}
    assert all(b is not None for opt in core._opts for b in opt.momentum_buffers()), "the poison guard's direction"


def test_the_warm_up_changes_the_run_and_none_is_the_builtin():
    builtin, flat, warm = _core(None), _core(functools.partial(make, start_momentum=0.9)), _core()
    for core in (builtin, flat, warm):
        feed_rounds(core, rounds=3)
    a, b, c = builtin.global_parameters(), flat.global_parameters(), warm.global_parameters()
    assert all(torch.equal(a[n], b[n]) for n in a), "no warm-up: the built-in outer step, bitwise"
    assert all(not torch.allclose(a[n], c[n]) for n in a), "a warm-up moves every tensor less far in its first rounds"


def test_a_checkpoint_through_the_store_gives_the_same_next_rounds(tmp_path):
    core = _core()
    feed_rounds(core, rounds=2)
    tensors, meta = core.state_dict()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(1, tensors, {"outer": meta})
    saved = store.load_latest()
    assert saved is not None
    fresh = _core()
    fresh.load_state_dict(saved.tensors, saved.meta["outer"])
    assert {fresh._opts[0].optimizer.state[p]["step"] for p in fresh._opts[0].params} == {2}, "the count came back"
    feed_rounds(core, rounds=3, seed=7, start=2)
    feed_rounds(fresh, rounds=3, seed=7, start=2)
    a, b = core.global_parameters(), fresh.global_parameters()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_builtins_settings_beside_it_are_refused():
    with pytest.raises(ConfigError, match="outer.momentum=0.5 has no effect") as err:
        load_config(None, [f"outer.optimizer={PATH}", "outer.momentum=0.5"])
    assert "\n" not in str(err.value)
