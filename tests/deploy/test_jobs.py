"""`diloco submit` and `diloco status` against a real Ray cluster started with `ray start --head --block`.

The cluster is this module's own (free ports, its own --temp-dir) and is stopped by terminating the
`ray start` process we started: never `ray stop`, which would kill every Ray on the machine. The CLI
runs as a subprocess, as a user would run it. Also checks that the driver's metrics reach the
head's Prometheus endpoint (orchestrator/run/metrics.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from orchestrator.deploy.dashboard import dashboard_metric_names, exported_names, run_metric_definitions

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
# A small run: nano model, 2 islands in one pool, no warm spares; it stops on max_wall_s so that it
# lasts long enough for `diloco status` to attach whatever the machine's load.
RUN_SETTINGS = [
    # 8 s of training: `diloco status` (a new driver process per try, 1-3 s each) must find the run live; at 4 s a
    # clean clone's cold first imports once let the job finish between two tries.
    "model.preset=nano", "run.token_budget=100000000", "run.max_wall_s=8", "data.max_bytes=400000",
    "eval.interval_s=5", "eval.batches=2", "health.warm_spares=0", "outer.sync_every_steps=8",
    "pools=[{name: a, islands: 2, cpus_per_island: 0.5}]",
    # A user's own model by import path: its module travels in the job's working_dir and every process of
    # the job (its driver, the islands) resolves it there (issue 43: the API runs inside a Ray Job).
    "model.factory=tests.api.bad_models:tiny_lm",
    # Generous: on a loaded 2-core machine starting an actor process (import torch) can take a minute.
    "run.call_timeout_s=240", "run.placement_timeout_s=300", "health.startup_s=240",
]


@dataclass
class Head:
    proc: subprocess.Popen
    temp_dir: str
    gcs: str  # HOST:PORT for drivers (`diloco status --address`)
    dashboard: str  # http URL for the Jobs API (`diloco submit --address`)
    metrics_port: int
    log: Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[0], cmdline)
    return table


def cluster_processes(head: Head) -> set[int]:
    """Live (non-zombie) processes of the cluster: descendants of `ray start`, or naming its temp dir."""
    table = _process_table()
    found, frontier = set(), [head.proc.pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _, _) in table.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    found.update(pid for pid, (_, _, cmd) in table.items() if head.temp_dir in cmd)
    return {pid for pid in found if pid in table and table[pid][1] != "Z"}


def alive(pids: set[int]) -> set[int]:
    table = _process_table()
    return {pid for pid in pids if pid in table and table[pid][1] != "Z"}


def start_head(log_dir: Path, attempt: int) -> Head | None:
    # Short temp dir: Ray's unix sockets live under it (108-byte path limit).
    temp_dir = tempfile.mkdtemp(prefix="dj", dir="/tmp")
    gcs, dash, client, metrics, listen, agent_grpc, node_mgr, obj_mgr, env_agent = free_ports(9)
    log = log_dir / f"head-{attempt}.log"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--temp-dir", temp_dir,
           "--port", str(gcs), "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
           "--metrics-export-port", str(metrics), "--dashboard-agent-listen-port", str(listen),
           "--dashboard-agent-grpc-port", str(agent_grpc), "--node-manager-port", str(node_mgr),
           "--object-manager-port", str(obj_mgr), "--runtime-env-agent-port", str(env_agent),
           "--num-cpus", "2", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
           "--disable-usage-stats", "--system-config", json.dumps({"metrics_report_interval_ms": METRICS_INTERVAL_MS})]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV, cwd=str(log_dir))
    head = Head(proc, temp_dir, "", f"http://127.0.0.1:{dash}", metrics, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        # "Ray runtime started" comes once the raylet registered (it can still die before that,
        # ray-project/ray#65983 on a loaded machine); then the Jobs endpoint must answer.
        if "Ray runtime started" in log.read_text() and http_ok(f"{head.dashboard}/api/jobs/"):
            address_file = Path(temp_dir, "ray_current_cluster")
            head.gcs = address_file.read_text().strip() if address_file.exists() else f"127.0.0.1:{gcs}"
            return head
        time.sleep(0.5)
    stop_head(head)
    return None


def stop_head(head: Head) -> set[int]:
    """SIGTERM our `ray start --block`; it stops its node. Returns the cluster's pids still alive after 60 s."""
    pids = cluster_processes(head)  # before the signal: orphans are re-parented and lose the link
    if head.proc.poll() is None:
        head.proc.send_signal(signal.SIGTERM)
        try:
            head.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.proc.kill()
            head.proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    left = alive(pids) | cluster_processes(head)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = alive(pids) | cluster_processes(head)
    for pid in left:  # ours: never leave them behind for the next test, but report them
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


