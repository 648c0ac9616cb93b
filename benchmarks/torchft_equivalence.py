"""Does torchft's DiLoCo compute what our sync-diloco mode computes? Same inputs, losses per step compared.

Run before the side by side (benchmarks/torchft_side_by_side.py), so that it compares systems, not
algorithms. Both sides get one config in mode sync-diloco, network none, no faults, constant inner lr:

- torchft: `torchft_run.train_torchft` (its lighthouse, M replica-group processes, gloo, its DiLoCo with
  the run's outer lr and Nesterov momentum, P = 1);
- ours: the engine's own pieces in one process, stepped in the order the synchronous mode runs them: each
  island's `InnerTrainer` (islands/trainer.py) takes H steps on its shard, cuts its outer gradient
  `base - theta` as a `Submission` (uncompressed, as the mode sends), the engine's core `OuterOptimizer`
  (orchestrator/core/outer_optimizer.py, with the mode's settings: K = all, uniform weights, mean merge,
  Nesterov SGD) closes the round, and every island adopts the new version by overwrite. Ray, the actors and
  the network are left out: they move these tensors, they do not change them.

Compared: every island's training loss at every inner step, and the global parameters after the last outer
step. Prints one line per outer step and a verdict; exit status 1 if they differ beyond the tolerance.

  python benchmarks/torchft_equivalence.py                 # 2 replica groups, H = 5, 3 outer steps (~1 min)
  python benchmarks/torchft_equivalence.py --islands 4 --outer-steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torchft_run import train_torchft  # noqa: E402

from islands.messages import Submission  # noqa: E402
from islands.model_api import load_state_tensors, state_tensors  # noqa: E402
from islands.trainer import InnerTrainer  # noqa: E402
from orchestrator.config import RunConfig, build_config  # noqa: E402
from orchestrator.core.outer_optimizer import OuterOptimizer  # noqa: E402
from orchestrator.run.workload import prepare  # noqa: E402
from orchestrator.settings import inner_settings, outer_settings  # noqa: E402
from policies.compression import compress  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402

REGIONS = ("us-east", "us-central", "us-west", "us-south")


def equivalence_config(islands: int, sync_every: int, outer_steps: int, seed: int = 0) -> RunConfig:
    """Mode sync-diloco on `islands` one-island pools, network none, constant lr, budget of exactly `outer_steps` rounds."""
    batch, seq = 16, 128
    return build_config({
        "mode": "sync-diloco", "run": {"token_budget": islands * sync_every * outer_steps * batch * seq, "seed": seed},
        "model": {"preset": "tiny", "seq_len": seq}, "data": {"batch_size": batch},
        "outer": {"sync_every_steps": sync_every}, "inner": {"lr_schedule": "constant"},
        "eval": {"interval_s": 0.5, "batches": 4}, "network": {"scenario": "none"},
        "pools": [{"name": REGIONS[i % 4] + ("" if i < 4 else str(i)), "islands": 1, "cpus_per_island": 0.5,
                   "region": REGIONS[i % 4]} for i in range(islands)]})


def ours(cfg: RunConfig, outer_steps: int, threads: int | None = None) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Our sync-diloco mode's arithmetic, in one process: (losses[island] per inner step, final global state).

    `threads`: torch threads of the inner steps (default inner.torch_threads, as each island and replica group)."""
    torch.set_num_threads(threads or cfg.inner.torch_threads)
    prepared = prepare(cfg)
    m, h = cfg.num_islands, cfg.outer.sync_every_steps
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in prepared.initial.items()], cfg.outer.num_fragments)
    assert plan.num_fragments == 1, "sync-diloco is P = 1"
    core = OuterOptimizer(prepared.initial, plan, settings=outer_settings(cfg), embedding_names=prepared.embedding_names,
                          buffer_names=prepared.buffer_names)
    inner = inner_settings(cfg)
    trainers = [InnerTrainer(prepared.recipe, prepared.data.train, settings=inner, shard_index=i, num_shards=m,
                             seed=cfg.run.seed) for i in range(m)]
    names = plan.fragments[0]
    for i, t in enumerate(trainers):
        core.register(i, 1)
        load_state_tensors(t.model, core.global_parameters())  # an island starts from the global parameters
    losses: list[list[float]] = [[] for _ in range(m)]
    for k in range(outer_steps):
        results = []
        for i, t in enumerate(trainers):
            base = core.global_parameters()
            losses[i] += [t.step().loss for _ in range(h)]
            local = state_tensors(t.model)
            deltas = [base[n] - local[n].detach() for n in names]  # outer gradient: base - theta
            sub = Submission(island=i, incarnation=1, seq=k, fragment=0, base_version=k,
                             tokens=h * inner.batch_size * prepared.recipe.seq_len, inner_steps=h, step_time_s=0.1,
                             train_loss=losses[i][-1], payload=[compress(d, "none") for d in deltas], created_at=time.time())
            closed, refusal = core.receive(sub, now=float(k))
            assert refusal is None, refusal
            results += closed
        assert len(results) == 1 and len(results[0].merged) == m, "K = all: one round with every island"
        for t in trainers:  # overwrite adoption
            load_state_tensors(t.model, core.global_parameters())
    return losses, core.global_parameters()


