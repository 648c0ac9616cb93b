"""Island overhead: inner-step throughput of a LearnerIsland on Ray vs a bare PyTorch loop.

The subject is the whole engine path for one island: an ``IslandActor`` fed by a real
``OuterOptimizerActor`` (K = 1, seeded from checkpoint 0 and checkpointing every
``--checkpoint-every-s`` as the driver sets it up) that takes every submission, merges it and
publishes a new version the island adopts at its next step boundary, while this script polls both
for status every ``--poll-s`` seconds as the driver does. The baseline is a bare PyTorch loop (same model from
``build_model``, AdamW with the same hyperparameters, warmup and grad clip, the same batches from a
``ShardSampler``, the same torch threads) in a plain Ray actor with the same CPU share, polled the
same way. Each side runs alone; baseline and island alternate within every repeat.

Throughput is the least-squares slope of (status time, steps) over a ``--window-s`` window that
starts once ``--warmup-steps`` steps are done. Nothing is asserted: the script prints markdown
tables (per repeat and medians) and the ratio island / baseline against the 0.95 target.

Run from the repository root::

    python benchmarks/island_overhead.py                        # P=2 (default) plus P=1 and int8 rows
    python benchmarks/island_overhead.py --quick                # smoke run, under a minute
    python benchmarks/island_overhead.py --repeats 5 --window-s 30 --json island_overhead.json
    python benchmarks/island_overhead.py --main-only --preset small --batch-size 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from islands.data import ShardSampler, load_stdlib_corpus  # noqa: E402
from islands.island import IslandSpec  # noqa: E402
from islands.model import ModelConfig, build_model, model_config  # noqa: E402
from islands.trainer import InnerSettings  # noqa: E402
from orchestrator.actors import WORKER_ENV, IslandActor, OuterOptimizerActor  # noqa: E402
from orchestrator.checkpoint import CheckpointStore  # noqa: E402
from orchestrator.outer_optimizer import OuterOptimizer, OuterSettings  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402

TARGET_RATIO = 0.95
SHARED_NOTE = ("note: the 2-core machine is shared with other work; the numbers are medians of "
               "interleaved repeats, yet under heavy load single repeats can be off by far more than the overhead "
               "measured; the CPU ms/step columns are the steadier comparison")


@dataclass(frozen=True)
class Variant:
    """One row of the benchmark: the engine settings the island runs with."""

    label: str
    num_fragments: int
    compression: str


class BareLoop:
    """The baseline: a bare PyTorch training loop in a background thread of a plain Ray actor."""

    def __init__(self, cfg: ModelConfig, data: list, inner: InnerSettings, seed: int) -> None:
        torch.set_num_threads(inner.torch_threads)
        self.inner = inner
        self.model = build_model(cfg, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=inner.lr,
                                           betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay)
        self.sampler = ShardSampler(np.asarray(ray.get(data[0])), shard_index=0, num_shards=1,
                                    seq_len=cfg.seq_len, batch_size=inner.batch_size, seed=seed)
        self.steps = 0
        self.threads_seen = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bare-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.threads_seen = torch.get_num_threads()
        warm = self.inner.warmup_steps
        try:
            while not self._stop.is_set():
                x, y = self.sampler.next_batch()  # [B, T], [B, T]
                for group in self.optimizer.param_groups:
                    group["lr"] = self.inner.lr * min(1.0, (self.steps + 1) / warm) if warm > 0 else self.inner.lr
                loss = self.model.loss(x, y)
                loss.backward()
                if self.inner.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.inner.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                loss.item()
                self.steps += 1
        except Exception as err:  # noqa: BLE001 - reported through status()
            self.error = f"{type(err).__name__}: {err}"

    def status(self) -> dict:
        """Steps so far and the wall time of this snapshot (the same fields the island reports)."""
        return {"steps": self.steps, "at": time.time(), "error": self.error, "threads": self.threads_seen}

    def stop(self) -> int:
        """Stop after the current step; returns the total steps."""
        self._stop.set()
        self._thread.join(30)
        return self.steps


BareLoopActor = ray.remote(max_restarts=0, max_concurrency=2)(BareLoop)


def slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares steps per second through ``(time, steps)`` samples."""
    ts = np.array([t for t, _ in samples])
    ns = np.array([n for _, n in samples], dtype=float)
    ts = ts - ts.mean()
    return float((ts * (ns - ns.mean())).sum() / (ts * ts).sum())