@pytest.fixture
def head(tmp_path_factory):
    """Our own single-node cluster for one test, stopped (and checked gone) after it."""
    log_dir = tmp_path_factory.mktemp("head")
    started = None
    for attempt in range(2):  # a head whose raylet died at start-up (#65983) gets one more try
        started = start_head(log_dir, attempt)
        if started is not None:
            break
    if started is None:
        pytest.fail(f"ray start --head did not come up twice; see {log_dir}")
    yield started
    left = stop_head(started)
    assert not left, f"processes of the test cluster left after stopping it: {sorted(left)}"


def diloco(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env or ENV, text=True,
                          capture_output=True, timeout=timeout)


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return resp.read().decode()
    except OSError:
        return ""


# Ray drops a gauge from the export port 2 report intervals after its process last pushed it (Ray 2.60,
# open_telemetry_metric_recorder.py), so a finished job's final gauges are scrapeable only for a few seconds around
# its driver's exit (which waits 1.5 intervals after setting them: RunMetrics.wait_exported). 2 s keeps that window
# about 5 s wide on a loaded machine; counters stay.
METRICS_INTERVAL_MS = 2000


class MetricsWatch:
    """Scrapes the export port every 0.25 s in a thread; keeps the newest scrape that still had the run's gauges."""

    def __init__(self, port: int) -> None:
        self.port, self.with_gauges, self._stop = port, "", threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            text = scrape(self.port)
            if re.search(r"^ray_diloco_goodput[{ ]", text, re.M):
                self.with_gauges = text
            self._stop.wait(0.25)

    def stop(self) -> str:
        """Stop scraping; the newest scrape with the gauges ("" if none had them)."""
        self._stop.set()
        self._thread.join(timeout=30)
        return self.with_gauges


