"""Outer merge throughput: the OuterOptimizer core closing rounds of a 50M-parameter model vs a plain copy.

The subject is what the outer optimizer's actor shell runs on its executor thread: ``receive`` for
K submissions of every fragment (checks, decode, token weights, RDA merge, Nesterov outer step)
until the ``RoundResult`` of the last fragment, timed from the first ``receive``, on a core that has
closed one round of every fragment before (untimed), so that its momentum and buffers exist as in a
running job. The core hands out its live tensors (``copy_results=False``, what the actor asks for;
a core that predates the option copies them); the actor then puts each new version in the object
store, a copy of the fragment that neither side of the comparison includes. The submissions (random
outer gradients, compressed with the row's scheme) are built before the timed region; what
compressing costs an island is timed on its own and reported beside.

The baseline, measured in the same repeat (order alternating), is a plain copy of the same bytes:
for each of the K submissions, ``dst.copy_(src)`` of every fp32 tensor into preallocated buffers.
Both throughputs count merged bytes = K x the model's fp32 bytes, so int8 rows divide the same
bytes by the time to decode and merge them. Nothing is asserted; medians of ``--repeats``.

Peak RSS increase comes from one extra close per configuration, untimed: VmHWM during its second
round minus VmRSS before it (Linux: free heap memory is first handed back with malloc_trim and the
high-water mark reset through /proc/self/clear_refs; elsewhere the getrusage high-water mark, which
only grows). What the core keeps (parameters, momentum, buffers) exists by then and is not counted;
what one round allocates and frees is (decoded deltas, merge temporaries, copies).

``--live-islands N`` registers N islands, so that rounds of K < N are partial (share K / N) and fold
into RDA's window across rounds, as the default K = 1 does in a run; by default N = K (full rounds).
``--profile`` prints a cProfile of one timed round of the first configuration before measuring.

Run from the repository root::

    python benchmarks/merge_throughput.py                      # 50m, P in {1,4}, K in {1,2,4}, none and int8
    python benchmarks/merge_throughput.py --quick              # smoke run, under a minute
    python benchmarks/merge_throughput.py --repeats 5 --json merge_throughput.json
    python benchmarks/merge_throughput.py --fragments 2 --islands 1 8 --schemes none bf16 int8 int4
    python benchmarks/merge_throughput.py --torch-threads 2    # the shell's actor runs with 1 (Ray's default)
    python benchmarks/merge_throughput.py --islands 1 --live-islands 4   # the default K = 1, partial rounds
    python benchmarks/merge_throughput.py --profile --schemes int8 --fragments 1 --islands 4
    python benchmarks/merge_throughput.py --d-model 2048 --n-layers 1 --fragments 1 --schemes none int8 int4
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import dataclasses
import datetime
import gc
import inspect
import io
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import time
from typing import NamedTuple

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402

from islands.messages import Submission  # noqa: E402
from islands.model import ModelConfig, build_model, model_config  # noqa: E402
from islands.model_api import embedding_parameter_names  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings  # noqa: E402
from orchestrator.settings import outer_settings  # noqa: E402
from policies.compression import compress  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402

SHARED_NOTE = ("note: the 2-core machine is shared with other work; the numbers are medians of "
               "interleaved repeats, and single repeats can be off by several percent")
DELTA_STD = 1e-3  # size of the random outer gradients; any finite non-zero value does the same work


# ---------------------------------------------------------------- memory

def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory() -> None:
    """Hand memory the allocator holds but no tensor uses back to the OS (glibc), so reuse is not hidden."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Peak RSS increase over a block, in MB: VmHWM after minus VmRSS before (None when not enabled)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.mb = None

    def __enter__(self) -> PeakRss:
        if not self.enabled:
            return self
        _release_free_memory()
        self.exact = _reset_peak() and _status_kb("VmHWM") is not None
        self.before_kb = _status_kb("VmRSS") if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        after = _status_kb("VmHWM") if self.exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if after is not None and self.before_kb is not None:
            self.mb = (after - self.before_kb) / 1024