def process_cpu_s(actor) -> float:
    """CPU seconds (all threads) the actor's worker process has used so far."""
    return ray.get(actor.__ray_call__.remote(lambda _self: time.process_time()))


def measure(poll, cpu, *, warmup_steps: int, window_s: float, poll_s: float, start_timeout_s: float = 300.0) -> dict:
    """Wait for ``warmup_steps``, then sample ``poll() -> (at, steps)`` every ``poll_s`` for ``window_s``.

    ``cpu() -> {process: cpu_s}`` is read when the window opens and closes, for CPU ms per step.
    """
    deadline = time.monotonic() + start_timeout_s
    while True:
        at, steps = poll()
        if steps >= warmup_steps:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {steps} of {warmup_steps} warm-up steps after {start_timeout_s:.0f} s; "
                               "the machine is overloaded or the loop is stuck")
        time.sleep(poll_s)
    cpu0 = cpu()
    samples = [(at, steps)]
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        time.sleep(poll_s)
        samples.append(poll())
    cpu1 = cpu()
    done = max(1, samples[-1][1] - samples[0][1])
    return {"steps_per_s": slope(samples), "window_steps": samples[-1][1] - samples[0][1],
            "window_s": samples[-1][0] - samples[0][0], "samples": len(samples),
            "cpu_ms_per_step": {k: 1000 * (cpu1[k] - cpu0[k]) / done for k in cpu0}}


def run_baseline(cfg: ModelConfig, data_ref, inner: InnerSettings, args) -> dict:
    """One baseline measurement in a fresh actor."""
    loop = BareLoopActor.options(num_cpus=1).remote(cfg, [data_ref], inner, args.seed)

    def poll():
        st = ray.get(loop.status.remote())
        if st["error"]:
            raise RuntimeError(f"bare loop failed: {st['error']}")
        return st["at"], st["steps"]

    try:
        out = measure(poll, lambda: {"loop": process_cpu_s(loop)},
                      warmup_steps=args.warmup_steps, window_s=args.window_s, poll_s=args.poll_s)
        out["torch_threads"] = ray.get(loop.status.remote())["threads"]
        ray.get(loop.stop.remote())
        return out
    finally:
        ray.kill(loop)


