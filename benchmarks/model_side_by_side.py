"""A user's model, decoupled DiLoCo against data parallel at equal tokens: held-out loss and bytes per token.

Two islands (the engine, `diloco train`'s path) against two data-parallel workers on Ray Train
(orchestrator/baselines/data_parallel.py), training the same model from the same import path (config
``model.factory``, default ``benchmarks.hf_models:llama_small``, a 3.0M-parameter Hugging Face
``LlamaForCausalLM``), with the same default loss (cross-entropy of ``.logits``), inner AdamW, cosine
inner lr schedule, batch, data (the stdlib byte corpus; island/worker i reads shard i of 2) and
token budget. Two pools of one island each, in us-east and us-west, one CPU each.

Runs, one after another, each in its own run directory under --out/runs (methods interleaved when
--repeats > 1):

  decoupled-fp32   the engine's defaults: K = 1, grace, rebase, outer gradients and published
                   fragments in float32 (outer.compression none, outer.downlink none)
  decoupled-int4   the same with int4 outer gradients and int8 published fragments (compare.py's wire)
  data-parallel    an all-reduce of the bf16 gradient every step (the baseline's default wire)

Network: none by default. Nothing is delayed; every byte is still counted (the engine counts each
submission and each published fragment on its island's link; data parallel counts the ring
all-reduce's share each worker sends, 2 (n-1)/n x the gradient per step). ``--network
wan-4-regions`` puts the decoupled runs on EMULATED WAN links (policies.network; scaled to the inner
step measured once before Ray starts, so later versions also go down as int4 differences); data
parallel always runs without a network: its bytes do not depend on the delay, and its loss at equal
tokens is the same math.

Final held-out loss: each run's final model scored on --final-eval-batches held-out batches after it
finishes (compare.py's score_final). One repeat by default: one run's loss spreads a few percent
(benchmarks/RESULTS.md), so read a single-repeat gap of that size as noise.

    python benchmarks/model_side_by_side.py                                  # ~15 min on 2 busy cores
    python benchmarks/model_side_by_side.py --budget 200000 --methods decoupled-fp32,data-parallel   # quicker
    python benchmarks/model_side_by_side.py --model tests.api.zoo:tiny_gpt2 --set-all model.seq_len=32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH (they import the model factory's module from it).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")  # a loaded 2-core box starts workers slowly

import orchestrator  # noqa: E402,F401 - before ray: it sets Ray's log filter (orchestrator/__init__.py)

# isort: split
import ray  # noqa: E402

from benchmarks.compare import (  # noqa: E402
    ProgressLine,
    deep_merge,
    fmt,
    fresh_out_dir,
    log_runs_and_warn_on_console,
    median,
    score_final,
)
from orchestrator.actors.remote import WORKER_ENV, ignore_zero_copy_warnings  # noqa: E402
from orchestrator.baselines.data_parallel import train_data_parallel  # noqa: E402
from orchestrator.config import ConfigError, apply_overrides, build_config  # noqa: E402
from orchestrator.run.driver import measure_step_s, train  # noqa: E402
from orchestrator.run.workload import run_recipe, training_data  # noqa: E402

METHODS = {
    "decoupled-fp32": ("engine", {"mode": "decoupled"}),
    "decoupled-int4": ("engine", {"mode": "decoupled", "outer": {"compression": "int4", "downlink": "int8"}}),
    "data-parallel": ("dp", {"network": {"scenario": "none", "local_step_s": None}}),
}
REGIONS = ("us-east", "us-west")


def base_config(args: argparse.Namespace) -> dict:
    """What every run shares: the model, budget, schedule, evaluation and the two one-island pools."""
    cfg = {
        "run": {"token_budget": args.budget, "seed": args.seed, "call_timeout_s": 180.0},
        "model": {"factory": args.model, "preset": args.preset},
        "inner": {"lr_schedule": "cosine"},  # data parallel at its best (benchmarks/README.md, compare.py)
        "eval": {"interval_s": args.eval_interval_s},
        "health": {"warm_spares": 0},  # data parallel has none
        "network": {"scenario": args.network, "local_step_s": args.local_step_s},
        "pools": [{"name": r.split("-")[1], "islands": 1, "cpus_per_island": 1, "region": r} for r in REGIONS],
    }
    return apply_overrides(cfg, args.all_overrides)


def method_config(args: argparse.Namespace, name: str) -> tuple[str, dict]:
    """(runner, full config dict) of method `name`: the base, the method's settings, then --set for the decoupled ones."""
    runner, extra = METHODS[name]
    data = deep_merge(base_config(args), extra)
    if runner == "engine":
        data = apply_overrides(data, args.overrides)
    return runner, data


