"""Peak memory per worker of an FSDP island against unsharded islands of the same model (CPU, gloo).

Three islands of one model, each worker a fresh process, the real island code (islands/island.py):

- ``one worker``: a one-worker island, the unsharded reference;
- ``data parallel``: two workers that each hold the whole model (``shard: none``);
- ``fsdp``: two workers that each hold half of it (``shard: fsdp``, islands/fsdp.py).

Each worker builds its island (the model factory runs whole on every worker, then FSDP shards it),
then its peak resident set is reset (``/proc/self/clear_refs``) and it trains: the first boundary
adopts the initial version of every fragment, then ``--steps`` inner steps with a cut of each
fragment, a new version of every fragment adopted (a round), two more steps, and a stop with the
final flush; the leader's cuts are taken as they come, as the outer optimizer takes them. It
reports its peak resident set during that (``VmHWM``), the peak while it was built, its resident set
with torch imported before anything was built, and the bytes of parameters and AdamW state it holds
at the end. Global versions come through ``resolve`` as fresh tensors of one fragment
each, as a fetch from Ray's object store would (no whole model waits in the process beforehand).

Freed memory must leave the resident set for a peak to mean anything: glibc raises its mmap threshold
after freeing a large block (up to 32 MiB), and then keeps later tensors of that size on its heap after
they are freed. ``--mmap-threshold`` (default 128 KiB, glibc's starting value) holds it fixed in the
workers, so every tensor of 128 KiB or more is returned when freed; 0 leaves glibc's own behaviour.

Medians over ``--repeats`` repeats, the islands interleaved. Run from the repository root::

    python benchmarks/fsdp_memory.py --preset 50m --seq-len 64 --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

ISLANDS = {"one worker": (1, "none"), "data parallel": (2, "none"), "fsdp": (2, "fsdp")}


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def _shapes(preset: str, seq_len: int) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes without its memory (built on the meta device)."""
    import torch

    from islands.model import ByteTransformer, model_config

    with torch.device("meta"):
        model = ByteTransformer(model_config(preset, seq_len=seq_len))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _worker(rank: int, world: int, shard: str, preset: str, seq_len: int, steps: int, ports: Any, out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from islands.distributed import WorkerGroup
    from islands.follower import IslandFollower
    from islands.messages import FragmentUpdate
    from islands.model import model_config
    from islands.sharded_island import ShardedIsland
    from orchestrator.config import build_config
    from orchestrator.settings import inner_settings, island_specs, model_recipe
    from policies.fragments import plan_fragments

    imported_kib = _kib("VmRSS")
    cfg = model_config(preset, seq_len=seq_len)
    shapes = _shapes(preset, seq_len)
    plan = plan_fragments([(n, math.prod(s) * 4) for n, s in shapes.items()], 2)
    # The built-in config's settings (orchestrator.settings), as a run builds them, with these changes.
    run_cfg = build_config({"data": {"batch_size": 2}, "inner": {"warmup_steps": 0}, "outer": {"sync_every_steps": 4},
                            "health": {"salvage_every_steps": 0},
                            "pools": [{"name": "a", "workers_per_island": world, "shard": shard}]})
    inner = inner_settings(run_cfg, run_cfg.pools[0])
    spec = dataclasses.replace(island_specs(run_cfg, model_recipe(run_cfg, shape=cfg), plan)[0], num_islands=1)
    data = __import__("numpy").random.default_rng(0).integers(0, 256, size=200_000, dtype="uint8")

    def resolve(ref: tuple[int, int]) -> list[torch.Tensor]:
        """Fragment p of version v, made fresh (what a fetch from the object store hands over)."""
        p, version = ref
        g = torch.Generator().manual_seed(1000 * version + p)
        return [torch.randn(shapes[n], generator=g) * 0.02 for n in plan.fragments[p]]

    def versions(v: int) -> list[FragmentUpdate]:
        return [FragmentUpdate(p, v, [(p, v)]) for p in range(plan.num_fragments)]

    group = None
    if world > 1:
        if rank == 0:
            group = WorkerGroup(rank=0, world_size=world, addr="127.0.0.1", timeout_s=600)
            for _ in range(world - 1):
                ports.put(group.port)
        else:
            group = WorkerGroup(rank=rank, world_size=world, addr="127.0.0.1", port=ports.get(timeout=600), timeout_s=600)
    if rank > 0 and shard == "none":
        worker: Any = IslandFollower(model=spec.model, inner=inner, plan=plan, data=data, shard_index=0, num_shards=1,
                                     seed=0, group=group)
    else:
        worker = ShardedIsland(spec, data, versions(0) if rank == 0 else [], group=group, resolve=resolve)
        if shard == "fsdp":
            worker.build_shards()
    built_kib = _kib("VmHWM")
    _reset_peak()
    if rank > 0:
        worker.run()  # until the leader says stop
    else:
        # The leader's cuts are taken as they come, as the outer optimizer's poller takes them.
        worker.start()
        deadline = time.monotonic() + 1800
        while worker.status().steps < steps and time.monotonic() < deadline:
            _take(worker)
        for update in versions(1):  # a round: a new version of every fragment
            worker.adopt(update)
        while worker.status().steps < steps + 2 and time.monotonic() < deadline:
            _take(worker)
        stopping = threading.Thread(target=worker.stop, kwargs={"timeout_s": 600, "flush": True})
        stopping.start()
        while stopping.is_alive():
            _take(worker)
    trainer = worker.trainer
    held = sum(t.numel() * t.element_size() for t in _locals(trainer.params.values()))
    held += sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                for t in _locals(v for v in state.values() if isinstance(v, torch.Tensor)))
    out.put({"rank": rank, "peak_mib": _kib("VmHWM") / 1024, "built_mib": built_kib / 1024,
             "imported_mib": imported_kib / 1024, "held_mib": held / 2**20})


