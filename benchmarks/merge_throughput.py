"""Outer merge throughput: the OuterOptimizer core closing rounds of a 50M-parameter model vs a plain copy.

The subject is what the outer optimizer's actor shell runs on its executor thread: ``receive`` for
K submissions of every fragment (decompress, checks, token weights, RDA merge, Nesterov outer step,
version ring push) until the ``RoundResult`` of the last fragment, timed from the first ``receive``.
The submissions (random outer gradients, compressed with the row's scheme) are built before the
timed region; what compressing costs an island is timed on its own and reported beside.

The baseline, measured in the same repeat (order alternating), is a plain copy of the same bytes:
for each of the K submissions, ``dst.copy_(src)`` of every fp32 tensor into preallocated buffers.
Both throughputs count merged bytes = K x the model's fp32 bytes, so int8 rows divide the same
bytes by the time to decode and merge them. Nothing is asserted; medians of ``--repeats``.

Peak RSS increase comes from one extra, untimed close per configuration: VmHWM during it minus
VmRSS before (Linux: free heap memory is first handed back with malloc_trim and the high-water mark
reset through /proc/self/clear_refs; elsewhere the getrusage high-water mark, which only grows). The
OuterOptimizer is built before that point, so its parameters and first ring entry are not counted;
decoded deltas, merge temporaries, momentum buffers (made on the first step), the new ring entry and
the result copy are.

Run from the repository root::

    python benchmarks/merge_throughput.py                      # 50m, P in {1,4}, K in {1,2,4}, none and int8
    python benchmarks/merge_throughput.py --quick              # smoke run, under a minute
    python benchmarks/merge_throughput.py --repeats 5 --json merge_throughput.json
    python benchmarks/merge_throughput.py --fragments 2 --islands 1 8 --schemes none bf16 int8 int4
    python benchmarks/merge_throughput.py --torch-threads 2    # the shell's actor runs with 1 (Ray's default)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
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


def merge_rounds(initial, plan, settings: OuterSettings, embedding_names, subs: list[list[Submission]],
                 *, peak_rss: bool = False) -> dict:
    """Seconds from the first receive to the last fragment's RoundResult, on a fresh OuterOptimizer.

    With ``peak_rss`` also the peak RSS increase; that run hands free heap memory back to the OS
    first, so its fresh pages fault in and its time is not one of the timed repeats.
    """
    core = OuterOptimizer(initial, plan, settings=settings, embedding_names=embedding_names, now=0.0)
    for k in range(len(subs)):
        core.register(k, 1)
    results, refusals = [], []
    gc.collect()
    with PeakRss(enabled=peak_rss) as peak:
        t0 = time.perf_counter()
        for p in range(plan.num_fragments):
            for island in subs:
                got, refusal = core.receive(island[p], 0.0)
                results.extend(got)
                if refusal is not None:
                    refusals.append(refusal.reason)
        seconds = time.perf_counter() - t0
    if refusals or sorted(r.fragment for r in results) != list(range(plan.num_fragments)):
        raise RuntimeError(f"expected one round per fragment and no refusals; got rounds for "
                           f"{[r.fragment for r in results]}, refusals {refusals[:2]}")
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
    ap.add_argument("--fragments", type=int, nargs="+", default=[1, 4], help="P values (default 1 4)")
    ap.add_argument("--islands", type=int, nargs="+", default=[1, 2, 4], help="K values (default 1 2 4)")
    ap.add_argument("--schemes", nargs="+", default=["none", "int8"], help="compression schemes (default none int8)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the outer actor has num_cpus=0, "
                         "so Ray sets OMP_NUM_THREADS=1)")
    ap.add_argument("--sync-every-steps", type=int, default=40,
                    help="H, only sets the submissions' counters (default 40)")
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
    cfg = model_config(args.preset)
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


def measure_round(args: argparse.Namespace, sub: Subject, scheme: str, P: int, K: int, wire: int,
                  subs_all: list[list[Submission]]) -> dict:
    """One row: `--repeats` merges and plain copies of K submissions (order alternating), then the peak RSS."""
    settings = dataclasses.replace(outer_settings(build_config({})), min_quorum=K,
                                   compression=scheme)  # closes when all K are in
    merged_bytes = K * sub.model.model_bytes
    reps = []
    for r in range(args.repeats):
        order = ("copy", "merge") if r % 2 == 0 else ("merge", "copy")
        got = {}
        for side in order:
            got[side] = (plain_copy(sub.deltas[:K], sub.dst) if side == "copy"
                         else merge_rounds(sub.model.initial, sub.plans[P], settings, sub.model.embedding_names, subs_all[:K]))
        reps.append({"repeat": r, "order": "/".join(order), "copy_s": got["copy"],
                     **{f"merge_{k}": v for k, v in got["merge"].items()}})
    copy_s = statistics.median(x["copy_s"] for x in reps)
    merge_s = statistics.median(x["merge_seconds"] for x in reps)
    peak = merge_rounds(sub.model.initial, sub.plans[P], settings, sub.model.embedding_names, subs_all[:K],
                        peak_rss=True)
    row = {
        "scheme": scheme, "P": P, "K": K, "merged_bytes": merged_bytes,
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
    print(f"\nround close, medians of {args.repeats} (GB/s of merged fp32 bytes = K x {model_bytes / 1e6:.1f} MB; "
          "ratio = median of per-repeat merge GB/s / copy GB/s):\n")
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
    print(f"model {args.preset}: {model.n_params:,} params, {model.model_bytes / 1e6:.1f} MB fp32 in {len(model.initial)} tensors; "
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