def run_one(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """One run in `run_dir`; its summary with the final model's wide held-out loss added."""
    runner, data = method_config(args, name)
    cfg = build_config(data)
    show = ProgressLine(name, cfg.run.token_budget, args.progress_s) if args.progress_s > 0 else None
    t0 = time.monotonic()
    summary = train_data_parallel(cfg, run_dir, progress=show) if runner == "dp" else train(cfg, run_dir, progress=show)
    if args.final_eval_batches:
        summary.update(score_final(run_dir, args.final_eval_batches))
    summary["total_s"] = time.monotonic() - t0
    print(f"  {name}: {summary['total_s']:.0f} s in all, {summary['tokens_processed']:,} tokens, final held-out loss "
          f"{summary.get('final_loss_wide', summary['eval_loss']):.4f}, {summary['bytes_sent'] / 1e6:,.1f} MB sent",
          file=sys.stderr, flush=True)
    return summary


def row(s: dict) -> dict:
    """The numbers the table shows for one run."""
    return {"tokens": s["tokens_processed"], "final_loss": s.get("final_loss_wide", s["eval_loss"]),
            "bytes_sent": s["bytes_sent"], "bytes_per_token": s["bytes_sent"] / max(1, s["tokens_processed"]),
            "wall_s": s["wall_s"], "network": s["network"]}


def table(names: list[str], runs: list[dict[str, dict]], args: argparse.Namespace, params: int) -> str:
    """Markdown: per method the medians over repeats, the loss gap and the bytes ratio against data parallel."""
    med = {n: {k: median([row(r[n])[k] for r in runs]) for k in ("tokens", "final_loss", "bytes_sent",
                                                                  "bytes_per_token", "wall_s")} for n in names}
    dp = med.get("data-parallel")
    lines = ["| method | tokens | final held-out loss | vs data parallel | bytes sent | bytes/token | "
             "data parallel's bytes/token ÷ this | training wall s | network |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for n in names:
        m = med[n]
        gap = "" if dp is None or n == "data-parallel" else f"{100 * (m['final_loss'] / dp['final_loss'] - 1):+.2f}%"
        ratio = "" if dp is None or n == "data-parallel" else f"{dp['bytes_per_token'] / m['bytes_per_token']:.1f}x"
        lines.append(f"| {n} | {m['tokens']:,.0f} | {m['final_loss']:.4f} | {gap} | {m['bytes_sent'] / 1e6:,.1f} MB | "
                     f"{m['bytes_per_token']:,.1f} | {ratio} | {m['wall_s']:.0f} | {row(runs[0][n])['network']} |")
    per_repeat = "; ".join(f"{n}: " + ", ".join(f"{row(r[n])['final_loss']:.4f}" for r in runs) for n in names)
    lines += ["", f"model {args.model} ({params:,} params), 2 islands vs 2 data-parallel workers, budget "
              f"{args.budget:,} tokens per run, {len(runs)} repeat(s) (medians; per repeat: {per_repeat}); "
              f"final loss in nats per token on {fmt(args.final_eval_batches, 'd')} held-out batches "
              f"(0: the run's own last evaluation); data parallel sends bf16 gradients and runs without a network "
              f"(its bytes are the ring all-reduce's share, whatever the delay); "
              + ("no network emulated for any run: bytes are counted, nothing is delayed"
                 if args.network == "none" else f"decoupled runs over the EMULATED {args.network} links")
              + (f"; every run {' '.join(args.all_overrides)}" if args.all_overrides else "")
              + (f"; decoupled runs {' '.join(args.overrides)}" if args.overrides else "") + "."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="examples:\n" + __doc__.rsplit("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks.hf_models:llama_small", metavar="PACKAGE.MODULE:FUNCTION",
                    help="model factory import path (config model.factory; default benchmarks.hf_models:llama_small)")
    ap.add_argument("--preset", default="tiny", help="preset whose seq_len is the training window (default tiny: 128)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, in run order (default {','.join(METHODS)})")
    ap.add_argument("--budget", type=int, default=600_000, help="tokens per run, all islands together (default 600,000)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every method, interleaved; medians reported (default 1)")
    ap.add_argument("--network", default="none", help="network scenario of the decoupled runs (default none; "
                    "e.g. wan-4-regions: EMULATED links); data parallel always runs without one")
    ap.add_argument("--local-step-s", type=float, default=None,
                    help="inner-step time an emulated network is scaled to (default: measured once before Ray starts)")
    ap.add_argument("--final-eval-batches", type=int, default=128,
                    help="held-out batches each final model is scored on (default 128, 262k tokens; 0: the run's own)")
    ap.add_argument("--eval-interval-s", type=float, default=20.0, help="seconds between the runs' own evaluations (default 20)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for the decoupled runs (repeatable), e.g. outer.sync_every_steps=20")
    ap.add_argument("--set-all", dest="all_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every run (repeatable), e.g. inner.lr=0.001 or data.batch_size=8")
    ap.add_argument("--progress-s", type=float, default=60.0, help="a progress line per run at most this often (0: off)")
    ap.add_argument("--out", type=Path, default=None, help="output directory, new or empty (default runs/side-by-side-<time>)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        ap.error(f"--methods {','.join(unknown) or '(none)'}: pick from {', '.join(METHODS)}")
    if args.repeats < 1 or args.budget < 1 or args.final_eval_batches < 0:
        ap.error("--repeats and --budget must be >= 1, --final-eval-batches >= 0")
    for item in args.all_overrides:
        if item.split("=", 1)[0].strip().split(".", 1)[0] in ("pools", "network", "mode"):
            ap.error(f"--set-all {item}: pools, network and mode are this script's; see --network and --methods")
    try:  # a bad --set fails here, in one line, before any run
        for name in args.methods:
            build_config(method_config(args, name)[1])
    except ConfigError as err:
        ap.error(str(err))
    args.out = fresh_out_dir(ap, args.out, "side-by-side")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_runs_and_warn_on_console(args.out)
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    cfg = build_config(base_config(args))
    data = training_data(cfg)
    recipe = run_recipe(cfg, data)
    from islands.model_api import instantiate

    params = sum(p.numel() for p in instantiate(recipe.model, recipe.seed).parameters())
    if args.network != "none" and args.local_step_s is None:  # before Ray starts (orchestrator.run.driver.with_measured_step)
        args.local_step_s = measure_step_s(cfg, recipe, data.train, steps=8)
    print(f"{recipe.name}: {params:,} params; {args.budget:,} tokens per run, methods {', '.join(args.methods)}, "
          f"{args.repeats} repeat(s), network {args.network}, load average {os.getloadavg()}, out {args.out}", file=sys.stderr)
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": WORKER_ENV}, logging_level="ERROR")
    ignore_zero_copy_warnings()
    runs: list[dict[str, dict]] = []
    try:
        for r in range(args.repeats):
            runs.append({n: run_one(n, args, args.out / "runs" / f"{n}-r{r + 1}") for n in args.methods})
    finally:
        ray.shutdown()
    text = table(args.methods, runs, args, params) + f" Started {started} UTC; load average at the end {os.getloadavg()}."
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                                       "params": params, "runs": runs}, indent=2, default=str))
    print(text)
    print(args.out / "table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
