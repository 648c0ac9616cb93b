"""Island overhead: inner-step throughput of a LearnerIsland on Ray vs a bare PyTorch loop.

The subject is the whole engine path for one island: an ``IslandActor`` fed by a real
``OuterOptimizerActor`` (K = 1, seeded from checkpoint 0 and checkpointing every
``--checkpoint-every-s`` as the driver sets it up) that takes every submission, merges it and
publishes a new version the island adopts at its next step boundary, while this script polls both
for status every ``--poll-s`` seconds as the driver does. The baseline is a bare PyTorch loop (the
same model from the same factory and seed, the same loss, AdamW with the same hyperparameters,
warmup and grad clip, the same batches from a ``ShardSampler``, the same torch threads) in a plain
Ray actor with the same CPU share, polled the same way. The model is the built-in one of
``--preset``, or a user's from ``--model package.module:function`` (config ``model.factory``: e.g. a
Hugging Face ``LlamaForCausalLM`` from benchmarks/hf_models.py, trained with the default loss,
cross-entropy of its ``.logits``).

Method: both sides live at once and take turns in short slices. While one side is measured the
other side's process is frozen (SIGSTOP; the outer optimizer stays up and simply gets nothing to
merge), so each runs alone on the machine, and the two slices of a pair are seconds apart. The host
of this virtual machine drifts by +-25% over minutes; comparing adjacent slices cancels that drift,
where whole runs one after the other (this script's earlier method) could not resolve a 5% overhead.
Throughput in a slice is the least-squares slope of (status time, steps); a pair's ratio is island /
baseline; a repeat reports the median over its pairs and the benchmark the median over repeats.
Nothing is asserted: the script prints markdown tables and the ratio against the target (0.95 for
the built-in model, 0.97 for a ``--model``).

Run from the repository root::

    python benchmarks/island_overhead.py                        # P=2 (default) plus P=1 and int8 rows
    python benchmarks/island_overhead.py --quick                # smoke run, under a minute
    python benchmarks/island_overhead.py --main-only --repeats 3 --pairs 12 --json island_overhead.json
    python benchmarks/island_overhead.py --main-only --preset small --batch-size 8
    python benchmarks/island_overhead.py --main-only --model benchmarks.hf_models:llama_small --batch-size 8 \
        --repeats 3 --pairs 6 --slice-s 10 --warmup-steps 20   # a 3.0M-param Hugging Face Llama (~12 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from islands.data import ShardSampler, load_stdlib_corpus  # noqa: E402
from islands.model_api import buffer_names, embedding_parameter_names, instantiate, state_tensors  # noqa: E402
from islands.spec import ModelRecipe  # noqa: E402
from islands.trainer import InnerSettings, resolve_loss  # noqa: E402
from orchestrator.actors.remote import WORKER_ENV, IslandActor, OuterOptimizerActor  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.core.checkpoint import CheckpointStore  # noqa: E402
from orchestrator.core.outer_optimizer import OuterOptimizer  # noqa: E402
from orchestrator.core.settings import CheckpointSettings  # noqa: E402
from orchestrator.settings import inner_settings, island_specs, model_recipe, outer_settings  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402

TARGET_RATIO = 0.95  # the built-in model (preset)
MODEL_TARGET_RATIO = 0.97  # a user's model (--model), e.g. a Hugging Face LlamaForCausalLM
METHOD_NOTE = ("method: baseline and island take turns in slices, the other side's process frozen (SIGSTOP), "
               "so adjacent slices see the same host; the host of this VM drifts by +-25% over minutes")


@dataclass(frozen=True)
class Variant:
    """One row of the benchmark: the engine settings the island runs with."""

    label: str
    num_fragments: int
    compression: str


class BareLoop:
    """The baseline: a bare PyTorch training loop in a background thread of a plain Ray actor."""

    def __init__(self, recipe: ModelRecipe, data: list, inner: InnerSettings, seed: int) -> None:
        torch.set_num_threads(inner.torch_threads)
        self.inner = inner
        # The recipe's factory under the run's seed (the island's initial weights), in train mode as the island's.
        self.model = instantiate(recipe.model, recipe.seed).train()
        self.loss_fn = resolve_loss(recipe.loss)  # None: islands.model_api.default_loss (cross-entropy of the logits)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=inner.lr,
                                           betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay)
        self.sampler = ShardSampler(np.asarray(ray.get(data[0])), shard_index=0, num_shards=1,
                                    seq_len=recipe.seq_len, batch_size=inner.batch_size, seed=seed)
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
                loss = self.loss_fn(self.model, (x, y))
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


def actor_pid(actor) -> int:
    """The OS process id of an actor's worker process."""
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass
class Side:
    """One measured subject: how to poll its (time, steps), the processes whose CPU counts, and its pids
    to freeze while the other side is measured."""

    name: str
    poll: object  # () -> (at, steps)
    freeze: list[int]  # frozen (SIGSTOP) while the other side runs
    cpu: dict[str, int]  # label -> pid whose CPU time is read at the slice edges
    outer: object = None  # the island side's outer-optimizer actor (its round count)


