"""Start-up cuts that need no Ray: the CLI loads one command's module, checkpoint 0 imports no torch._dynamo,
the outer optimizer's lazily built SGD keeps its momentum round trip."""

from __future__ import annotations

import subprocess
import sys

import torch

from orchestrator.cli.main import COMMANDS, build_parser
from policies.outer_optimizer import FragmentOuterOptimizer


def _commands(parser) -> set[str]:
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def test_every_command_is_in_the_table_and_alone_loads_only_its_module():
    assert _commands(build_parser()) == set(COMMANDS)
    assert _commands(build_parser("train")) == {"train"}
    assert _commands(build_parser("--help")) == set(COMMANDS)


def test_diloco_train_parses_without_importing_torch_or_ray():
    code = ("import sys; from orchestrator.cli.main import build_parser; build_parser('train').parse_args(['train']); "
            "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_checkpoint_zero_does_not_import_dynamo(tmp_path):
    # torch's own optimizers import torch._dynamo when built (~1.1 s of CPU; policies/torch_optimizers avoids it);
    # the driver only writes a fresh optimizer's state, so it pays neither.
    code = f"""
import sys
from orchestrator.config import load_config
from orchestrator.run.setup import save_checkpoint_zero
from islands.model import build_model
from policies.fragments import plan_fragments
cfg = load_config(None, ["model.preset=nano"])
initial = {{n: p.detach().clone() for n, p in build_model(cfg.model.shape(), seed=0).named_parameters()}}
plan = plan_fragments([(n, t.numel() * 4) for n, t in initial.items()], 2)
save_checkpoint_zero(cfg, initial, plan, {str(tmp_path)!r})
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr
    assert any(tmp_path.iterdir()), "checkpoint 0 was written"


def test_lazy_outer_sgd_reports_and_restores_momentum_like_torch():
    params = [torch.zeros(3), torch.zeros(2, 2)]
    opt = FragmentOuterOptimizer(params, lr=0.5, momentum=0.9)
    assert opt.momentum_buffers() == [None, None]
    opt.load_momentum([None, None])  # nothing to restore: still nothing built
    assert opt._built is None
    opt.step([torch.ones(3), torch.full((2, 2), 2.0)])
    bufs = opt.momentum_buffers()
    torch_state = opt.state_dict()["sgd"]["state"]
    assert all(torch.equal(b, torch_state[i]["momentum_buffer"]) for i, b in enumerate(bufs))

    other = FragmentOuterOptimizer([p.clone() for p in params], lr=0.5, momentum=0.9)
    other.load_momentum(bufs)
    assert all(torch.equal(a, b) for a, b in zip(other.momentum_buffers(), bufs))
    bufs[0].add_(1.0)  # a copy was loaded, not the caller's tensor
    assert not torch.equal(other.momentum_buffers()[0], bufs[0])