# ---------------------------------------------------------------- inputs

def random_deltas(shapes: dict[str, torch.Size], islands: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """One dict of fp32 random outer gradients per island, drawn from a local generator."""
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=gen).mul_(DELTA_STD) for n, s in shapes.items()} for _ in range(islands)]


def time_compress(deltas: dict[str, torch.Tensor], scheme: str, repeats: int) -> float:
    """Median seconds to compress one island's whole model with ``scheme``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d in deltas.values():
            compress(d, scheme)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_submissions(payloads: list[dict], plan, *, sync_every_steps: int,
                      tokens_per_step: int) -> list[list[Submission]]:
    """``subs[k][p]``: island k's submission of fragment p, measured from version 0."""
    steps = sync_every_steps  # every fragment is submitted once per H steps
    return [[Submission(island=k, incarnation=1, seq=p, fragment=p, base_version=0, tokens=steps * tokens_per_step,
                        inner_steps=steps, step_time_s=0.1, train_loss=2.0,
                        payload=[payloads[k][n] for n in names], created_at=time.time())
             for p, names in enumerate(plan.fragments)]
            for k in range(len(payloads))]


# ---------------------------------------------------------------- the two timed regions

def plain_copy(deltas: list[dict[str, torch.Tensor]], dst: dict[str, torch.Tensor]) -> float:
    """Seconds to copy every tensor of every submission into ``dst`` (preallocated, touched)."""
    t0 = time.perf_counter()
    for island in deltas:
        for n, src in island.items():
            dst[n].copy_(src)
    return time.perf_counter() - t0


def _core(initial, plan, settings: OuterSettings, embedding_names) -> OuterOptimizer:
    """A fresh core that hands out its live tensors, as the actor asks (an older core copies them)."""
    live = {"copy_results": False} if "copy_results" in inspect.signature(OuterOptimizer).parameters else {}
    return OuterOptimizer(initial, plan, settings=settings, embedding_names=embedding_names, now=0.0, **live)


def _close_round(core: OuterOptimizer, subs: list[list[Submission]]) -> list:
    """Every island's submission of every fragment, measured from its current version; the RoundResults."""
    results, refusals = [], []
    for p in range(core.plan.num_fragments):
        for island in subs:
            got, refusal = core.receive(dataclasses.replace(island[p], base_version=core.versions[p]), 0.0)
            results.extend(got)
            if refusal is not None:
                refusals.append(refusal.reason)
    if refusals or sorted(r.fragment for r in results) != list(range(core.plan.num_fragments)):
        raise RuntimeError(f"expected one round per fragment and no refusals; got rounds for "
                           f"{[r.fragment for r in results]}, refusals {refusals[:2]}")
    return results


def merge_rounds(initial, plan, settings: OuterSettings, embedding_names, subs: list[list[Submission]],
                 *, live_islands: int, peak_rss: bool = False, profile: bool = False) -> dict:
    """Seconds from the first receive to the last fragment's RoundResult of a fresh core's second round.

    The first round (untimed) makes what a running core holds: momentum buffers, merge buffers, RDA's
    window under partial rounds. With ``peak_rss`` also the peak RSS increase over the second round; that
    run hands free heap memory back to the OS first, so its fresh pages fault in and its time is not one of
    the timed repeats. With ``profile`` the second round runs under cProfile, printed.
    """
    core = _core(initial, plan, settings, embedding_names)
    for k in range(max(live_islands, len(subs))):
        core.register(k, 1)
    _close_round(core, subs)
    gc.collect()
    prof = cProfile.Profile() if profile else None
    with PeakRss(enabled=peak_rss) as peak:
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        results = _close_round(core, subs)
        seconds = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        print(text.getvalue(), flush=True)
    merge_s = sum(r.record.merge_s for r in results)
    del core, results
    return {"seconds": seconds, "merge_s": merge_s, "peak_rss_mb": peak.mb}