def metric_total(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (all tag combinations)."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def test_submit_runs_on_the_cluster_status_attaches_and_metrics_export(head, tmp_path):
    run_dir = tmp_path / "run"  # absolute: the job writes where the test reads (same machine)
    submit_args = ["submit", "--address", head.dashboard, "--run-dir", str(run_dir)]
    for item in RUN_SETTINGS:
        submit_args += ["--set", item]
    out_path = tmp_path / "submit.out"
    watch = MetricsWatch(head.metrics_port)  # from the start: the final gauges live only seconds after the job ends
    with out_path.open("w") as out:
        submit = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *submit_args], cwd=ROOT, env=ENV,
                                  stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        # While the job runs: `diloco status RUN_DIR` (no --address, no $RAY_ADDRESS) attaches to the run's actors
        # on the Ray its run.json recorded, and shows both islands.
        seen_status, got = None, None
        deadline = time.monotonic() + 300
        no_address = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
        while seen_status is None and submit.poll() is None and time.monotonic() < deadline:
            got = diloco("status", str(run_dir), env=no_address)
            if got.returncode == 0 and "island 1 pool a" in got.stdout:
                seen_status = got.stdout
            else:  # each try is a new driver process: polled back to back they took CPU the job was starting with
                time.sleep(1.0)
        last = f"{got.stdout} {got.stderr}" if got else "no attempt"
        assert seen_status, f"diloco status never showed the live run; last: {last}"
        assert re.search(r"^fragment versions +\[\d+, \d+\]$", seen_status, re.M), seen_status
        assert "island 0 pool a: " in seen_status and "goodput so far" in seen_status
        salvaged = r"^salvaged +0 tokens of dead islands' unsubmitted progress \(0 salvages; progress keepers replaced 0 times\)$"
        assert re.search(salvaged, seen_status, re.M), seen_status
        # The driver's token ledger, as it noted it: the fates add up to processed.
        tokens = re.search(r"^tokens processed +([\d,]+), of which merged ([\d,]+), refused ([\d,]+), in flight ([\d,]+), "
                           r"lost ([\d,]+), overwritten ([\d,]+) \(per fragment, mean\)$", seen_status, re.M)
        assert tokens, seen_status
        counts = [int(n.replace(",", "")) for n in tokens.groups()]
        assert counts[0] == sum(counts[1:]), seen_status
        submit.wait(timeout=300)
    finally:
        if submit.poll() is None:
            submit.kill()
    output = out_path.read_text()
    assert submit.returncode == 0, output[-3000:]
    assert "equivalent: ray job submit --address" in output
    assert re.search(r"^job \S+ SUCCEEDED$", output, re.M), output[-3000:]

    # The job's driver wrote the run directory we asked for, on this cluster, and the cluster's GCS address in it.
    summary = json.loads((run_dir / "summary.json").read_text())
    recorded = json.loads((run_dir / "run.json").read_text())["sessions"][-1]["address"]
    assert recorded.rsplit(":", 1)[1] == head.gcs.rsplit(":", 1)[1], (recorded, head.gcs)
    assert summary["rounds"] > 0 and summary["tokens_merged"] > 0
    assert "factory: tests.api.bad_models:tiny_lm" in (run_dir / "config.yaml").read_text()
    names = {t["name"] for m in (run_dir / "checkpoints").glob("step-*/manifest.json")
             for t in json.loads(m.read_text())["tensors"]}
    assert "param/embed.weight" in names and "param/tok_emb.weight" not in names, "the user's model, not the built-in"
    assert len(summary["islands"]) == 2 and {i["pool"] for i in summary["islands"]} == {"a"}

    # The driver's metrics reach the head's Prometheus endpoint; the final values are the summary's
    # (every drained round counted once; goodput recorded at the end), in the last scrape that had the gauges.
    text = watch.stop()
    (tmp_path / "metrics.txt").write_text(text)  # to read when this fails
    rounds = metric_total(text, "ray_diloco_rounds_total")
    goodput = metric_total(text, "ray_diloco_goodput")
    processed = metric_total(text, "ray_diloco_tokens_processed")
    assert rounds > 0, "ray_diloco_rounds_total never appeared on the metrics export port"
    assert rounds == summary["rounds"] and goodput == pytest.approx(summary["goodput"]), (rounds, goodput)
    assert metric_total(text, "ray_diloco_tokens_merged_total") > 0 and "ray_diloco_islands{" in text
    # The token ledger's gauges: the final table's numbers, whose fates add up to processed.
    assert processed == summary["tokens_processed"] == metric_total(text, "ray_diloco_tokens"), processed

    # The Grafana dashboard's queries name metrics this run exports. A counter appears on the export port at its first
    # increment, so the refusal counters are absent from a run without refusals (this one usually refuses some stale
    # submissions, 65 in one run, but need not): then they are checked against RunMetrics' definitions instead, as
    # tests/deploy/test_dashboard.py checks every name. Every other metric is recorded from the first tick or round.
    exported = set(re.findall(r"^(ray_diloco_[a-z_]+)[{ ]", text, re.M))
    refusal_only = {n for name in ("diloco_refusals", "diloco_tokens_refused")
                    for n in exported_names(name, run_metric_definitions()[name])}
    absent = dashboard_metric_names() - exported
    assert absent <= refusal_only and (summary["refusals"] > 0 or absent == refusal_only), (sorted(absent), summary["refusals"])
    # `diloco dashboard install` puts it beside the dashboards Ray generated for this session, where the provider
    # of its grafana.ini's provisioning reads them.
    grafana = Path(head.temp_dir, "session_latest", "metrics", "grafana")
    installed = diloco("dashboard", "install", "--temp-dir", head.temp_dir)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    provider = yaml.safe_load((grafana / "provisioning" / "dashboards" / "default.yml").read_text())["providers"][0]
    assert Path(provider["options"]["path"]).resolve() == (grafana / "dashboards").resolve(), provider
    assert installed.stdout.startswith(f"installed {provider['options']['path']}/diloco_dashboard.json"), installed.stdout
    assert {"diloco_dashboard.json", "default_grafana_dashboard.json"} <= {f.name for f in (grafana / "dashboards").iterdir()}

    # After the run, nothing is live: one line that says so, and how to start one.
    after = diloco("status", "--address", head.gcs)
    assert after.returncode == 2
    assert after.stderr.strip().startswith("diloco status: no live diloco run at") and "\n" not in after.stderr.strip()