def _take(island: Any) -> None:
    """Take (and drop) every cut waiting in the island's outbox, then wait a little."""
    while island.next_submission(0.0) is not None:
        pass
    time.sleep(0.05)


def _locals(tensors: Any) -> list[Any]:
    from islands.fsdp import local_part

    return [local_part(t) for t in tensors]


def measure(name: str, preset: str, seq_len: int, steps: int) -> list[dict]:
    """One run of island `name`: a row per worker."""
    world, shard = ISLANDS[name]
    ctx = mp.get_context("spawn")
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, shard, preset, seq_len, steps, ports, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(120)
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="50m", help="Model preset (islands/spec.py PRESETS).")
    ap.add_argument("--seq-len", type=int, default=64, help="Tokens per sequence (short: memory is the point, not speed).")
    ap.add_argument("--steps", type=int, default=4, help="Inner steps before the round (H = 4, P = 2: each fragment cut once).")
    ap.add_argument("--repeats", type=int, default=3, help="Runs of each island, interleaved; medians are reported.")
    ap.add_argument("--mmap-threshold", type=int, default=128 * 1024,
                    help="glibc's MALLOC_MMAP_THRESHOLD_ in the workers, bytes; 0 = glibc's dynamic default.")
    ap.add_argument("--out", default=None, help="Also write every run's rows here as JSON.")
    args = ap.parse_args(argv)
    if args.mmap_threshold:  # the spawned workers inherit it; glibc reads it at start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    runs: dict[str, list[list[dict]]] = {name: [] for name in ISLANDS}
    for r in range(args.repeats):
        for name in ISLANDS:
            runs[name].append(measure(name, args.preset, args.seq_len, args.steps))
            print(f"repeat {r + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    shapes = _shapes(args.preset, args.seq_len)
    params = sum(math.prod(s) for s in shapes.values())
    threshold = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's dynamic mmap threshold"
    print(f"model {args.preset} (seq_len {args.seq_len}): {params / 1e6:.1f}M parameters, "
          f"{params * 4 / 2**20:.0f} MiB in float32; {threshold}; medians of {args.repeats} runs, MiB per worker\n")
    print("| island | worker | peak training | peak while built | torch imported | params + AdamW state held |")
    print("|---|---|---|---|---|---|")
    for name in ISLANDS:
        for rank in range(ISLANDS[name][0]):
            med = {k: statistics.median(run[rank][k] for run in runs[name])
                   for k in ("peak_mib", "built_mib", "imported_mib", "held_mib")}
            print(f"| {name} | {rank} | {med['peak_mib']:.0f} | {med['built_mib']:.0f} | {med['imported_mib']:.0f} "
                  f"| {med['held_mib']:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