# ---------------------------------------------------------------- reporting

def machine() -> str:
    """One line naming the CPU, cores and versions."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; --quick fills in what was not given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="examples:\n" + __doc__.split("::\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per configuration (median; default 3)")
    ap.add_argument("--preset", default="50m", help="model preset (default 50m, about 51M parameters)")
    ap.add_argument("--d-model", type=int, default=None,
                    help="override the preset's width, e.g. 2048 with --n-layers 1: 50M parameters in tensors of "
                         "up to 16.8M elements, larger than the CPU's caches as a 12B model's are")
    ap.add_argument("--n-layers", type=int, default=None, help="override the preset's depth")
    ap.add_argument("--fragments", type=int, nargs="+", default=[1, 4], help="P values (default 1 4)")
    ap.add_argument("--islands", type=int, nargs="+", default=[1, 2, 4], help="K values (default 1 2 4)")
    ap.add_argument("--schemes", nargs="+", default=["none", "int8"], help="compression schemes (default none int8)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the outer actor has num_cpus=0, "
                         "so Ray sets OMP_NUM_THREADS=1)")
    ap.add_argument("--live-islands", type=int, default=None,
                    help="islands registered (default: K, full rounds); more makes rounds of K partial")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of one round of the first configuration before measuring")
    ap.add_argument("--sync-every-steps", type=int, default=40,
                    help="H, only sets the submissions' counters (default 40)")
    ap.add_argument("--poison-guard", action="store_true",
                    help="judge every submission with the poison guard (outer.poison_guard, opt-in): its cost. "
                         "Off by default, as in a run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: preset small, P=2, K in {1,2}, 1 repeat (not a measurement)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    given = argv if argv is not None else sys.argv
    if args.quick:
        if "--preset" not in given:
            args.preset = "small"
        if "--fragments" not in given:
            args.fragments = [2]
        if "--islands" not in given:
            args.islands = [1, 2]
        if "--repeats" not in given:
            args.repeats = 1
    if args.repeats < 1 or min(args.islands) < 1 or min(args.fragments) < 1:
        ap.error("--repeats, --islands and --fragments must all be >= 1")
    if args.live_islands is not None and args.live_islands < max(args.islands):
        ap.error(f"--live-islands {args.live_islands} is fewer than K = {max(args.islands)}; give at least the largest K")
    return args


class Model(NamedTuple):
    """The model whose rounds are closed: its initial parameters, embedding names and size."""

    # A NamedTuple, not a dataclass: tests load benchmarks by file path, without the sys.modules entry a dataclass needs.
    cfg: ModelConfig
    initial: dict[str, torch.Tensor]
    embedding_names: list[str]
    model_bytes: int  # fp32 bytes of the whole model
    n_params: int


class Subject(NamedTuple):
    """The model and the inputs every configuration shares."""

    model: Model
    deltas: list[dict[str, torch.Tensor]]  # a random outer gradient per island, max(K) of them
    dst: dict[str, torch.Tensor]  # the plain copy's preallocated, touched buffers
    plans: dict  # P -> fragment plan


def load_model(args: argparse.Namespace) -> Model:
    """The preset's model, built from the seed."""
    overrides = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.n_layers)) if v is not None}
    cfg = model_config(args.preset, **overrides)
    model = build_model(cfg, seed=args.seed)
    initial = {n: p.detach() for n, p in model.named_parameters()}
    return Model(cfg=cfg, initial=initial, embedding_names=embedding_parameter_names(model),
                 model_bytes=sum(t.numel() * t.element_size() for t in initial.values()),
                 n_params=sum(t.numel() for t in initial.values()))