def send(pids: list[int], sig: int) -> None:
    """Freeze (SIGSTOP) or thaw (SIGCONT) every process in `pids`."""
    for pid in pids:
        os.kill(pid, sig)


def wait_warm(side: Side, warmup_steps: int, poll_s: float, timeout_s: float = 300.0) -> None:
    """Poll until `side` has done `warmup_steps` steps (start-up, lazy imports, first adoption)."""
    deadline = time.monotonic() + timeout_s
    while side.poll()[1] < warmup_steps:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{side.name}: fewer than {warmup_steps} warm-up steps after {timeout_s:.0f} s; "
                               "the machine is overloaded or the loop is stuck")
        time.sleep(poll_s)


def measure_slice(side: Side, *, slice_s: float, settle_s: float, poll_s: float) -> dict:
    """Thaw `side`, let it settle, sample (time, steps) every `poll_s` for `slice_s`, freeze it again."""
    send(side.freeze, signal.SIGCONT)
    try:
        time.sleep(settle_s)
        cpu0 = {k: proc_cpu_s(pid) for k, pid in side.cpu.items()}
        samples = [side.poll()]
        end = time.monotonic() + slice_s
        while time.monotonic() < end:
            time.sleep(poll_s)
            samples.append(side.poll())
        cpu1 = {k: proc_cpu_s(pid) for k, pid in side.cpu.items()}
    finally:
        send(side.freeze, signal.SIGSTOP)
    steps = samples[-1][1] - samples[0][1]
    return {"steps_per_s": slope(samples), "steps": steps, "s": samples[-1][0] - samples[0][0],
            "cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu0}}


def baseline_side(recipe: ModelRecipe, data_ref, inner: InnerSettings, args, actors: list) -> Side:
    """A bare-loop actor, started; appended to `actors` for teardown."""
    loop = BareLoopActor.options(num_cpus=1).remote(recipe, [data_ref], inner, args.seed)
    actors.append(loop)

    def poll():
        st = ray.get(loop.status.remote())
        if st["error"]:
            raise RuntimeError(f"bare loop failed: {st['error']}")
        return st["at"], st["steps"]

    pid = actor_pid(loop)
    return Side("baseline", poll, [pid], {"loop": pid})


def island_side(recipe: ModelRecipe, data_ref, inner: InnerSettings, variant: Variant, args, actors: list,
                cleanup: list) -> Side:
    """A fresh OuterOptimizerActor (K = 1) and IslandActor, started; appended to `actors` for teardown."""
    model = instantiate(recipe.model, recipe.seed)
    # As the driver does (orchestrator.run.workload.prepare): the state tensors are the parameters and trained buffers.
    initial = {n: t.detach().clone() for n, t in state_tensors(model).items()}
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], variant.num_fragments)
    # The built-in config's outer settings (K = 1: min_quorum 1, one island) in this variant's wire format.
    settings = replace(outer_settings(build_config({})), compression=variant.compression)
    # As the driver does: checkpoint 0 holds the initial global state the outer optimizer starts from.
    ckpt_dir = tempfile.mkdtemp(prefix="island-overhead-ckpt-")
    cleanup.append(ckpt_dir)
    tensors, meta = OuterOptimizer(initial, plan, settings=settings).state_dict()
    CheckpointStore(ckpt_dir, keep=3).save(0, tensors, {"outer": meta, "epoch": -1, "extra": {}})
    outer = OuterOptimizerActor.options(num_cpus=0).remote(
        plan, settings, embedding_parameter_names(model), CheckpointSettings(ckpt_dir, every_s=args.checkpoint_every_s, keep=3),
        network=None, buffer_names=frozenset(buffer_names(model)))
    actors.append(outer)
    spec = replace(island_specs(build_config({}), recipe, plan)[0], island=0, incarnation=1, pool="bench", num_islands=1,
                   inner=inner, sync_every_steps=args.sync_every_steps, compression=variant.compression,
                   seed=args.seed, adoption="overwrite")  # overwrite: what this benchmark has always measured
    latest = ray.get(outer.latest.remote())
    island = IslandActor.options(num_cpus=1).remote(spec, [data_ref], latest, 0)
    actors.append(island)
    ray.get(island.node_id.remote())
    ray.get(outer.register.remote(0, 1, island))

    def poll():
        st, _ = ray.get([island.status.remote(), outer.status.remote()])  # the driver polls both
        if st.error:
            raise RuntimeError(f"island failed: {st.error}")
        return st.at, st.steps

    pid = actor_pid(island)
    return Side("island", poll, [pid], {"island": pid, "outer": actor_pid(outer)}, outer=outer)


