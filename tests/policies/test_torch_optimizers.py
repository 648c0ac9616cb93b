"""policies/torch_optimizers: torch's AdamW and SGD, bitwise, without importing torch._dynamo."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from policies.torch_optimizers import SGD, AdamW

ROOT = Path(__file__).resolve().parents[2]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 2, 4))]


def _run(make, steps: int = 6) -> tuple[list[torch.Tensor], dict]:
    """`steps` steps of make(params) on fixed pseudo-gradients, lr halved half way; (params, state_dict)."""
    params = _params(0)
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if i == steps // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


@pytest.mark.parametrize("kwargs", [dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)),
                                    dict(lr=1e-2, weight_decay=0.0, amsgrad=True),
                                    dict(lr=1e-2, foreach=False)])
def test_adamw_steps_bitwise_as_torch(kwargs):
    ours, ours_state = _run(lambda ps: AdamW(ps, **kwargs))
    ref, ref_state = _run(lambda ps: torch.optim.AdamW(ps, **kwargs))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    assert ours_state["param_groups"] == ref_state["param_groups"]
    for k, state in ref_state["state"].items():
        for name, value in state.items():
            assert torch.equal(ours_state["state"][k][name], value), (k, name)


@pytest.mark.parametrize("kwargs", [dict(lr=0.7, momentum=0.9, nesterov=True), dict(lr=0.1)])
def test_sgd_steps_bitwise_as_torch(kwargs):
    ours, _ = _run(lambda ps: SGD(ps, **kwargs))
    ref, _ = _run(lambda ps: torch.optim.SGD(ps, **kwargs))
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_state_dict_round_trip_and_hooks():
    params, state = _run(lambda ps: AdamW(ps, lr=1e-2))
    fresh = AdamW([torch.nn.Parameter(p.clone()) for p in params], lr=5.0)
    seen = []
    fresh.register_load_state_dict_post_hook(lambda opt: seen.append("load"))
    fresh.register_step_post_hook(lambda opt, args, kwargs: seen.append("step"))
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == pytest.approx(5e-3)  # the loaded schedule, not the constructor's
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    fresh.step()
    assert seen == ["load", "step"]  # torch's hooks still run: only the compiler wrapper is skipped


def test_step_runs_without_grad_and_returns_the_closure_loss():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        assert torch.is_grad_enabled()  # torch runs the closure with grad on
        return loss

    assert opt.step(closure).item() == pytest.approx(3.0)
    assert torch.is_grad_enabled()  # restored after the step


def test_a_fresh_process_never_imports_the_compiler():
    """The engine's paths that build and step optimizers: an island's InnerTrainer (model, AdamW, clip, a step,
    zero_grad, state_dict round trip) and the outer optimizer's SGD; torch._dynamo stays unimported."""
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        from orchestrator.config import RunConfig
        from orchestrator.settings import inner_settings, model_recipe
        from islands.trainer import InnerTrainer
        from policies.outer_optimizer import FragmentOuterOptimizer
        import torch
        cfg = RunConfig.model_validate({"model": {"preset": "nano"}})
        data = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.int64)
        tr = InnerTrainer(model_recipe(cfg), data, settings=inner_settings(cfg), shard_index=0, num_shards=2, seed=0)
        tr.step(); tr.step()
        tr.optimizer.load_state_dict(tr.optimizer.state_dict())
        outer = FragmentOuterOptimizer([torch.zeros(4)], lr=0.7, momentum=0.9, nesterov=True)
        outer.build()
        outer.step([torch.ones(4)])
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch._dynamo"))))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_torch_compile_still_traces_a_step():
    """Under torch.compile the wrapped torch methods run (the compiler sees its own markers): same result."""
    p_ours, p_ref = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    ours, ref = SGD([p_ours], lr=0.5, momentum=0.9), torch.optim.SGD([p_ref], lr=0.5, momentum=0.9)
    for p in (p_ours, p_ref):
        p.grad = torch.full((4,), 0.25)

    @torch.compile(backend="eager")
    def step(opt):
        opt.step()

    step(ours)
    ref.step()
    assert torch.equal(p_ours, p_ref)