def build_subject(args: argparse.Namespace, model: Model) -> Subject:
    """`model` with its random outer gradients, the copy buffers and a fragment plan per P."""
    initial = model.initial
    return Subject(
        model=model,
        deltas=random_deltas({n: t.shape for n, t in initial.items()}, max(args.islands), args.seed + 1),
        dst={n: torch.zeros_like(t) for n, t in initial.items()},  # preallocated and touched
        plans={P: plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], P)
               for P in args.fragments})


def round_settings(scheme: str, K: int, poison_guard: bool = False) -> OuterSettings:
    """The default outer settings, closing a round as soon as K islands are in (no grace: the clock stands still),
    the poison guard as asked (its first round waits for three islands, which the timed rounds do not model)."""
    return dataclasses.replace(outer_settings(build_config({})), min_quorum=K, compression=scheme, grace_cap_s=0.0,
                               poison_guard=poison_guard)


def measure_round(args: argparse.Namespace, sub: Subject, scheme: str, P: int, K: int, wire: int,
                  subs_all: list[list[Submission]]) -> dict:
    """One row: `--repeats` merges and plain copies of K submissions (order alternating), then the peak RSS."""
    settings = round_settings(scheme, K, args.poison_guard)
    live = args.live_islands or K
    merged_bytes = K * sub.model.model_bytes
    reps = []
    for r in range(args.repeats):
        order = ("copy", "merge") if r % 2 == 0 else ("merge", "copy")
        got = {}
        for side in order:
            got[side] = (plain_copy(sub.deltas[:K], sub.dst) if side == "copy"
                         else merge_rounds(sub.model.initial, sub.plans[P], settings, sub.model.embedding_names,
                                           subs_all[:K], live_islands=live))
        reps.append({"repeat": r, "order": "/".join(order), "copy_s": got["copy"],
                     **{f"merge_{k}": v for k, v in got["merge"].items()}})
    copy_s = statistics.median(x["copy_s"] for x in reps)
    merge_s = statistics.median(x["merge_seconds"] for x in reps)
    peak = merge_rounds(sub.model.initial, sub.plans[P], settings, sub.model.embedding_names, subs_all[:K],
                        live_islands=live, peak_rss=True)
    row = {
        "scheme": scheme, "P": P, "K": K, "live_islands": live, "merged_bytes": merged_bytes,
        "wire_bytes": K * wire, "merge_s": merge_s, "copy_s": copy_s,
        "merge_gb_per_s": merged_bytes / merge_s / 1e9, "copy_gb_per_s": merged_bytes / copy_s / 1e9,
        "ratio": statistics.median(x["copy_s"] / x["merge_seconds"] for x in reps),
        "round_merge_s": statistics.median(x["merge_merge_s"] for x in reps),
        "peak_rss_mb": peak["peak_rss_mb"],
        "repeats": reps,
    }
    print(f"  {scheme} P={P} K={K}: merge {merge_s:.3f} s ({row['merge_gb_per_s']:.2f} GB/s), "
          f"copy {copy_s:.3f} s ({row['copy_gb_per_s']:.2f} GB/s), ratio {row['ratio']:.3f}", flush=True)
    return row


def measure_scheme(args: argparse.Namespace, sub: Subject, scheme: str) -> tuple[dict, list[dict]]:
    """The compress cost of `scheme` and a round-close row for every P and K."""
    seconds = time_compress(sub.deltas[0], scheme, args.repeats)
    payloads = [{n: compress(d, scheme) for n, d in island.items()} for island in sub.deltas]
    wire = sum(c.nbytes for c in payloads[0].values())
    model_bytes = sub.model.model_bytes
    compress_row = {"scheme": scheme, "seconds": seconds, "gb_per_s": model_bytes / seconds / 1e9,
                    "wire_mb_per_island": wire / 1e6}
    print(f"  compress {scheme}: {seconds:.3f} s per island ({model_bytes / seconds / 1e9:.2f} GB/s), "
          f"{wire / 1e6:.1f} MB on the wire", flush=True)
    rows = []
    for P in args.fragments:
        subs_all = build_submissions(payloads, sub.plans[P], sync_every_steps=args.sync_every_steps,
                                     tokens_per_step=16 * sub.model.cfg.seq_len)
        for K in args.islands:
            if args.profile and not rows and scheme == args.schemes[0] and P == args.fragments[0]:
                print(f"  profile of one round, {scheme} P={P} K={K}:", flush=True)
                merge_rounds(sub.model.initial, sub.plans[P], round_settings(scheme, K, args.poison_guard), sub.model.embedding_names,
                             subs_all[:K], live_islands=args.live_islands or K, profile=True)
            rows.append(measure_round(args, sub, scheme, P, K, wire, subs_all))
        del subs_all
    del payloads
    gc.collect()
    return compress_row, rows


