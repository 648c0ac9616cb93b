"""Start-up of a run: how long until `diloco train` says something, and until its first inner step.

Run from the repository root, on a quiet machine (the load average is printed with the results)::

    python benchmarks/startup.py                              # 3 default runs of this checkout
    python benchmarks/startup.py --compare ../main-checkout   # alternate with another code tree
    python benchmarks/startup.py --in-process                 # train() start-up against training time

Default mode: runs the DEFAULT config (4 islands in 2 pools, warm spares, everything as `diloco
train` does) as a user types it, `python -m orchestrator.cli train --set run.token_budget=...`, in a
subprocess that starts its own local Ray, `--repeats` times. From the wall clock of the subprocess's
start it takes: the first line of output (any), the first line of progress (a start-up stage line,
`start-up ...`, or a progress bar line; the EMULATION notice and Ray's own warnings do not count),
the first inner step (the first `training` mark on the run's event-log timeline: the health monitor
sees an island's first completed step, within its 0.25 s tick) and the exit. With `--compare TREE`
the same command runs in TREE (another checkout, e.g. `git worktree add --detach ../base main`)
alternately with this one, so both medians see the same load. The small token budget only shortens
the run after the first step; start-up is the default's.

The slow pool's speed is EMULATED (throttled), as in the default config.

`--in-process` keeps the older measurement: one local Ray started in this process, then `--repeats`
small `train()` calls (nano model, no warm spares), each's wall time against the training time its
summary reports (start-up plus final flush and teardown), as the test suite and notebooks pay it.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the
# Ray workers a local ray.init starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

_PROGRESS = re.compile(r"^(start-up |\[[#.]{24}\])")
_COLUMNS = ("first line s", "first progress s", "first step s", "exit s", "CPU s to first step")
_TICK = os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """CPU seconds of a process and its descendants (Ray's daemons and workers), sampled from /proc.

    CPU time to the first step is the load-robust part of start-up: on a busy machine the wall clock
    stretches with everyone else's work, the CPU each of our processes burns much less. Per process
    it keeps the CPU seen at each sample and its last title (Ray workers retitle themselves `ray::Class`).
    """

    def __init__(self, root: int, period_s: float = 0.25) -> None:
        self.root, self.period_s = root, period_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        names: dict[int, str] = {}
        while not self._stop.wait(self.period_s):
            now, seen = time.time(), {}
            for pid in self._tree():
                cpu, title = self._read(pid)
                if cpu is None:
                    continue
                if title and not title.startswith("ray::IDLE"):
                    names[pid] = title
                seen[pid] = (names.get(pid, title or "?"), cpu)
            self.samples.append((now, seen))

    def _tree(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(kids.get(pid, []))
        return out

    @staticmethod
    def _read(pid: int) -> tuple[float | None, str]:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            title = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            return None, ""
        return (int(fields[11]) + int(fields[12])) / _TICK, title

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()

    def by_kind(self, until: float) -> dict[str, float]:
        """CPU seconds per kind of process (`_kind`) up to wall time `until`: each process's last sample before it."""
        last: dict[int, tuple[str, float]] = {}
        for at, seen in self.samples:
            if at > until:
                break
            last.update(seen)
        kinds: dict[str, float] = {}
        for title, cpu in last.values():
            kinds[_kind(title)] = kinds.get(_kind(title), 0.0) + cpu
        return kinds


def _kind(title: str) -> str:
    """A short name for a process of a run, from its command line."""
    if title.startswith("ray::"):
        return title[5:].split()[0].split(":")[-1].split(".")[0]  # ray::NAME:Class.method -> Class
    if "default_worker.py" in title:  # before the names below: its arguments name the raylet
        return "worker (not started)"
    for known in ("orchestrator.cli", "gcs_server", "raylet", "log_monitor", "dashboard", "runtime_env", "monitor.py"):
        if known in title:
            return "driver" if known == "orchestrator.cli" else known
    return title.split()[0][-30:]


def _cli_run(tree: str, run_dir: str, budget: int) -> dict[str, float | None]:
    """One `diloco train` of the default config in `tree`: seconds from launch to each milestone."""
    # `tree` first, so that it, not an installed copy, is the project imported; the caller's PYTHONPATH after it
    # (packages installed outside site-packages, as on a machine where wheels are unpacked to a folder).
    path = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
    cmd = [sys.executable, "-m", "orchestrator.cli", "train", "--run-dir", run_dir,
           "--set", f"run.token_budget={budget}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = CpuSampler(proc.pid)
    lines: list[tuple[float, str]] = []

    def read(stream) -> None:
        for line in stream:
            lines.append((time.time() - t0, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    rc = proc.wait()
    exit_s = time.time() - t0
    sampler.stop()
    for r in readers:
        r.join()
    if rc != 0:
        tail = "\n".join(text for _, text in lines[-5:])
        raise RuntimeError(f"train in {tree} exited {rc}:\n{tail}")
    lines.sort()
    progress = [t for t, text in lines if _PROGRESS.match(text.lstrip("\r"))]
    first_step = _first_step_at(run_dir)
    cpu = sampler.by_kind(first_step)
    return {"first line s": lines[0][0] if lines else None, "first progress s": progress[0] if progress else None,
            "first step s": first_step - t0, "exit s": exit_s, "CPU s to first step": sum(cpu.values()), "cpu": cpu}


def _first_step_at(run_dir: str) -> float:
    """Wall time of the first `training` mark on the run's timeline (events/timeline)."""
    import pyarrow.parquet as pq

    ats = [at for part in glob.glob(os.path.join(run_dir, "events", "timeline", "part-*.parquet"))
           for at, state in zip(*pq.read_table(part, columns=["at", "state"]).to_pydict().values())
           if state == "training"]
    if not ats:
        raise RuntimeError(f"{run_dir}: no island reached 'training' on the timeline")
    return min(ats)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def cli_mode(args: argparse.Namespace) -> int:
    """Time the default `diloco train` (and `--compare` TREE's) `--repeats` times, alternately; print a table."""
    trees = [("this", _ROOT)] + ([("compare", os.path.abspath(args.compare))] if args.compare else [])
    rows: dict[str, list[dict]] = {name: [] for name, _ in trees}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as tmp:
        for r in range(args.repeats):
            for name, tree in trees:
                got = _cli_run(tree, os.path.join(tmp, f"{name}{r}"), args.budget)
                rows[name].append(got)
                print(f"{name} run {r + 1}: " + ", ".join(f"{k} {_fmt(got[k])}" for k in _COLUMNS),
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    load_after = os.getloadavg()
    print()
    print(f"| default `diloco train`, {args.budget:,} tokens | " + " | ".join(_COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(_COLUMNS))
    for name, _ in trees:
        for r, got in enumerate(rows[name], 1):
            print(f"| {name} run {r} | " + " | ".join(_fmt(got[c]) for c in _COLUMNS) + " |")
        med = [statistics.median(v) if (v := [g[c] for g in rows[name] if g[c] is not None]) else None
               for c in _COLUMNS]
        print(f"| **{name} median** | " + " | ".join(_fmt(m) for m in med) + " |")
    print()
    _cpu_table(rows)
    print()
    for name, tree in trees:
        print(f"{name}: {tree} ({_git_head(tree)})")
    print(f"load average (1, 5, 15 min) before: {_fmt_load(load_before)}; after: {_fmt_load(load_after)}; "
          f"{os.cpu_count()} CPUs")
    print("EMULATION: the default config's slow pool runs throttled (emulated slowdown), as every default run does")
    return 0


def _cpu_table(rows: dict[str, list[dict]]) -> None:
    """Median CPU seconds per kind of process before the first step, one column per code tree."""
    kinds = sorted({k for runs in rows.values() for got in runs for k in got["cpu"]},
                   key=lambda k: -max(statistics.median(g["cpu"].get(k, 0.0) for g in runs) for runs in rows.values()))
    print("| CPU s before the first step (median) | " + " | ".join(rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{statistics.median(g['cpu'].get(kind, 0.0) for g in runs):.1f}"
                                         for runs in rows.values()) + " |")


def _git_head(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                              timeout=10).stdout.strip()[:70] or "not a git checkout"
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"


def _fmt_load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def in_process_mode(args: argparse.Namespace) -> int:
    """The older measurement: `--repeats` small train() calls on one local Ray, start-up + stop against training."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
    import ray

    from orchestrator.actors.remote import WORKER_ENV
    from orchestrator.config import load_config
    from orchestrator.run.driver import emulation_note, train

    n = args.islands_per_pool
    cfg = load_config(None, [
        "model.preset=nano", f"run.token_budget={args.budget}", "eval.interval_s=1.0", "eval.batches=16",
        "outer.sync_every_steps=20", "health.warm_spares=0", "data.max_bytes=2000000",
        f"pools=[{{name: fast, islands: {n}, cpus_per_island: 0.5}},"
        f" {{name: slow, islands: {n}, cpus_per_island: 0.5, emulated_slowdown: 3.0, emulated_jitter: 0.1}}]",
    ])
    t = time.monotonic()
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
    print(f"ray.init: {time.monotonic() - t:.1f} s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-startup-") as tmp:
        for r in range(args.repeats):
            t = time.monotonic()
            summary = train(cfg, os.path.join(tmp, f"run{r}"))
            total = time.monotonic() - t
            rows.append((total, summary["wall_s"], total - summary["wall_s"]))
            print(f"run {r + 1}: train() {total:.1f} s, training {summary['wall_s']:.1f} s, "
                  f"start-up + stop {total - summary['wall_s']:.1f} s", flush=True)
    ray.shutdown()
    print()
    print(f"| {2 * n} islands, nano, {args.budget:,} tokens | train() s | training s | start-up + stop s |")
    print("| --- | ---: | ---: | ---: |")
    for r, (total, wall, rest) in enumerate(rows, 1):
        print(f"| run {r} | {total:.1f} | {wall:.1f} | {rest:.1f} |")
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"| median | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} |")
    print()
    print(emulation_note(cfg))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per code tree (default 3)")
    ap.add_argument("--budget", type=int, default=None,
                    help="tokens per run (default 100,000; --in-process: 200,000)")
    ap.add_argument("--compare", metavar="TREE", help="another checkout to time alternately with this one")
    ap.add_argument("--in-process", action="store_true", help="the older train()-in-this-process measurement")
    ap.add_argument("--islands-per-pool", type=int, default=1, help="--in-process: islands per pool (default 1)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.islands_per_pool < 1:
        ap.error("--repeats and --islands-per-pool must be >= 1")
    if args.compare and not os.path.isdir(os.path.join(args.compare, "orchestrator")):
        ap.error(f"--compare {args.compare}: not a checkout of this project (no orchestrator/ in it)")
    if args.in_process:
        args.budget = args.budget or 200_000
        return in_process_mode(args)
    args.budget = args.budget or 100_000
    return cli_mode(args)


if __name__ == "__main__":
    raise SystemExit(main())
