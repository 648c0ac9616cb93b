"""Soak: 8 islands of the nano model under Poisson faults of every kind for an hour (issue 60, item 2).

One run on a local Ray cluster (`ray.cluster_utils.Cluster`: a head with no CPU, where the driver, the outer
optimizer, the health monitor and the chaos injector live, and --nodes 1-CPU worker nodes labelled pool=soak, two
island slots each). A Poisson tape (`policies.chaos.poisson_tape`) fires a fault every --mean-gap-s seconds on
average across the run, of every kind: island kill, node loss, hang, slowdown, bad submission (a corrupted and a
dropped one), outer optimizer kill and monitor kill (the last two once per run, not per island). A lost node is
replaced: a new labelled node is added to the cluster a moment after the GCS marks one dead (EMULATION of a cloud's
replacement VM; every "machine" is a process tree on this one machine), so capacity does not run out over an hour.

Sampled every --sample-s seconds: the resident set (RSS, psutil) of the driver, the outer optimizer's process, the
health monitor's and every island process (warm spares included), and the object store's use (the raylets'
FormatGlobalMemoryInfo, as `ray memory --stats-only` reads it: `ray._private.internal_api.get_memory_info_reply`,
which needs no dashboard on Ray 2.60). After a warm-up (the first --warmup fraction of the run) a least-squares line
gives each kind's slope in MB per hour; the islands' series is the largest island process at each sample (a per-process
figure, like the bound; the mean island process's slope is reported too: their sum follows how many are up). Asserted (exit 1 if any fails):

  fates exact        summary.json's token ledger: in every fragment, processed = merged + refused + in flight + lost +
                     overwritten, and every fate >= 0
  RSS flat           each slope (driver, outer, islands) under the bound: --rss-bound-mb-per-h (50) or what
                     --rss-noise-mb (25) of allocator noise reads as over the fitted window, whichever is larger
  object store flat  its slope under --store-bound-mb-per-h (50)
  nothing left       no actor alive, no placement group not removed (after the run's teardown), and no process of the
                     run (every actor process and Ray process seen during it) alive once Ray and the cluster are shut down
  learns             the final held-out bits/byte at most --learn-ratio (0.8) of the run's first evaluation (the
                     untrained model's)
  faults             at least --min-faults-per-min (700 an hour) faults fired per minute of the run; a fault due while
                     its island is down hits the next live island (Fault.retarget; --wait-for-island: it waits)

Reported besides: goodput and uptime (summary.json), failures, restarts, nodes replaced, the peaks. Writes --json
with at least {"faults", "fates_exact", "rss_slope_mb_per_h": {"driver", "outer", "islands"}, "left_behind",
"eval_bits_per_byte"}.

  python benchmarks/soak.py --minutes 10 --json /tmp/soak10.json    # ~13 minutes (the extended test's run)
  python benchmarks/soak.py --minutes 60 --json /tmp/soak60.json    # the hour (~64 minutes)
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

# Runnable from a checkout without `pip install -e .`: the driver imports the project from here, and the Ray
# workers a local cluster starts inherit PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import ray._private.internal_api  # noqa: E402 - the object store's stats (get_memory_info_reply): not imported by ray
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

import orchestrator  # noqa: E402,F401 - before ray's first use: it sets Ray's log filter
from orchestrator.actors.remote import WORKER_ENV  # noqa: E402
from orchestrator.config import apply_overrides, build_config  # noqa: E402
from orchestrator.core.accounting import FATES  # noqa: E402
from orchestrator.core.eventlog import read_events  # noqa: E402
from orchestrator.run.driver import train  # noqa: E402
from policies.chaos import RUN_KINDS, poisson_tape  # noqa: E402
from policies.poison_guard import POISONED  # noqa: E402

# Ray's own copy of psutil, on the path `import ray` adds (ray/thirdparty_files): importable only after it.
psutil = importlib.import_module("psutil")

POOL = {"pool": "soak"}
# The faults drawn, with equal weights: every kind the engine injects into a fixed pool's run.
KINDS = ("kill_island", "kill_node", "hang", "slow", "corrupt_submission", "drop_submission", "kill_outer", "kill_monitor")
# Node death noticed in a few seconds (as tests/conftest.py's cluster; docs/architecture.md section 4, Testing).
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                   "health_check_failure_threshold": 4, "health_check_timeout_ms": 1500}
MB = 1 << 20
# Process kinds sampled, by actor class name.
CLASSES = {"_OuterShell": "outer", "HealthMonitor": "monitor", "_IslandShell": "islands", "ProgressKeeper": "keepers"}
JSON_KINDS = ("driver", "outer", "islands")  # the slopes the JSON's rss_slope_mb_per_h holds (asserted)
EMULATION = ("EMULATION: every 'machine' is a Ray node on this one machine; a lost node is replaced by a new local "
             "node (a cloud's replacement VM); inner steps throttled")


def mtbf_for(rate_per_s: float, islands: int, min_gap_s: float) -> float:
    """The `mtbf_s` of `poisson_tape` over KINDS (equal weights) that gives `rate_per_s` faults in all.

    Each island's faults are a renewal process of mean gap min_gap_s + mtbf / w_island and the run's of
    min_gap_s + mtbf / w_run (policies/chaos.py, thinning), so the total rate falls with mtbf: bisect."""
    w_run = sum(k in RUN_KINDS for k in KINDS) / len(KINDS)
    total = lambda m: islands / (min_gap_s + m / (1 - w_run)) + 1 / (min_gap_s + m / w_run)  # noqa: E731
    if total(1e-9) <= rate_per_s:
        raise SystemExit(f"--mean-gap-s too short for --min-gap-s {min_gap_s}: at most {total(1e-9):.2f} faults/s")
    lo, hi = 1e-9, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) > rate_per_s else (lo, mid)
    return hi


def config(args, tape_path: Path) -> dict:
    """The run: nano islands, EMULATED slow steps, a wall-clock stop at --minutes, the Poisson tape, then --set."""
    return apply_overrides({
        "run": {"token_budget": 10**12, "max_wall_s": args.minutes * 60.0, "seed": args.seed, "call_timeout_s": 30},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 4_000_000},
        "eval": {"interval_s": 30.0, "batches": 4},
        # A loaded 2-core machine can starve a healthy island for seconds while processes start: a 15 s floor keeps
        # those from reading as hangs, and a hang fault is still found in under 20 s.
        "health": {"warm_spares": 1, "hang_floor_s": 15.0},
        "chaos": {"mode": "tape", "params": {"path": str(tape_path)}},
        "pools": [{"name": "soak", "islands": args.islands, "labels": POOL, "cpus_per_island": 0.5, "region": "local",
                   "emulated_slowdown": args.slowdown}],
    }, args.overrides)


class Sampler(threading.Thread):
    """Every `period_s`: the RSS of the driver and of each sampled actor process, and the object store's use.

    Also keeps every pid seen (actor processes, and every Ray process under the driver: the cluster's raylets,
    their workers), for the check that none outlives the run."""

    def __init__(self, period_s: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.period_s, self.stop = period_s, threading.Event()
        self.rows: list[dict] = []
        self.seen: dict[int, float] = {}  # pid -> create_time (a reused pid is another process)
        self.errors = 0
        self.t0 = time.monotonic()

    def _note(self, proc: psutil.Process) -> None:
        try:
            self.seen.setdefault(proc.pid, proc.create_time())
        except psutil.Error:
            pass

    def sample(self) -> dict:
        """One row: {t_s, driver, outer, monitor, islands (max), islands_mean, keepers, store, n_islands}, MB."""
        me = psutil.Process()
        row: dict = {"t_s": time.monotonic() - self.t0, "driver": me.memory_info().rss / MB}
        by_kind: dict[str, list[float]] = {k: [] for k in CLASSES.values()}
        for info in ray._private.state.state.actor_table(None, actor_state_name="ALIVE").values():
            kind = CLASSES.get(info["ActorClassName"])
            if kind is None or not info.get("Pid"):
                continue
            try:
                proc = psutil.Process(info["Pid"])
                by_kind[kind].append(proc.memory_info().rss / MB)
                self._note(proc)
            except psutil.Error:  # gone between the table and the read: a fault got it
                continue
        for child in me.children(recursive=True):
            self._note(child)
        for kind, values in by_kind.items():
            row[kind] = max(values) if values else None
        row["islands_mean"] = sum(by_kind["islands"]) / len(by_kind["islands"]) if by_kind["islands"] else None
        row["n_islands"] = len(by_kind["islands"])
        reply = ray._private.internal_api.get_memory_info_reply(ray._private.state.state, timeout_seconds=20)
        row["store"] = reply.store_stats.object_store_bytes_used / MB
        return row

    def run(self) -> None:
        while not self.stop.wait(0 if not self.rows and not self.errors else self.period_s):
            try:
                self.rows.append(self.sample())
            except Exception as err:  # noqa: BLE001 - a raylet or the GCS busy with a fault: the next sample
                self.errors += 1
                print(f"  sample skipped: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)


class NodeReplacer:
    """EMULATION of a cloud's replacement VM: a pool node the GCS marks dead is removed from the cluster (its
    processes reaped) and a new node with the same labels is added. Called from the main thread: starting a node
    sets signal handlers, which Python allows there only."""

    def __init__(self, cluster: Cluster, node_args: dict) -> None:
        self.cluster, self.node_args = cluster, node_args
        self.replaced, self.errors = 0, 0

    def check(self) -> None:
        """Replace every dead pool node (retried at the next call when it fails)."""
        try:
            dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
            for node in list(self.cluster.worker_nodes):
                if node.node_id in dead:
                    self.cluster.remove_node(node, allow_graceful=False)
                    self.cluster.add_node(**self.node_args)
                    self.replaced += 1
                    print(f"  node {node.node_id[:8]} lost: replaced ({self.replaced} so far; EMULATION)", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - retried at the next call
            self.errors += 1
            print(f"  node replacement failed, retrying: {type(err).__name__}: {str(err)[:160]}", file=sys.stderr)


def train_while_replacing(cfg, run_dir: Path, replacer: NodeReplacer, period_s: float = 1.0) -> dict:
    """train() in a thread while the main thread replaces lost nodes; its summary (its exception re-raised)."""
    out: dict = {}

    def body() -> None:
        try:
            out["summary"] = train(cfg, run_dir)
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            out["error"] = err

    th = threading.Thread(target=body, name="soak-train", daemon=True)
    th.start()
    while th.is_alive():
        th.join(period_s)
        if th.is_alive():
            replacer.check()
    if "error" in out:
        raise out["error"]
    return out["summary"]


def slope_mb_per_h(rows: list[dict], key: str, warmup: float) -> float | None:
    """Least-squares slope of `key` over time, MB per hour, after the first `warmup` fraction of the samples' span."""
    pts = [(r["t_s"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 3:
        return None
    start = pts[0][0] + warmup * (pts[-1][0] - pts[0][0])
    pts = [p for p in pts if p[0] >= start]
    if len(pts) < 3:
        return None
    t, y = np.array(pts).T
    return float(np.polyfit(t / 3600.0, y, 1)[0])


def fates_exact(summary: dict) -> bool:
    """Every token has exactly one fate: per fragment the fates add up to what the islands processed, none < 0."""
    ledger = summary["token_ledger"]
    return all(sum(ledger[f][p] for f in FATES) == ledger["processed"][p] and min(ledger[f][p] for f in FATES) >= 0
               for p in range(len(ledger["processed"])))


def live_leftovers(wait_s: float = 60.0) -> dict:
    """Actors not dead and placement groups not removed, once the run's teardown has settled (kills are
    asynchronous: waits up to `wait_s` for them to reach 0)."""
    deadline = time.monotonic() + wait_s
    while True:
        actors = [f"{a['ActorClassName']}:{a['Name']}:{a['State']}"
                  for a in ray._private.state.state.actor_table(None).values() if a["State"] != "DEAD"]
        groups = [f"{g.get('name')}:{g['state']}" for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if not (actors or groups) or time.monotonic() > deadline:
            return {"actors": actors, "placement_groups": groups}
        time.sleep(1.0)


def processes_left(seen: dict[int, float], wait_s: float = 30.0) -> list[str]:
    """Processes seen during the run (same pid and start time) still running: after shutdown, none should be."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid, created in seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid}:{proc.name()}")
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(1.0)


def refusal_counts(run_dir: Path) -> dict[str, int]:
    """The run's refusals: all of them, and those the poison guard gave (outer.poison_guard; no poison is injected here,
    so each of those is a false refusal)."""
    reasons = [r["reason"] for r in read_events(run_dir, "refusals").to_pylist()]
    return {"all": len(reasons), "poisoned": sum(r.startswith(POISONED) for r in reasons)}


def fault_counts(run_dir: Path) -> dict[str, int]:
    """Fired faults by kind, from the run's `faults` events, and how many of them were retargeted (`retargeted`)."""
    out: dict[str, int] = {k: 0 for k in KINDS}
    retargeted = 0
    for f in read_events(run_dir, "faults").to_pylist():
        if f["outcome"] == "fired":
            out[f["kind"]] = out.get(f["kind"], 0) + 1
            retargeted += f.get("retargeted_from") is not None
    return {**out, "retargeted": retargeted}


def soak(args) -> dict:
    """Run the soak; the measured results (not yet judged)."""
    root = Path(args.dir or tempfile.mkdtemp(prefix="soak-"))
    root.mkdir(parents=True, exist_ok=True)
    wall = args.minutes * 60.0
    # Faults from 20 s (the islands' first steps) to 30 s before the stop, so none fires into the stop itself.
    # The rate puts wall / --mean-gap-s faults on the tape on average (one per 5 s across the run), in that window.
    start, horizon = 20.0, max(wall - 30.0, 40.0)
    mtbf = mtbf_for(wall / args.mean_gap_s / (horizon - start), args.islands, args.min_gap_s)
    tape = poisson_tape(islands=args.islands, horizon_s=horizon, mtbf_s=mtbf, seed=args.seed, kinds=KINDS,
                        min_gap_s=args.min_gap_s, start_s=start, slow_factor=4.0, slow_duration_s=20.0,
                        retarget=not args.wait_for_island)
    tape.to_yaml(root / "tape.yaml")
    print(f"soak in {root}: {args.minutes:g} min, {args.islands} islands, tape of {len(tape)} faults "
          f"(mtbf {mtbf:.1f} s per island, min gap {args.min_gap_s:g} s; "
          + ", ".join(f"{k} {tape.count(k)}" for k in KINDS) + ")", file=sys.stderr)
    node_args = {"num_cpus": 1, "object_store_memory": 100 * MB, "labels": POOL}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 200 * MB, "_system_config": FAST_NODE_DEATH})
    sampler, replacer = Sampler(args.sample_s), NodeReplacer(cluster, node_args)
    out: dict = {"run_dir": str(root / "run"), "tape_faults": len(tape), "mtbf_s": mtbf}
    try:
        for _ in range(args.nodes):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {**WORKER_ENV, "RAY_ADDRESS": cluster.address}},
                 logging_level="WARNING")
        sampler.start()
        t0 = time.monotonic()
        summary = train_while_replacing(build_config(config(args, root / "tape.yaml")), root / "run", replacer)
        out["wall_s"] = time.monotonic() - t0
        sampler.stop.set()
        sampler.join(60)
        out["left_live"] = live_leftovers()
    finally:
        sampler.stop.set()
        ray.shutdown()
        cluster.shutdown()
    out["left_processes"] = processes_left(sampler.seen)
    out.update(summary=summary, rows=sampler.rows, sample_errors=sampler.errors, nodes_replaced=replacer.replaced,
               replace_errors=replacer.errors, processes_seen=len(sampler.seen),
               faults_by_kind=fault_counts(root / "run"), refusals=refusal_counts(root / "run"))
    return out