def print_tables(args: argparse.Namespace, model_bytes: int, compress_rows: list[dict], rows: list[dict]) -> None:
    """The compress-cost table and the round-close table, in markdown."""
    print("\ncompress cost per island (whole model, paid by islands, not in the merge time):\n")
    print("| scheme | s per island | GB/s of fp32 input | MB on the wire |")
    print("| --- | ---: | ---: | ---: |")
    for c in compress_rows:
        print(f"| {c['scheme']} | {c['seconds']:.3f} | {c['gb_per_s']:.2f} | {c['wire_mb_per_island']:.1f} |")
    live = f"{args.live_islands} live islands (partial rounds)" if args.live_islands else "K live islands (full rounds)"
    print(f"\nround close, medians of {args.repeats}, torch threads {torch.get_num_threads()} (both sides), {live} "
          f"(GB/s of merged fp32 bytes = K x {model_bytes / 1e6:.1f} MB; ratio = median of per-repeat merge GB/s / "
          "copy GB/s):\n")
    print("| scheme | P | K | merged MB | merge s | merge GB/s | copy s | copy GB/s | ratio | peak RSS +MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        peak = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] is not None else "n/a"
        print(f"| {r['scheme']} | {r['P']} | {r['K']} | {r['merged_bytes'] / 1e6:.0f} | {r['merge_s']:.3f} | "
              f"{r['merge_gb_per_s']:.2f} | {r['copy_s']:.3f} | {r['copy_gb_per_s']:.2f} | {r['ratio']:.3f} | {peak} |")


def main(argv: list[str] | None = None) -> int:
    """Measure every scheme, P and K; print the tables; write the JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    model = load_model(args)
    print(f"machine: {machine()}")
    print(f"date: {started.isoformat(timespec='seconds')}, load average at start: {os.getloadavg()}")
    print(SHARED_NOTE)
    shape = f" (d_model {model.cfg.d_model}, {model.cfg.n_layers} layers)" if args.d_model or args.n_layers else ""
    largest = max(t.numel() for t in model.initial.values())
    print(f"model {args.preset}{shape}: largest tensor {largest:,} elements; {model.n_params:,} params, "
          f"{model.model_bytes / 1e6:.1f} MB fp32 in {len(model.initial)} tensors; "
          f"torch threads {torch.get_num_threads()}; {args.repeats} repeats\n", flush=True)

    sub = build_subject(args, model)
    compress_rows, rows = [], []
    for scheme in args.schemes:
        compress_row, scheme_rows = measure_scheme(args, sub, scheme)
        compress_rows.append(compress_row)
        rows.extend(scheme_rows)

    print_tables(args, model.model_bytes, compress_rows, rows)
    print(f"\n{SHARED_NOTE}")
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "merge_throughput", "date": started.isoformat(timespec="seconds"),
                       "machine": machine(), "note": SHARED_NOTE, "args": vars(args),
                       "model": {"preset": args.preset, "params": model.n_params, "fp32_bytes": model.model_bytes},
                       "torch_threads": torch.get_num_threads(), "compress": compress_rows, "rounds": rows},
                      f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