def theirs(cfg: RunConfig, run_dir: Path) -> tuple[list[list[float]], dict[str, torch.Tensor], dict]:
    """torchft's DiLoCo on the same config: (losses[replica group] per inner step, final parameters, summary)."""
    summary = train_torchft(cfg, run_dir)
    m = cfg.num_islands
    losses: list[list[float]] = [[] for _ in range(m)]
    for slot in range(m):
        for line in (run_dir / f"records-r{slot}-i1.jsonl").read_text().splitlines():
            losses[slot] += json.loads(line).get("losses", [])
    files = run_dir.glob(f"params-s{summary['outer_steps']}-n*-r*.pt")  # the step's largest quorum
    final = torch.load(max(files, key=lambda p: int(p.stem.split("-")[2][1:])))
    return losses, final, summary


def step_differences(a: list[list[float]], b: list[list[float]], h: int) -> list[float]:
    """Per outer step: the largest relative difference of two runs' training losses over islands and its H steps."""
    steps = min(len(x) for x in a + b)
    return [max(abs(x[j] - y[j]) / abs(y[j]) for x, y in zip(a, b) for j in range(k, min(k + h, steps)))
            for k in range(0, steps, h)]


def param_difference(pa: dict, pb: dict) -> float:
    """max |a - b| over the state tensors both hold."""
    return max(float((pa[n] - pb[n]).abs().max()) for n in pa if n in pb)


def verdict(diffs: list[float], floor: list[float], rtol: float) -> bool:
    """Same when every outer step's loss difference is within `rtol`, or no more than 10x what our own mode differs
    from itself with another thread count on that step (float rounding, which AdamW amplifies after the warmup)."""
    return all(d <= rtol or d <= 10 * f for d, f in zip(diffs, floor))

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--islands", type=int, default=2, help="replica groups / islands (default 2)")
    ap.add_argument("--sync-every", type=int, default=5, help="H (default 5)")
    ap.add_argument("--outer-steps", type=int, default=3, help="outer steps compared (default 3)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance on losses and parameters (default 1e-4)")
    ap.add_argument("--out", type=Path, default=None, help="torchft's run directory (default: a new temporary one)")
    args = ap.parse_args(argv)
    cfg = equivalence_config(args.islands, args.sync_every, args.outer_steps)
    out = args.out or Path(tempfile.mkdtemp(prefix="torchft-equiv-")) / "torchft"
    a, pa = ours(cfg, args.outer_steps)
    a2, pa2 = ours(cfg, args.outer_steps, threads=2)  # the noise floor: our own mode, another reduction order
    b, pb, summary = theirs(cfg, out)
    diffs, floor = step_differences(a, b, args.sync_every), step_differences(a, a2, args.sync_every)
    ok = verdict(diffs, floor, args.rtol) and len(a[0]) == len(b[0])
    print(f"torchft {summary['torchft']} DiLoCo vs our sync-diloco: {args.islands} replica groups / islands, H = "
          f"{args.sync_every}, {args.outer_steps} outer steps, outer SGD lr {cfg.outer.lr} Nesterov momentum {cfg.outer.momentum}, "
          f"inner AdamW lr {cfg.inner.lr} (constant after {cfg.inner.warmup_steps} warmup steps), clip {cfg.inner.grad_clip}, "
          f"{cfg.inner.torch_threads} torch thread(s); network none, no faults; torchft run in {out}")
    for k, (d, f) in enumerate(zip(diffs, floor)):
        j = (k + 1) * args.sync_every - 1
        print(f"outer step {k + 1}: island 0's loss at inner step {j + 1}: ours {a[0][j]:.6f}, torchft {b[0][j]:.6f}; largest relative "
              f"difference over islands and steps {d:.1e} (ours with 2 threads against ours with {cfg.inner.torch_threads}: {f:.1e})")
    print(f"final global parameters: max |ours - torchft| = {param_difference(pa, pb):.1e}; ours, 2 threads against "
          f"{cfg.inner.torch_threads}: {param_difference(pa, pa2):.1e}")
    if len(a[0]) != len(b[0]):
        print(f"inner step counts differ: ours {len(a[0])}, torchft {len(b[0])}")
    if summary["participants_per_commit"] != [args.islands] * args.outer_steps:
        ok = False
        print(f"torchft's commits did not all take every replica group: participants {summary['participants_per_commit']}")
    print(f"{'SAME' if ok else 'DIFFERENT'}: within relative tolerance {args.rtol:g}, or within 10x our own thread-count noise")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
