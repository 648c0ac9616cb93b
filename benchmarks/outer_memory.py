"""Outer optimizer memory: what it keeps, measured beside docs/outer.md's formula, on the 50m preset.

For each configuration (islands N, max_staleness S, uplink format, opt-ins) a fresh OuterOptimizer core
under the default settings (K = 1: every submission closes a partial round, so RDA's window across rounds
is built) takes two submissions of every fragment from every island, then:

- retained: the bytes of every tensor storage reachable from the core (orchestrator.core.memory), so a copy
  kept anywhere inside it counts; by kind (float32, and int8/uint8 wire tensors if any wait);
- rss: the process's resident growth over building the core and those rounds (VmRSS after handing free heap
  back to the OS with malloc_trim): the OS's view, which adds allocator slack and Python objects;
- peak: VmHWM over one more pass of every island's submissions minus VmRSS before it: one round's transients;
- formula: docs/outer.md's prediction, M + M + M_rda + T (+ T to decode int8/int4, + M averaging).

Beside the core, what the actor shell adds: the published versions in the object store (the wire bytes of
every fragment in the downlink's format, what ray.put stores) and, with outer.downlink_delta, the islands'
copies (policies.downlink.DownlinkCopies after a whole send and a difference to each of N islands). The
shell's other delta cost, the last 4 decoded versions it remembers, is 4 M by construction (not measured).

Run from the repository root::

    python benchmarks/outer_memory.py                   # 50m, P = 2 (the default), the configurations below
    python benchmarks/outer_memory.py --quick           # small preset, a smoke run
    python benchmarks/outer_memory.py --fragments 4 --json outer_memory.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import inspect
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402
from merge_throughput import PeakRss, _release_free_memory, _status_kb, machine  # noqa: E402

from islands.messages import Submission  # noqa: E402
from islands.model import build_model, model_config  # noqa: E402
from islands.model_api import embedding_parameter_names  # noqa: E402
from orchestrator.config import build_config  # noqa: E402
from orchestrator.core.memory import retained_tensor_bytes  # noqa: E402
from orchestrator.core.outer_optimizer import OuterOptimizer  # noqa: E402
from orchestrator.settings import outer_settings  # noqa: E402
from policies.compression import compress  # noqa: E402
from policies.downlink import DownlinkCopies  # noqa: E402
from policies.fragments import plan_fragments  # noqa: E402

MB = 1e6
NOTE = ("note: retained bytes are exact and repeatable; RSS growth and peaks are the OS's view on a machine shared "
        "with other work, one run each")
# (label, islands, uplink format, settings overrides): the default at three island counts, then one change each.
CONFIGS = [
    ("default", 2, "none", {}),
    ("default", 4, "none", {}),
    ("default", 8, "none", {}),
    ("max_staleness 16", 4, "none", {"max_staleness": 16}),
    ("int8 up", 4, "int8", {}),
    ("int4 up", 4, "int4", {}),
    ("K = all (full rounds)", 4, "none", {"min_quorum": 4, "grace_gamma": float("inf"), "grace_cap_s": float("inf")}),
    ("average_window 0.5", 4, "none", {"average_window": 0.5}),
]


def rss_mb() -> float:
    """VmRSS in MB after a garbage collection and handing free heap back to the OS."""
    gc.collect()
    _release_free_memory()
    return (_status_kb("VmRSS") or 0) / 1024 * 1.024  # kB -> MB (1e6 bytes)


def one_pass(core: OuterOptimizer, payloads: list[list[list]], islands: int) -> None:
    """Every island's submission of every fragment, measured from the current version, round by round."""
    for p in range(core.plan.num_fragments):
        for i in range(islands):
            sub = Submission(island=i, incarnation=1, seq=0, fragment=p, base_version=core.versions[p], tokens=8192,
                             inner_steps=40, step_time_s=0.1, train_loss=2.0, payload=payloads[i % len(payloads)][p])
            _, refusal = core.receive(sub, 0.0)
            if refusal is not None:
                raise RuntimeError(f"refused: {refusal.reason}")
    if any(core.pending_tokens()):  # K = all closes when the last island is in
        raise RuntimeError("a round is still open after every island submitted")


def measure_core(model: dict, plan, embedding_names, label: str, islands: int, scheme: str, overrides: dict,
                 deltas: list[dict]) -> dict:
    """One configuration's row (see the module docstring)."""
    settings = dataclasses.replace(outer_settings(build_config({})), compression=scheme, grace_cap_s=0.0)
    settings = dataclasses.replace(settings, **overrides)
    payloads = [[[compress(d[n], scheme) for n in names] for names in plan.fragments] for d in deltas]
    live = {"copy_results": False} if "copy_results" in inspect.signature(OuterOptimizer).parameters else {}
    before = rss_mb()
    core = OuterOptimizer(model, plan, settings=settings, embedding_names=embedding_names, **live)
    for i in range(islands):
        core.register(i, 1)
    for _ in range(2):
        one_pass(core, payloads, islands)
    after = rss_mb()
    with PeakRss() as peak:
        one_pass(core, payloads, islands)
    retained = retained_tensor_bytes(core, by_kind=True)
    assert isinstance(retained, dict)
    row = {"config": label, "islands": islands, "uplink": scheme, "overrides": {k: str(v) for k, v in overrides.items()},
           "retained_mb": sum(retained.values()) / MB, "retained_by_kind_mb": {k: v / MB for k, v in retained.items()},
           "rss_mb": after - before, "peak_round_mb": peak.mb}
    del core
    return row


