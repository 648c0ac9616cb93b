"""Data at scale: what a growing token-file corpus costs the driver, the start-up and the islands.

Run from the repository root, on a quiet machine (the load average is printed with the results)::

    python benchmarks/data_scale.py                # 0.1, 1 and 10 GB corpora, 3 repeats
    python benchmarks/data_scale.py --huge         # and one corpus larger than the machine's memory
    python benchmarks/data_scale.py --quick        # smoke run: 0.1 and 1 GB, 1 repeat, 2 pairs

Corpora: flat uint16 token files (vocabulary 256: the default byte model fits) of 0.1, 1 and 10 GB, and with
``--huge`` one of 1.1x MemTotal: standard-library source bytes tiled end to end, written in 64 MB chunks
under ``--dir`` and reused when a file of the right size is there. A size the free disk does not allow is
skipped, with the reason printed.

Per corpus, ``--repeats`` runs of ``diloco train --set data.source=tokens --set data.path=FILE ...`` (small
token budget, default model and pools: 4 islands and warm spares), each a subprocess that starts its own
local Ray (RAY_ADDRESS dropped, RAY_AUTH_MODE=disabled); corpora alternate within a repeat. Polled from /proc
every 0.25 s until the run exits: the driver's peak RSS (VmHWM of the ``diloco train`` process) and the max
over island processes (the driver's descendants titled ``ray::_IslandShell...``, spares included). From its
output: seconds from launch to the ``start-up ... first step`` line. Medians over repeats.

Then, in this process without Ray, torch at 1 thread: island 0's ``InnerTrainer`` (preset tiny) over the
``TokenStream`` of the file (``orchestrator.run.streams.corpus_stream``, as the driver builds it) against one
over a numpy array of the file (the old in-memory ``ShardSampler`` path; at most ``--in-memory-gb`` read:
its step cost does not depend on the array's length). Slices of ``data.block_batches`` steps (a stream
slice reads one shuffle block) alternate, the order flipping each pair; the ratio stream / in-memory is the
median over pairs. Target: >= 0.97. The old path also held the whole corpus in the driver (~31 B/token).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

GB = 10**9
CHUNK_TOKENS = 32 << 20  # 64 MB of uint16 ids per write
ISLAND_TITLES = ("_IslandShell", "_IslandWorker", "IslandActor", "LearnerIsland")  # orchestrator/actors/remote.py
_FIRST_STEP = re.compile(r"^start-up\s+[\d.]+s\s+first step")
TARGET = 0.97
WARMUP_STEPS = 10  # steps each trainer takes alone before the timed slices
MEASURED = ("driver_peak_rss_bytes", "first_step_s", "island_peak_rss_bytes")


def mem_total() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    return next(int(line.split()[1]) * 1024 for line in _proc("meminfo").splitlines() if line.startswith("MemTotal:"))


def machine() -> str:
    """One line: CPU, cores, memory, versions."""
    cpu = [line.split(":", 1)[1].strip() for line in _proc("cpuinfo").splitlines() if line.startswith("model name")]
    name = cpu[0] if cpu else platform.machine()
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("torch", "ray"))
    return (f"{name}, {os.cpu_count()} cores, {mem_total() / 2**30:.1f} GiB RAM, Python "
            f"{platform.python_version()}, {versions}")


def _sample() -> np.ndarray:
    """A few MB of standard-library source bytes as uint16 ids (deterministic for one Python)."""
    buf = bytearray()
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        buf += p.read_bytes()
        if len(buf) >= 4 << 20:
            break
    return np.frombuffer(bytes(buf), dtype=np.uint8).astype("<u2")


def _cached(directory: str, nbytes: int) -> tuple[str, bool]:
    """The path of the ``nbytes`` corpus under ``directory``, and whether it is there whole."""
    path = os.path.join(directory, f"tokens-{nbytes}.bin")
    return path, os.path.exists(path) and os.path.getsize(path) == nbytes


def make_corpus(directory: str, nbytes: int) -> tuple[str, str]:
    """(path, what happened) of the ``nbytes`` token file, written in chunks unless cached."""
    path, there = _cached(directory, nbytes)
    if there:
        return path, "reused"
    os.makedirs(directory, exist_ok=True)
    sample = _sample()
    big = np.tile(sample, CHUNK_TOKENS // len(sample) + 2)  # any window of CHUNK_TOKENS of the tiling
    t, total = time.monotonic(), nbytes // 2
    with open(path + ".partial", "wb") as f:  # renamed once whole: an interrupted write is never reused
        for done in range(0, total, CHUNK_TOKENS):
            f.write(memoryview(big[done % len(sample):][:min(CHUNK_TOKENS, total - done)]))
    os.replace(path + ".partial", path)
    return path, f"written in {time.monotonic() - t:.0f} s"


def plan_sizes(args: argparse.Namespace) -> tuple[list[tuple[str, int]], list[str]]:
    """(label, bytes) of the corpora to measure, and the reasons for those skipped (disk)."""
    sizes = [(f"{gb:g} GB", int(gb * GB) // 2 * 2) for gb in args.sizes]
    if args.huge:
        mem = mem_total()
        sizes.append((f"huge (> {mem / GB:.1f} GB RAM)", -(-int(mem * 1.1) // GB) * GB))
    existing = os.path.abspath(args.dir)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    keep, skipped = [], []
    for label, nbytes in sizes:
        missing = 0 if _cached(args.dir, nbytes)[1] else nbytes
        reserve = max(2 * GB, nbytes // 20)
        if missing + reserve > free:
            skipped.append(f"{label}: needs {missing / GB:.1f} GB + {reserve / GB:.1f} GB reserve, "
                           f"{free / GB:.1f} GB free under {args.dir}")
            continue
        free -= missing
        keep.append((label, nbytes))
    return keep, skipped


def _proc(rel: str) -> str:
    """/proc/REL as text, NULs as spaces ("" once the process is gone)."""
    try:
        with open(f"/proc/{rel}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _hwm(pid: int) -> int:
    """Peak resident set (VmHWM) of a live process in bytes, 0 if gone."""
    return next((int(line.split()[1]) * 1024 for line in _proc(f"{pid}/status").splitlines() if line.startswith("VmHWM:")), 0)


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if stat := _proc(f"{entry}/stat"):
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], list(kids.get(root, []))
    while todo:
        out.append(todo.pop())
        todo.extend(kids.get(out[-1], []))
    return out


class RssPoller:
    """Peak RSS (VmHWM) of the driver and of its island processes, polled until stopped."""

    def __init__(self, driver: int, period_s: float = 0.25) -> None:
        self.driver, self.period_s = driver, period_s
        self.driver_peak = 0
        self.islands: dict[int, int] = {}  # pid -> last VmHWM seen (it only grows)
        self.titles: dict[int, str] = {}  # pid -> its title when first seen as an island
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.period_s):
            self.driver_peak = max(self.driver_peak, _hwm(self.driver))
            if tick % 4 == 0:  # the tree walk reads every process's stat: once a second is enough
                for pid in _descendants(self.driver):
                    if pid not in self.islands and any(t in (title := _proc(f"{pid}/cmdline")) for t in ISLAND_TITLES):
                        self.islands[pid], self.titles[pid] = 0, title.split()[0]
            for pid in self.islands:
                self.islands[pid] = max(self.islands[pid], _hwm(pid))
            tick += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def train_run(path: str, run_dir: str, args: argparse.Namespace) -> dict:
    """One `diloco train` on the token file at ``path``: peak RSS of the driver and islands, first-step time."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])),
               RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    cmd = [sys.executable, "-m", "orchestrator.cli", "train", "--run-dir", run_dir]
    for o in overrides(path, args) + [f"run.token_budget={args.budget}"]:
        cmd += ["--set", o]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poller = RssPoller(proc.pid)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time() - t0, s.rstrip("\n")) for s in proc.stdout),
                              daemon=True)
    reader.start()
    try:
        rc = proc.wait(args.timeout)
    except subprocess.TimeoutExpired:  # SIGTERM: the driver stops its Ray; if it has not exited a minute later,
        rc = f"timed out after {args.timeout} s"  # it and its process tree (walked while it lives) are killed
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    poller.stop()
    reader.join(10)
    first = next((t for t, s in lines if _FIRST_STEP.match(s)), None)
    out = {"driver_peak_rss_bytes": poller.driver_peak or None, "first_step_s": first,
           "island_peak_rss_bytes": max(poller.islands.values(), default=0) or None, "islands_seen": len(poller.islands),
           "island_titles": sorted(poller.titles.values())}
    if rc != 0:
        out["error"] = f"exit {rc}: " + " | ".join(s for _, s in lines[-6:])
    return out