def run_island(cfg: ModelConfig, data_ref, inner: InnerSettings, variant: Variant, args) -> dict:
    """One island measurement: a fresh OuterOptimizerActor (K = 1) and IslandActor."""
    model = build_model(cfg, seed=args.seed)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], variant.num_fragments)
    settings = OuterSettings(compression=variant.compression)  # K = 1: min_quorum 1, one island
    # As the driver does: checkpoint 0 holds the initial global state the outer optimizer starts from.
    ckpt_dir = tempfile.mkdtemp(prefix="island-overhead-ckpt-")
    tensors, meta = OuterOptimizer(initial, plan, settings=settings).state_dict()
    CheckpointStore(ckpt_dir, keep=3).save(0, tensors, {"outer": meta, "epoch": -1, "extra": {}})
    outer = OuterOptimizerActor.options(num_cpus=0).remote(plan, settings, model.embedding_parameter_names(),
                                                           ckpt_dir, args.checkpoint_every_s, 3)
    spec = IslandSpec(island=0, incarnation=1, pool="bench", num_islands=1, model_config=cfg, plan=plan,
                      inner=inner, sync_every_steps=args.sync_every_steps, compression=variant.compression,
                      seed=args.seed)
    island = None
    try:
        latest = ray.get(outer.latest.remote())
        island = IslandActor.options(num_cpus=1).remote(spec, [data_ref], latest, 0)
        ray.get(island.node_id.remote())
        ray.get(outer.register.remote(0, 1, island))

        def poll():
            st, _ = ray.get([island.status.remote(), outer.status.remote()])  # the driver polls both
            if st.error:
                raise RuntimeError(f"island failed: {st.error}")
            return st.at, st.steps

        out = measure(poll, lambda: {"island": process_cpu_s(island), "outer": process_cpu_s(outer)},
                      warmup_steps=args.warmup_steps, window_s=args.window_s, poll_s=args.poll_s)
        final = ray.get(island.stop.remote())
        ray.get(outer.stop.remote())
        status = ray.get(outer.status.remote())
        out.update(rounds=status["rounds"], refusals=status["refusals"], versions=list(status["versions"]),
                   island_versions=list(final.versions), total_steps=final.steps, state=final.state)
        if status["refusals"]:
            print(f"  warning: the outer optimizer refused {status['refusals']} submissions", flush=True)
        return out
    finally:
        for actor in (island, outer):
            if actor is not None:
                ray.kill(actor)
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def machine() -> str:
    """One line naming the CPU, cores and versions."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{name}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"Ray {ray.__version__}")


def variants(args) -> list[Variant]:
    main = Variant(f"P={args.num_fragments}, none", args.num_fragments, "none")
    if args.main_only:
        return [main]
    extra = [Variant("P=1, none", 1, "none"), Variant(f"P={args.num_fragments}, int8", args.num_fragments, "int8")]
    return [main] + [v for v in extra if v.num_fragments != main.num_fragments or v.compression != "none"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples:\n" + __doc__.split("::\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="baseline/island pairs per row (median taken; default 3)")
    ap.add_argument("--window-s", type=float, default=20.0, help="measured window per run, s (default 20)")
    ap.add_argument("--warmup-steps", type=int, default=40, help="steps before the window opens (default 40)")
    ap.add_argument("--poll-s", type=float, default=0.5, help="status poll period, s, as the driver (default 0.5)")
    ap.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per inner step (default 16)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--sync-every-steps", type=int, default=40, help="H (default 40)")
    ap.add_argument("--num-fragments", type=int, default=2, help="P of the main row (default 2)")
    ap.add_argument("--checkpoint-every-s", type=float, default=15.0,
                    help="outer-optimizer checkpoint period, s, as the config default (default 15)")
    ap.add_argument("--main-only", action="store_true", help="skip the P=1 and int8 rows")
    ap.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on corpus bytes (default 8 MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: main row only, 1 repeat, 2 s window, 5 warm-up steps (not a measurement)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.main_only, args.window_s, args.warmup_steps = True, 2.0, 5
        if "--repeats" not in (argv if argv is not None else sys.argv):
            args.repeats = 1
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.sync_every_steps % args.num_fragments:
        ap.error(f"--sync-every-steps {args.sync_every_steps} must be a multiple of "
                 f"--num-fragments {args.num_fragments}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    cfg = model_config(args.preset)
    inner = InnerSettings(batch_size=args.batch_size, torch_threads=args.torch_threads)
    corpus = load_stdlib_corpus(max_bytes=args.max_bytes)
    print(f"machine: {machine()}")
    print(f"date: {started.isoformat(timespec='seconds')}, load average at start: {os.getloadavg()}")
    print(SHARED_NOTE)
    print(f"model {args.preset} ({sum(p.numel() for p in build_model(cfg, seed=0).parameters()):,} params), "
          f"batch {args.batch_size}, torch threads {args.torch_threads}, H={args.sync_every_steps}, "
          f"window {args.window_s:g} s after {args.warmup_steps} warm-up steps, {args.repeats} repeats\n", flush=True)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # address="local": always a fresh private instance, never a cluster someone else started on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV})
    rows: list[dict] = []
    try:
        data_ref = ray.put(corpus.train)
        for variant in variants(args):
            for r in range(args.repeats):
                order = ("baseline", "island") if r % 2 == 0 else ("island", "baseline")
                got = {}
                for side in order:
                    got[side] = (run_baseline(cfg, data_ref, inner, args) if side == "baseline"
                                 else run_island(cfg, data_ref, inner, variant, args))
                row = {"config": variant.label, "repeat": r, "order": "/".join(order),
                       "baseline": got["baseline"], "island": got["island"],
                       "ratio": got["island"]["steps_per_s"] / got["baseline"]["steps_per_s"],
                       "cpu_ratio": (got["baseline"]["cpu_ms_per_step"]["loop"]
                                     / got["island"]["cpu_ms_per_step"]["island"])}
                rows.append(row)
                print(f"  {variant.label} repeat {r}: baseline {row['baseline']['steps_per_s']:.2f} steps/s, "
                      f"island {row['island']['steps_per_s']:.2f} steps/s, ratio {row['ratio']:.3f} "
                      f"({row['island']['rounds']} rounds)", flush=True)
    finally:
        ray.shutdown()

    summary = []
    for label in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == label]
        med = lambda f: statistics.median(f(r) for r in mine)  # noqa: E731
        summary.append({
            "config": label,
            "baseline_steps_per_s": med(lambda r: r["baseline"]["steps_per_s"]),
            "island_steps_per_s": med(lambda r: r["island"]["steps_per_s"]),
            "ratio": med(lambda r: r["ratio"]),
            "baseline_cpu_ms_per_step": med(lambda r: r["baseline"]["cpu_ms_per_step"]["loop"]),
            "island_cpu_ms_per_step": med(lambda r: r["island"]["cpu_ms_per_step"]["island"]),
            "outer_cpu_ms_per_step": med(lambda r: r["island"]["cpu_ms_per_step"]["outer"]),
            "cpu_ratio": med(lambda r: r["cpu_ratio"]),
            "rounds_per_repeat": med(lambda r: r["island"]["rounds"]),
            "refusals": sum(r["island"]["refusals"] for r in mine),
            "repeats": len(mine),
        })

    print("\nper repeat (CPU ms/step: CPU time of the whole worker process over the window / steps):\n")
    print("| config | repeat | order | baseline steps/s | island steps/s | ratio | "
          "baseline CPU ms/step | island CPU ms/step | outer CPU ms/step | rounds |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        b, i = r["baseline"], r["island"]
        print(f"| {r['config']} | {r['repeat']} | {r['order']} | {b['steps_per_s']:.2f} | {i['steps_per_s']:.2f} | "
              f"{r['ratio']:.3f} | {b['cpu_ms_per_step']['loop']:.1f} | {i['cpu_ms_per_step']['island']:.1f} | "
              f"{i['cpu_ms_per_step']['outer']:.1f} | {i['rounds']} |")
    print(f"\nmedians (ratio = median of per-repeat island / baseline steps/s, target >= {TARGET_RATIO}; "
          "CPU ratio = median of baseline / island CPU ms per step, which the other load on the machine "
          "disturbs less):\n")
    print("| config | baseline steps/s | island steps/s | ratio | target met | baseline CPU ms/step | "
          "island CPU ms/step | outer CPU ms/step | CPU ratio | refusals |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for s in summary:
        met = "yes" if s["ratio"] >= TARGET_RATIO else "no"
        print(f"| {s['config']} | {s['baseline_steps_per_s']:.2f} | {s['island_steps_per_s']:.2f} | "
              f"{s['ratio']:.3f} | {met} | {s['baseline_cpu_ms_per_step']:.1f} | {s['island_cpu_ms_per_step']:.1f} | "
              f"{s['outer_cpu_ms_per_step']:.1f} | {s['cpu_ratio']:.3f} | {s['refusals']} |")
    print(f"\n{SHARED_NOTE}")
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "island_overhead", "date": started.isoformat(timespec="seconds"),
                       "machine": machine(), "note": SHARED_NOTE, "args": vars(args),
                       "target_ratio": TARGET_RATIO, "rows": rows, "summary": summary}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