def min_faults(args) -> int:
    """The fewest faults the run must fire: --min-faults-per-min over --minutes, rounded up (700 for the hour)."""
    return math.ceil(args.min_faults_per_min * args.minutes - 1e-9)


def judge(args, m: dict) -> dict:
    """The JSON's results and each assertion's outcome, from the measurements."""
    s, rows = m["summary"], m["rows"]
    span_h = (rows[-1]["t_s"] - rows[0]["t_s"]) * (1 - args.warmup) / 3600 if len(rows) > 1 else 0.0
    # A slope over a short window reads allocator noise as growth: the bound is never below what --rss-noise-mb of
    # it would read as over the fitted window (the hour: 50 MB/h; 10 minutes: ~170 MB/h).
    rss_bound = max(args.rss_bound_mb_per_h, args.rss_noise_mb / span_h) if span_h > 0 else math.inf
    store_bound = max(args.store_bound_mb_per_h, args.rss_noise_mb / span_h) if span_h > 0 else math.inf
    slopes = {k: slope_mb_per_h(rows, k, args.warmup) for k in (*JSON_KINDS, "monitor", "keepers", "islands_mean", "store")}
    peaks = {k: max((r[k] for r in rows if r.get(k) is not None), default=None)
             for k in ("driver", "outer", "monitor", "islands", "islands_mean", "keepers", "store")}
    left = len(m["left_live"]["actors"]) + len(m["left_live"]["placement_groups"]) + len(m["left_processes"])
    evals = s["evals"]
    first_bpb, final_bpb = evals[0]["eval_bits_per_byte"], s["eval_bits_per_byte"]
    faults = s["faults_injected"]
    minutes = s["wall_s"] / 60
    checks = {
        "fates_exact": fates_exact(s),
        "rss_flat": all(slopes[k] is not None and slopes[k] < rss_bound for k in JSON_KINDS),
        "store_flat": slopes["store"] is not None and slopes["store"] < store_bound,
        "nothing_left_behind": left == 0,
        "learns": final_bpb <= args.learn_ratio * first_bpb,
        "faults": faults >= min_faults(args),
    }
    return {
        "faults": faults,
        "fates_exact": checks["fates_exact"],
        "rss_slope_mb_per_h": {k: slopes[k] for k in JSON_KINDS},
        "left_behind": left,
        "eval_bits_per_byte": final_bpb,
        "first_eval_bits_per_byte": first_bpb,
        "goodput": s["goodput"], "uptime": s["uptime"],
        "failures": s["failures"], "restarts": s["restarts"], "faults_planned": s["faults_planned"],
        "faults_skipped": s["faults_skipped"], "faults_by_kind": m["faults_by_kind"],
        "nodes_replaced": m["nodes_replaced"], "refusals": m["refusals"], "overrides": args.overrides,
        "tokens_processed": s["tokens_processed"], "tokens_merged": s["tokens_merged"],
        "tokens_lost": s["tokens_lost"], "token_ledger": s["token_ledger"],
        "other_slopes_mb_per_h": {k: slopes[k] for k in ("monitor", "keepers", "islands_mean", "store")},
        "peaks_mb": peaks, "rss_bound_mb_per_h": rss_bound, "store_bound_mb_per_h": store_bound,
        "fitted_window_h": span_h, "samples": len(rows), "sample_errors": m["sample_errors"],
        "left_behind_detail": {**m["left_live"], "processes": m["left_processes"]}, "processes_seen": m["processes_seen"],
        "minutes": args.minutes, "run_minutes": minutes, "wall_s": m.get("wall_s"), "stopped_by": s["stopped_by"],
        "checks": checks, "passed": all(checks.values()), "run_dir": m["run_dir"], "emulation": EMULATION,
        "rss_series": rows,
    }