@pytest.mark.extended
def test_ray_job_stop_stops_the_run_cleanly(head, tmp_path):
    """`ray job stop` sends the job's processes SIGTERM, then SIGKILL RAY_JOB_STOP_WAIT_TIME_S later (the plan
    sets 300 s): `diloco train` stops cleanly inside that time, as on Ctrl-C. Extended: its own cluster and run
    (about a minute); the signal path is tests/integration/test_interrupt.py's, which runs by default."""
    from orchestrator.core.checkpoint import CheckpointStore
    from tests.engine.test_token_ledger import assert_shown_everywhere

    run_dir = tmp_path / "run"
    settings = [s if not s.startswith("run.max_wall_s=") else "run.max_wall_s=600" for s in RUN_SETTINGS]
    args = ["submit", "--address", head.dashboard, "--run-dir", str(run_dir), "--no-wait"]
    for item in settings:
        args += ["--set", item]
    got = diloco(*args, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    sid = re.search(r"--submission-id (\S+)", got.stdout).group(1)
    store = CheckpointStore(str(run_dir / "checkpoints"))
    deadline = time.monotonic() + 300
    while not (len(store.list()) >= 2 and sum(store.load(store.list()[-1]).meta["outer"]["versions"]) >= 2):
        assert time.monotonic() < deadline, "the job never checkpointed merged rounds"
        time.sleep(1)
    stop = subprocess.run(["ray", "job", "stop", "--address", head.dashboard, sid], env=ENV, text=True,
                          capture_output=True, timeout=300)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert re.search(rf"Job '?{sid}'? was stopped", stop.stdout + stop.stderr), stop.stdout + stop.stderr
    logs = subprocess.run(["ray", "job", "logs", "--address", head.dashboard, sid], env=ENV, text=True,
                          capture_output=True, timeout=120).stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "interrupted", summary["stopped_by"]
    assert_shown_everywhere(summary)
    assert "Traceback" not in logs and "SIGTERM: stopping cleanly" in logs, logs[-3000:]
    assert f"resume with: diloco train --resume {run_dir}" in logs, logs[-3000:]


# ---------------------------------------------------------------- no cluster: plans, picks, live goodput


def test_plan_job_ships_the_project_and_prints_the_same_submission():
    from orchestrator.deploy.jobs import EXCLUDES, plan_job

    plan = plan_job(address="http://h:8265", config=str(ROOT / "configs" / "default.yaml"),
                    overrides=["run.token_budget=1000", "pools=[{name: a, islands: 2}]"], submission_id="sid-1",
                    env=["HF_HOME=/data/hf"])
    assert plan.entrypoint == ("python -m orchestrator.cli train --config configs/default.yaml --set run.token_budget=1000 "
                               "--set 'pools=[{name: a, islands: 2}]' --run-dir ~/diloco-runs/sid-1")
    assert plan.runtime_env == {"working_dir": str(ROOT), "excludes": EXCLUDES,
                                "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300", "HF_HOME": "/data/hf"}}
    # `ray job stop` waits this long for the clean stop before SIGKILL; --env may set it.
    assert plan_job(address="a", config=None, overrides=[], env=["RAY_JOB_STOP_WAIT_TIME_S=60"]).env_vars == {
        "RAY_JOB_STOP_WAIT_TIME_S": "60"}
    assert "runs/" in EXCLUDES and ".git/" in EXCLUDES
    line = plan.ray_job_submit_line(no_wait=True)
    assert line.startswith(f"ray job submit --address http://h:8265 --submission-id sid-1 --working-dir {ROOT} ")
    assert line.endswith(" --no-wait -- " + plan.entrypoint)
    # The runtime env JSON in the line is exactly what the SDK call sends, minus working_dir.
    sent = json.loads(re.search(r"--runtime-env-json '([^']*)'", line).group(1))
    assert sent == {k: v for k, v in plan.runtime_env.items() if k != "working_dir"}