def overrides(path: str, args: argparse.Namespace) -> list[str]:
    return ["data.source=tokens", f"data.path={path}", "data.token_dtype=uint16", "data.vocab_size=256", *args.set]


def steps_per_s(path: str, nbytes: int, args: argparse.Namespace) -> dict:
    """Island 0's InnerTrainer over the TokenStream against one over an in-memory array, alternating slices."""
    import torch

    from islands.trainer import InnerTrainer
    from orchestrator.config import load_config
    from orchestrator.run.streams import corpus_stream
    from orchestrator.settings import inner_settings, model_recipe

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(path, args))
    recipe, inner = model_recipe(cfg), inner_settings(cfg)
    array = np.fromfile(path, dtype="<u2", count=min(nbytes, int(args.in_memory_gb * GB)) // 2)
    common = dict(settings=inner, shard_index=0, num_shards=cfg.num_islands, seed=cfg.run.seed)
    sides = {"in-memory": InnerTrainer(recipe, array, **common), "stream": InnerTrainer(recipe, corpus_stream(cfg).stream, **common)}
    for trainer in sides.values():
        for _ in range(WARMUP_STEPS):
            trainer.step()
    steps = cfg.data.block_batches
    rates: dict[str, list[float]] = {name: [] for name in sides}
    ratios = []
    for p in range(args.pairs):
        for name in (sides if p % 2 == 0 else reversed(list(sides))):
            t = time.perf_counter()
            for _ in range(steps):
                sides[name].step()
            rates[name].append(steps / (time.perf_counter() - t))
        ratios.append(rates["stream"][-1] / rates["in-memory"][-1])
    sides["stream"].sampler.close()
    return {"steps_per_s": statistics.median(rates["stream"]), "steps_per_s_in_memory": statistics.median(rates["in-memory"]),
            "ratio": statistics.median(ratios), "pair_ratios": ratios, "in_memory_tokens": len(array), "slice_steps": steps}


def _med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _f(v: float | None, scale: float = 1.0, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v / scale, fmt)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
        "examples:\n"
        "  python benchmarks/data_scale.py --json data_scale.json\n"
        "  python benchmarks/data_scale.py --huge --repeats 3          # + a corpus of 1.1x MemTotal (disk allowing)\n"
        "  python benchmarks/data_scale.py --quick                     # 0.1 and 1 GB, 1 repeat, 2 pairs: a smoke run\n"
        "  python benchmarks/data_scale.py --sizes 0.01 --repeats 1 --pairs 1   # a tiny end-to-end check\n"
        "  python benchmarks/data_scale.py --only steps --sizes 1 --pairs 8     # steps/s only"))
    ap.add_argument("--dir", default="/tmp/diloco-data-scale", help="where corpora are cached (default %(default)s)")
    ap.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="corpus sizes in GB (1e9 bytes), comma-separated (default 0.1,1,10; --quick 0.1,1)")
    ap.add_argument("--huge", action="store_true", help="add a corpus of 1.1x MemTotal, if the disk allows")
    ap.add_argument("--quick", action="store_true", help="0.1 and 1 GB only, 1 repeat, 2 pairs (unless given): not a measurement")
    ap.add_argument("--repeats", type=int, default=None, help="diloco train runs per corpus (default 3; --quick 1)")
    ap.add_argument("--pairs", type=int, default=None, help="alternating steps/s slice pairs per corpus (default 6; --quick 2)")
    ap.add_argument("--budget", type=int, default=200_000, help="run.token_budget of each run (default 200,000)")
    ap.add_argument("--in-memory-gb", type=float, default=1.0, help="most of a corpus the in-memory side reads (default 1)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds before a run is stopped (default 1200)")
    ap.add_argument("--only", choices=("train", "steps"), help="measure only the train runs or only steps/s")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override, both parts")
    ap.add_argument("--json", metavar="OUT", help="also write the rows (and every run) as JSON")
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ([0.1, 1.0] if args.quick else [0.1, 1.0, 10.0])
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.pairs = args.pairs or (2 if args.quick else 6)
    if min(args.repeats, args.pairs, args.budget, args.timeout) < 1 or min(args.sizes) <= 0:
        ap.error("--repeats, --pairs, --budget, --timeout and --sizes must be positive")
    return args