def formula_mb(model_bytes: int, rda_bytes: int, largest: int, *, scheme: str, overrides: dict) -> float:
    """docs/outer.md: M (parameters) + M (momentum) + M_rda (partial rounds) + M (averaging) + T (+ T decoding)."""
    partial = overrides.get("min_quorum", 1) == 1
    total = 2 * model_bytes + (rda_bytes if partial else 0) + (model_bytes if overrides.get("average_window") else 0)
    total += largest * (2 if scheme in ("int8", "int4") else 1)
    return total / MB


def measure_downlink(model: dict, plan, islands: int) -> dict:
    """Bytes DownlinkCopies keeps for `islands` islands (int4 differences) after a whole send and a difference each."""
    frags = [[model[n] for n in names] for names in plan.fragments]
    copies = DownlinkCopies("none", "int4")
    for i in range(islands):
        for p, frag in enumerate(frags):
            copies.encode(i, 1, p, 1, frag)
            copies.encode(i, 1, p, 2, [t + 1e-3 for t in frag])
    return {"islands": islands, "retained_mb": retained_tensor_bytes(copies) / MB}


def main(argv: list[str] | None = None) -> int:
    """Measure every configuration; print the tables; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--fragments", type=int, default=2, help="P (default 2, the config's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small preset (a smoke run, not a measurement)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset = "small"
    torch.set_num_threads(1)
    started = datetime.datetime.now(datetime.timezone.utc)
    net = build_model(model_config(args.preset), seed=args.seed)
    model = {n: p.detach().clone() for n, p in net.named_parameters()}
    embedding_names = embedding_parameter_names(net)
    del net
    plan = plan_fragments([(n, t.numel() * 4) for n, t in model.items()], args.fragments)
    model_bytes = sum(t.numel() * 4 for t in model.values())
    rda_bytes = sum(t.numel() * 4 for n, t in model.items() if n not in embedding_names)
    largest = max(t.numel() * 4 for t in model.values())
    gen = torch.Generator().manual_seed(args.seed + 1)
    deltas = [{n: torch.randn(t.shape, generator=gen).mul_(1e-3) for n, t in model.items()} for _ in range(2)]
    print(f"machine: {machine()}")
    print(f"date: {started.isoformat(timespec='seconds')}, load average at start: {os.getloadavg()}")
    print(NOTE)
    print(f"model {args.preset}: M = {model_bytes / MB:.1f} MB fp32, M_rda = {rda_bytes / MB:.1f} MB (not embeddings), "
          f"largest tensor T = {largest / MB:.2f} MB; P = {args.fragments}\n", flush=True)

    # Once, unrecorded: first use imports torch's optimizer machinery and sizes the allocator's pools.
    measure_core(model, plan, embedding_names, *CONFIGS[0], deltas)
    rows = []
    for label, islands, scheme, overrides in CONFIGS:
        t0 = time.perf_counter()
        row = measure_core(model, plan, embedding_names, label, islands, scheme, overrides, deltas)
        row["formula_mb"] = formula_mb(model_bytes, rda_bytes, largest, scheme=scheme, overrides=overrides)
        rows.append(row)
        print(f"  {label}, N = {islands}, {scheme} up: retained {row['retained_mb']:.1f} MB, formula "
              f"{row['formula_mb']:.1f} MB, RSS +{row['rss_mb']:.0f} MB ({time.perf_counter() - t0:.0f} s)", flush=True)

    published = {}
    for fmt in ("none", "bf16", "int8"):
        copies = DownlinkCopies(fmt)
        published[fmt] = sum(sum(t.nbytes for t in copies.whole([model[n] for n in names])) for names in plan.fragments) / MB
    downlink = [measure_downlink(model, plan, n) for n in (2, 4, 8)]

    print(f"\nthe core after two rounds per island and fragment (M = {model_bytes / MB:.1f} MB):\n")
    print("| configuration | N | uplink | retained MB | x M | formula MB | RSS growth MB | one pass's peak +MB |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        peak = "n/a" if r["peak_round_mb"] is None else f"{r['peak_round_mb']:.0f}"
        print(f"| {r['config']} | {r['islands']} | {r['uplink']} | {r['retained_mb']:.1f} | "
              f"{r['retained_mb'] / (model_bytes / MB):.2f} | {r['formula_mb']:.1f} | {r['rss_mb']:.0f} | {peak} |")
    print("\nwhat the shell adds: published versions in the object store (the latest of every fragment):\n")
    print("| outer.downlink | MB | x M |")
    print("| --- | ---: | ---: |")
    for fmt, mb in published.items():
        print(f"| {fmt} | {mb:.1f} | {mb / (model_bytes / MB):.2f} |")
    print("\nand with outer.downlink_delta, the islands' copies (DownlinkCopies), plus 4 M of remembered versions:\n")
    print("| N | copies MB | x M |")
    print("| ---: | ---: | ---: |")
    for d in downlink:
        print(f"| {d['islands']} | {d['retained_mb']:.1f} | {d['retained_mb'] / (model_bytes / MB):.2f} |")
    print(f"\n{NOTE}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "outer_memory", "date": started.isoformat(timespec="seconds"), "machine": machine(),
                       "args": vars(args), "model_bytes": model_bytes, "rda_bytes": rda_bytes, "largest_bytes": largest,
                       "core": rows, "published_mb": published, "downlink_copies": downlink}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