def run_repeat(recipe: ModelRecipe, data_ref, inner: InnerSettings, variant: Variant, args) -> dict:
    """Fresh baseline and island actors; `--pairs` pairs of alternating slices (the other side frozen)."""
    actors: list = []
    cleanup: list[str] = []
    sides: list[Side] = []
    try:
        base = baseline_side(recipe, data_ref, inner, args, actors)
        sides.append(base)
        isl = island_side(recipe, data_ref, inner, variant, args, actors, cleanup)
        sides.append(isl)
        for side, other in ((base, isl), (isl, base)):  # warm each up alone, the other frozen
            send(other.freeze, signal.SIGSTOP)
            send(side.freeze, signal.SIGCONT)
            wait_warm(side, args.warmup_steps, args.poll_s)
            send(side.freeze, signal.SIGSTOP)
        rounds0 = ray.get(isl.outer.status.remote())["rounds"]
        pairs = []
        for k in range(args.pairs):
            order = (base, isl) if k % 2 == 0 else (isl, base)
            got = {s.name: measure_slice(s, slice_s=args.slice_s, settle_s=args.settle_s, poll_s=args.poll_s)
                   for s in order}
            b, i = got["baseline"], got["island"]
            pairs.append({"order": "/".join(s.name for s in order), "baseline": b, "island": i,
                          "ratio": i["steps_per_s"] / b["steps_per_s"]})
        status = ray.get(isl.outer.status.remote())
        if status["refusals"]:
            print(f"  warning: the outer optimizer refused {status['refusals']} submissions", flush=True)
        tot = lambda side, key: sum(p[side][key] for p in pairs)  # noqa: E731
        cpu = lambda side, proc: 1000 * sum(p[side]["cpu_s"][proc] for p in pairs) / max(1, tot(side, "steps"))  # noqa: E731
        return {"pairs": pairs, "ratio_median": statistics.median(p["ratio"] for p in pairs),
                "baseline_steps_per_s": tot("baseline", "steps") / tot("baseline", "s"),
                "island_steps_per_s": tot("island", "steps") / tot("island", "s"),
                "cpu_ms_per_step": {"loop": cpu("baseline", "loop"), "island": cpu("island", "island"),
                                    "outer": cpu("island", "outer")},
                "rounds": status["rounds"] - rounds0, "refusals": status["refusals"]}
    finally:
        for pid in (pid for side in sides for pid in side.freeze):  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for actor in actors:
            ray.kill(actor)
        for path in cleanup:
            shutil.rmtree(path, ignore_errors=True)


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
    """The rows to measure: the main one and, unless --main-only, P=1 and int8 (any not already the main row)."""
    main = Variant(f"P={args.num_fragments}, none", args.num_fragments, "none")
    if args.main_only:
        return [main]
    extra = [Variant("P=1, none", 1, "none"), Variant(f"P={args.num_fragments}, int8", args.num_fragments, "int8")]
    return [main] + [v for v in extra if v.num_fragments != main.num_fragments or v.compression != "none"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; --quick sets a smoke run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples:\n" + __doc__.split("::\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3,
                    help="repeats per row, each with fresh actors (median taken; default 3)")
    ap.add_argument("--pairs", type=int, default=8, help="baseline/island slice pairs per repeat (default 8)")
    ap.add_argument("--slice-s", type=float, default=5.0, help="measured seconds per slice (default 5)")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="seconds a thawed side runs before its slice is measured (default 0.5)")
    ap.add_argument("--warmup-steps", type=int, default=40, help="steps each side takes before any slice (default 40)")
    ap.add_argument("--poll-s", type=float, default=0.5, help="status poll period, s, as the driver (default 0.5)")
    ap.add_argument("--preset", default="tiny",
                    help="model preset (default tiny); with --model only its seq_len counts (the training window)")
    ap.add_argument("--model", metavar="PACKAGE.MODULE:FUNCTION", default=None,
                    help="a user's model instead of the built-in one: the import path of a zero-argument factory "
                         "(config model.factory), e.g. benchmarks.hf_models:llama_small; both sides train it with the "
                         "default loss (cross-entropy of .logits) and AdamW (target 0.97 instead of 0.95)")
    ap.add_argument("--target", type=float, default=None,
                    help=f"ratio target printed against (default {TARGET_RATIO} for the built-in model, "
                         f"{MODEL_TARGET_RATIO} with --model)")
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
                    help="smoke run: main row only, 1 repeat of 2 pairs of 1 s slices, 5 warm-up steps (not a measurement)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    if args.target is None:
        args.target = MODEL_TARGET_RATIO if args.model else TARGET_RATIO
    if args.quick:
        args.main_only, args.repeats, args.pairs, args.slice_s, args.warmup_steps = True, 1, 2, 1.0, 5
    for name in ("repeats", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.slice_s < 2 * args.poll_s:
        ap.error(f"--slice-s {args.slice_s:g} must be at least twice --poll-s {args.poll_s:g} (a slope needs samples)")
    if args.sync_every_steps % args.num_fragments:
        ap.error(f"--sync-every-steps {args.sync_every_steps} must be a multiple of "
                 f"--num-fragments {args.num_fragments}")
    return args


def run_all(args: argparse.Namespace, recipe: ModelRecipe, inner: InnerSettings, corpus) -> list[dict]:
    """Every variant's repeats, in one fresh local Ray session; a line per repeat as it ends."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # address="local": always a fresh private instance, never a cluster someone else started on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV})
    rows: list[dict] = []
    try:
        data_ref = ray.put(corpus.train)
        for variant in variants(args):
            for r in range(args.repeats):
                got = run_repeat(recipe, data_ref, inner, variant, args)
                got.update(config=variant.label, repeat=r)
                rows.append(got)
                ratios = sorted(p["ratio"] for p in got["pairs"])
                print(f"  {variant.label} repeat {r}: baseline {got['baseline_steps_per_s']:.2f} steps/s, "
                      f"island {got['island_steps_per_s']:.2f} steps/s, median pair ratio {got['ratio_median']:.3f} "
                      f"(pairs {ratios[0]:.3f}-{ratios[-1]:.3f}, {got['rounds']} rounds)", flush=True)
    finally:
        ray.shutdown()
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: medians over its repeats, quartiles over every pair of every repeat."""
    summary = []
    for label in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == label]
        def med(f, mine=mine) -> float:
            return statistics.median(f(r) for r in mine)
        every = [p["ratio"] for r in mine for p in r["pairs"]]
        q = statistics.quantiles(every, n=4) if len(every) > 1 else [every[0]] * 3
        summary.append({
            "config": label,
            "baseline_steps_per_s": med(lambda r: r["baseline_steps_per_s"]),
            "island_steps_per_s": med(lambda r: r["island_steps_per_s"]),
            "ratio": med(lambda r: r["ratio_median"]),
            "pair_ratio_quartiles": q,
            "baseline_cpu_ms_per_step": med(lambda r: r["cpu_ms_per_step"]["loop"]),
            "island_cpu_ms_per_step": med(lambda r: r["cpu_ms_per_step"]["island"]),
            "outer_cpu_ms_per_step": med(lambda r: r["cpu_ms_per_step"]["outer"]),
            "rounds_per_repeat": med(lambda r: r["rounds"]),
            "refusals": sum(r["refusals"] for r in mine),
            "repeats": len(mine),
            "pairs": len(every),
        })
    return summary