def measure_train(corpora: list[tuple[str, int, str]], args: argparse.Namespace) -> dict[int, list[dict]]:
    """`--repeats` rounds of one `diloco train` per corpus, corpora alternating."""
    runs: dict[int, list[dict]] = {nbytes: [] for _, nbytes, _ in corpora}
    with tempfile.TemporaryDirectory(prefix="diloco-data-scale-") as tmp:
        for r in range(args.repeats):
            for label, nbytes, path in corpora:
                runs[nbytes].append(got := train_run(path, os.path.join(tmp, f"run-{nbytes}-{r}"), args))
                print(f"{label} run {r + 1}: driver peak {_f(got['driver_peak_rss_bytes'], 2**20, '.0f')} MiB, first step "
                      f"{_f(got['first_step_s'])} s, island peak {_f(got['island_peak_rss_bytes'], 2**20, '.0f')} MiB "
                      f"({got['islands_seen']} island processes), load {os.getloadavg()[0]:.1f}"
                      + (f"\n  FAILED {got['error']}" if "error" in got else ""), flush=True)
    return runs


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n| corpus (uint16 ids) | runs ok | driver peak RSS MiB | first step s | island peak RSS MiB (max over islands) | "
          f"stream steps/s | in-memory steps/s | stream / in-memory | >= {TARGET} |")
    print("| --- | --- |" + " ---: |" * 6 + " --- |")
    for w in rows:
        met = "-" if w["ratio"] is None else ("yes" if w["ratio"] >= TARGET else "no")
        print(f"| {w['corpus']} ({w['corpus_bytes'] / 2:,.0f} tokens) | {w['runs_ok']} | {_f(w['driver_peak_rss_bytes'], 2**20, '.0f')} | "
              f"{_f(w['first_step_s'])} | {_f(w['island_peak_rss_bytes'], 2**20, '.0f')} | {_f(w['steps_per_s'], fmt='.2f')} | "
              f"{_f(w['steps_per_s_in_memory'], fmt='.2f')} | {_f(w['ratio'], fmt='.3f')} | {met} |")
    print(f"\nmedians of {args.repeats} `diloco train` runs (default model and pools, {args.budget:,} tokens) and of "
          f"{args.pairs} steps/s pairs (island 0, torch threads 1, no Ray); the in-memory side reads at most "
          f"{args.in_memory_gb:g} GB of a corpus")
    small, large = rows[0], rows[-1]
    if len(rows) > 1 and None not in (small["driver_peak_rss_bytes"], large["driver_peak_rss_bytes"]):
        extra = (large["corpus_bytes"] - small["corpus_bytes"]) / 2
        print(f"driver peak RSS, {small['corpus']} -> {large['corpus']}: {(large['driver_peak_rss_bytes'] - small['driver_peak_rss_bytes']) / 2**20:+.0f} "
              f"MiB for {extra:,.0f} more tokens (the old in-memory path, ~31 B/token: {31 * extra / 2**30:+.1f} GiB)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"machine: {machine()}\ndate: {started.isoformat(timespec='seconds')}, load average at start: {os.getloadavg()[0]:.2f}")
    sizes, skipped = plan_sizes(args)
    for reason in skipped:
        print(f"SKIPPED {reason}")
    corpora = []
    for label, nbytes in sizes:
        path, how = make_corpus(args.dir, nbytes)
        print(f"corpus {label}: {path} ({nbytes / 2:,.0f} tokens, {how})", flush=True)
        corpora.append((label, nbytes, path))
    runs = measure_train(corpora, args) if args.only != "steps" else {nbytes: [] for _, nbytes, _ in corpora}
    rows = []
    for label, nbytes, path in corpora:
        ok = [g for g in runs[nbytes] if "error" not in g]
        rows.append(row := {"corpus": label, "corpus_bytes": nbytes, **{k: _med(ok, k) for k in MEASURED}, "steps_per_s": None,
                            "steps_per_s_in_memory": None, "ratio": None, "runs_ok": f"{len(ok)}/{len(runs[nbytes])}", "runs": runs[nbytes]})
        if args.only != "train":
            row.update(steps_per_s(path, nbytes, args))
            print(f"{label} steps/s: stream {row['steps_per_s']:.2f}, in memory {row['steps_per_s_in_memory']:.2f}, ratio "
                  f"{row['ratio']:.3f} (pairs {', '.join(f'{x:.3f}' for x in row['pair_ratios'])})", flush=True)
    if rows:
        print_table(rows, args)
    for reason in skipped:
        print(f"skipped: {reason}")
    print(f"machine: {machine()}; load average at the end {os.getloadavg()[0]:.2f}")
    print("EMULATION: the default config's slow pool runs throttled (emulated slowdown), as every default run does")
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "data_scale", "date": started.isoformat(timespec="seconds"), "machine": machine(),
                       "args": vars(args), "skipped": skipped, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