@pytest.mark.parametrize("kwargs, message", [
    ({"config": "/etc/hosts.yaml"}, "does not exist"),
    ({"overrides": ["outer.min_quorm=2"]}, "unknown config field 'outer.min_quorm'"),
    ({"env": ["NOVALUE"]}, "--env 'NOVALUE' is not KEY=VALUE"),
])
def test_plan_job_refuses_bad_input_in_one_line(kwargs, message):
    from orchestrator.config import ConfigError
    from orchestrator.deploy.jobs import JobError, plan_job

    args = {"address": "http://h:8265", "config": None, "overrides": [], **kwargs}
    with pytest.raises((ConfigError, JobError)) as err:
        plan_job(**args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_plan_job_refuses_a_config_outside_the_project(tmp_path):
    from orchestrator.deploy.jobs import JobError, plan_job

    outside = tmp_path / "c.yaml"
    outside.write_text("run: {token_budget: 1000}\n")
    with pytest.raises(JobError, match="lies outside the project"):
        plan_job(address="http://h:8265", config=str(outside), overrides=[])


def test_pick_run_names_the_fix():
    from orchestrator.deploy.jobs import JobError, pick_run

    assert pick_run(["r1"], None, "here") == "r1"
    assert pick_run(["r1", "r2"], "r2", "here") == "r2"
    for runs, run_id, message in [([], None, "no live diloco run at here"),
                                  (["r1", "r2"], None, "2 live runs at here: r1, r2; pick one with --run-id"),
                                  (["r1"], "r9", "no live run 'r9' at here (live runs: r1)")]:
        with pytest.raises(JobError, match=re.escape(message)):
            pick_run(runs, run_id, "here")


def test_status_names_a_stopped_cluster_instead_of_retrying_it(monkeypatch, capsys, tmp_path):
    import ray._private.services as services

    from orchestrator.cli.main import main

    monkeypatch.chdir(tmp_path)  # no runs/latest here: a checkout's own last run would answer first

    # A port nothing listens on, as Ray's record of the last `ray start` on this machine (the file
    # /tmp/ray/ray_current_cluster is shared with other tests, so the lookup is stood in for).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "get_ray_address_from_environment", lambda addr, temp_dir: dead)
    assert main(["status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"diloco status: the Ray cluster this machine last started ({dead}) does not answer")

    def nothing(addr, temp_dir):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(services, "get_ray_address_from_environment", nothing)
    assert main(["status"]) == 2
    assert capsys.readouterr().err.strip() == ("diloco status: no Ray cluster found on this machine; start one "
                                               "(ray start --head) or pass --address HEAD:6379")


def _status(island, tokens, submitted, outbox):
    from islands.island import IslandStatus

    return IslandStatus(island=island, incarnation=1, pool="a", state="training", steps=tokens // 512, tokens=tokens,
                        train_loss=None, step_time_s=0.1, versions=[0], unsubmitted_tokens=[0], outbox_tokens=[outbox],
                        inflight=0, cursor=0, submitted_tokens=[submitted], discarded_tokens=[0])


def test_goodput_so_far_uses_the_summary_formula_and_a_stale_status_adds_up():
    from orchestrator.run.metrics import estimated_run_start, goodput_so_far, live_ledger

    # Two islands trained from t=100 and t=102 (the clock starts at 102), one fragment.
    timeline = [(99.0, 0, 1, "restarting"), (99.5, 1, 1, "restarting"), (100.0, 0, 1, "training"), (102.0, 1, 1, "training")]
    assert estimated_run_start(timeline) == 102.0
    assert estimated_run_start(timeline[:3]) is None  # island 1 never trained yet
    slots = {0: {"status": _status(0, 4096, 4096, 0), "finals": []}, 1: {"status": _status(1, 2048, 2048, 0), "finals": []}}
    # A live read: island 0's last status says it submitted 4096 tokens, but the outer optimizer (its ledger and
    # tokens received, of one moment) already merged 6144 of its: the status is older than the ledger. The old
    # formula gave lost = 4096 - 6144 = -2048 (goodput_report raised mid-run, then a clamp broke the sum); island 0
    # processed at least what it sent, and every count adds up.
    status = {"versions": [3], "ledger": {"merged": [8192], "refused": [0], "pending": [0], "late": [0]},
              "received": [[0, 1, [6144]], [1, 1, [2048]]]}
    ledger = live_ledger(status=status, snapshot={"slots": slots})
    assert ledger == {"processed": [8192], "merged": [8192], "refused": [0], "in_flight": [0], "lost": [0], "overwritten": [0]}
    accounting = {"useful_s": 10.0, "advances": [103.0, 104.0, 110.0]}
    got = goodput_so_far(ledger=ledger, accounting=accounting, snapshot={"slots": slots, "timeline": timeline},
                         run_start=102.0, now=112.0)
    # Hand-computed: allocated = 2 islands x (112 - 102) s = 20 s; useful 10 s -> 0.5; a resumed session's
    # goodput counts only its own useful time (4 s of the 10 were the restored checkpoint's).
    assert got["goodput"] == pytest.approx(0.5) and got["tokens_processed"] == 8192 and got["fates"] is ledger
    assert goodput_so_far(ledger=ledger, accounting=accounting, snapshot={"slots": slots, "timeline": timeline},
                          run_start=102.0, now=112.0, useful_before=4.0)["goodput"] == pytest.approx(0.3)
    assert goodput_so_far(ledger=ledger, accounting=accounting, snapshot={"slots": slots, "timeline": timeline},
                          run_start=None)["goodput"] is None


def test_refusal_kinds_are_a_small_set():
    from orchestrator.run.metrics import refusal_kind

    assert refusal_kind("tensor 0: non-finite values (NaN/Inf)") == "non_finite"
    assert refusal_kind("stale incarnation 1 of island 2 (live: 3)") == "stale"
    assert refusal_kind("unknown or dead island 7") == "unknown_island"
    assert refusal_kind("tensor 1: shape (2, 3) != (3, 2)") == "malformed"


def test_diloco_status_shows_the_drivers_ledger_and_its_fates_add_up():
    """`diloco status` prints the token ledger the driver noted at its last tick (the count its final table will
    show), as whole fragment means that add up to processed (three fragments: thirds of a token)."""
    from orchestrator.deploy.jobs import format_view

    ledger = {"processed": [2560] * 3, "merged": [2048, 1536, 1536], "refused": [0] * 3, "in_flight": [512, 0, 0],
              "lost": [0, 1024, 1024], "overwritten": [0] * 3}
    view = {"run_id": "run-1", "now": 10.0, "run_start": None, "extra": {"token_ledger": ledger, "tokens_processed": 2560},
            "status": {"versions": [1, 1, 1], "rounds": 3, "refusals": 0, "bytes_up": 0, "bytes_down": 0},
            "snapshot": {"slots": {}, "salvages": [], "keeper_restarts": {}},
            "so_far": {"goodput": None, "uptime": None, "fates": ledger, "tokens_processed": 2560}}
    line = next(x for x in format_view(view).splitlines() if x.startswith("tokens processed"))
    numbers = [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", line)]
    assert numbers[0] == 2560 == sum(numbers[1:]), line