def _f(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def table(r: dict) -> str:
    """Markdown: one row per measure, its value, its bound and whether it held."""
    c, b = r["checks"], r["rss_bound_mb_per_h"]
    ok = lambda x: "yes" if x else "**NO**"  # noqa: E731
    sl, other, pk = r["rss_slope_mb_per_h"], r["other_slopes_mb_per_h"], r["peaks_mb"]
    rows = [
        "| measure | value | bound | held |", "| --- | ---: | ---: | :---: |",
        f"| faults fired | {r['faults']} ({r['faults'] / r['run_minutes']:.1f}/min) | >= {r['min_faults']} | {ok(c['faults'])} |",
        f"| token fates exact (every fragment) | {str(r['fates_exact']).lower()} | exact | {ok(c['fates_exact'])} |",
        f"| RSS slope, driver (peak MB) | {_f(sl['driver'], '+.1f')} MB/h ({_f(pk['driver'], '.0f')}) | < {b:.0f} MB/h | {ok(c['rss_flat'])} |",
        f"| RSS slope, outer optimizer (peak MB) | {_f(sl['outer'], '+.1f')} MB/h ({_f(pk['outer'], '.0f')}) | < {b:.0f} MB/h | |",
        f"| RSS slope, islands: largest process (peak MB) | {_f(sl['islands'], '+.1f')} MB/h ({_f(pk['islands'], '.0f')}) | < {b:.0f} MB/h | |",
        f"| RSS slope, islands: mean process (peak MB) | {_f(other['islands_mean'], '+.1f')} MB/h ({_f(pk['islands_mean'], '.0f')}) | reported | |",
        f"| RSS slope, health monitor (peak MB) | {_f(other['monitor'], '+.1f')} MB/h ({_f(pk['monitor'], '.0f')}) | reported | |",
        f"| object store use slope (peak MB) | {_f(other['store'], '+.1f')} MB/h ({_f(pk['store'], '.1f')}) | "
        f"< {r['store_bound_mb_per_h']:.0f} MB/h | {ok(c['store_flat'])} |",
        f"| left behind (actors + groups + processes) | {r['left_behind']} | 0 | {ok(c['nothing_left_behind'])} |",
        f"| held-out bits/byte: first eval -> final | {r['first_eval_bits_per_byte']:.3f} -> {r['eval_bits_per_byte']:.3f} | "
        f"<= {r['learn_ratio']:.2f} x first | {ok(c['learns'])} |",
        f"| goodput | {r['goodput']:.3f} | reported | |",
        f"| uptime | {r['uptime']:.3f} | reported | |",
        f"| failures / restarts / nodes replaced | {r['failures']} / {r['restarts']} / {r['nodes_replaced']} | reported | |",
        f"| refusals: all / by the poison guard (false: no poison is injected) | {r['refusals']['all']} / "
        f"{r['refusals']['poisoned']} | reported | |",
    ]
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="the run's wall time before it stops (default 60)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--islands", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=6, help="1-CPU pool nodes (two island slots each; default 6)")
    ap.add_argument("--mean-gap-s", type=float, default=5.0, help="mean seconds between faults, all kinds (default 5)")
    ap.add_argument("--min-gap-s", type=float, default=10.0,
                    help="dead time after each fault of one island (or of the run), so it can rejoin first (default 10)")
    ap.add_argument("--slowdown", type=float, default=10.0, help="EMULATED step slowdown of the pool (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of the run left out of the slopes (default 0.1)")
    ap.add_argument("--rss-bound-mb-per-h", type=float, default=50.0)
    ap.add_argument("--rss-noise-mb", type=float, default=25.0,
                    help="allocator noise a short window must not read as a leak (default 25 MB)")
    ap.add_argument("--store-bound-mb-per-h", type=float, default=50.0)
    ap.add_argument("--learn-ratio", type=float, default=0.8)
    ap.add_argument("--min-faults-per-min", type=float, default=700 / 60,
                    help="faults that must fire per minute (default 700 an hour: issue 60's 'about one per 5 s, so 700 "
                         "or more')")
    ap.add_argument("--wait-for-island", action="store_true",
                    help="a fault due while its island is down waits for it (before 2026-12-04 the only way); by default "
                         "the next live island takes it (Fault.retarget), so the rate holds however slow restarts are")
    ap.add_argument("--dir", type=Path, help="where the run writes (default: a new temporary directory)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override on top of the soak's run (dotted, YAML value; repeatable), e.g. "
                         "--set outer.poison_guard=true to soak the opt-in guard")
    args = ap.parse_args(argv)
    if args.minutes <= 1:
        ap.error(f"--minutes must be > 1, got {args.minutes}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the table, write the JSON; 1 if an assertion failed."""
    args = parse_args(argv)
    r = judge(args, soak(args))
    r.update(min_faults=min_faults(args), learn_ratio=args.learn_ratio)
    sets = "; --set " + " ".join(args.overrides) if args.overrides else ""
    print(f"\n{EMULATION} ({args.slowdown:g}x). {args.minutes:g} min, {args.islands} islands of model.preset=nano, "
          f"{args.nodes} nodes{sets}; Poisson faults every {args.mean_gap_s:g} s on average over {', '.join(KINDS)}; "
          f"RSS every {args.sample_s:g} s, slopes fitted after the first {100 * args.warmup:.0f}% "
          f"({r['samples']} samples); islands = the largest island process at each sample.\n")
    print(table(r))
    print("\nfaults by kind: " + ", ".join(f"{k} {n}" for k, n in r["faults_by_kind"].items())
          + f"; skipped {r['faults_skipped']}; run in {r['run_dir']}")
    if r["left_behind"]:
        print(f"left behind: {r['left_behind_detail']}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2, default=str))
    failed = [k for k, v in r["checks"].items() if not v]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