def print_tables(rows: list[dict], summary: list[dict], target: float) -> None:
    """The per-repeat table and the table of medians against the target, in markdown."""
    print("\nper repeat (ratio: median over its pairs of island / baseline steps/s in adjacent slices; "
          "CPU ms/step: process CPU time over the slices / steps):\n")
    print("| config | repeat | baseline steps/s | island steps/s | ratio | pair ratios min-max | "
          "baseline CPU ms/step | island CPU ms/step | outer CPU ms/step | rounds |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratios = sorted(p["ratio"] for p in r["pairs"])
        c = r["cpu_ms_per_step"]
        print(f"| {r['config']} | {r['repeat']} | {r['baseline_steps_per_s']:.2f} | {r['island_steps_per_s']:.2f} | "
              f"{r['ratio_median']:.3f} | {ratios[0]:.3f}-{ratios[-1]:.3f} | {c['loop']:.1f} | {c['island']:.1f} | "
              f"{c['outer']:.1f} | {r['rounds']} |")
    print(f"\nmedians over repeats (target: ratio >= {target}; quartiles over every pair of every repeat):\n")
    print("| config | baseline steps/s | island steps/s | ratio | target met | pair ratio quartiles | "
          "baseline CPU ms/step | island CPU ms/step | outer CPU ms/step | refusals |")
    print("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for s in summary:
        met = "yes" if s["ratio"] >= target else "no"
        q = s["pair_ratio_quartiles"]
        print(f"| {s['config']} | {s['baseline_steps_per_s']:.2f} | {s['island_steps_per_s']:.2f} | "
              f"{s['ratio']:.3f} | {met} | {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} | {s['baseline_cpu_ms_per_step']:.1f} | "
              f"{s['island_cpu_ms_per_step']:.1f} | {s['outer_cpu_ms_per_step']:.1f} | {s['refusals']} |")


def main(argv: list[str] | None = None) -> int:
    """Measure every variant, print the tables, write the JSON."""
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    # The run's recipe as the driver builds it from a config: model.factory (--model) or the built-in preset.
    model = {"preset": args.preset, **({"factory": args.model} if args.model else {})}
    recipe = model_recipe(build_config({"model": model, "run": {"seed": args.seed}}))
    n_params = sum(p.numel() for p in instantiate(recipe.model, recipe.seed).parameters())
    inner = replace(inner_settings(build_config({})), batch_size=args.batch_size, torch_threads=args.torch_threads)
    corpus = load_stdlib_corpus(max_bytes=args.max_bytes)
    print(f"machine: {machine()}")
    print(f"date: {started.isoformat(timespec='seconds')}, load average at start: {os.getloadavg()}")
    print(METHOD_NOTE)
    print(f"model {args.model or args.preset} ({recipe.name}, {n_params:,} params, window {recipe.seq_len}), "
          f"batch {args.batch_size}, torch threads {args.torch_threads}, H={args.sync_every_steps}, "
          f"{args.repeats} repeats x {args.pairs} pairs of {args.slice_s:g} s slices "
          f"(after {args.warmup_steps} warm-up steps each)\n", flush=True)

    rows = run_all(args, recipe, inner, corpus)
    summary = summarise(rows)
    print_tables(rows, summary, args.target)
    print(f"\n{METHOD_NOTE}")
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "island_overhead", "date": started.isoformat(timespec="seconds"),
                       "machine": machine(), "note": METHOD_NOTE, "args": vars(args),
                       "target_ratio": args.target, "model": recipe.name, "params": n_params, "rows": rows, "summary": summary}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
