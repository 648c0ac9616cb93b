"""`diloco submit` and `diloco status`: run training on a Ray cluster through the Jobs API, and look at it.

- `submit` validates the config here (a typo fails before anything is sent), ships the project as the
  job's `working_dir` and runs `python -m orchestrator.cli train` as the job's entrypoint. The job
  supervisor sets RAY_ADDRESS for the entrypoint (ray/dashboard/modules/job/job_supervisor.py,
  `_get_driver_env_vars`), and `diloco train` connects to $RAY_ADDRESS when it has no --address
  (orchestrator/run/driver.py::ensure_ray), so the job's driver joins the job's cluster. The driver adds
  WORKER_ENV to the job's runtime environment itself (ensure_ray's `ray.init(runtime_env=...)`); the
  job must not set the same variables, or Ray refuses to merge the two environments.
- `status` joins the cluster as a short-lived driver, finds the run's named actors (namespace
  `diloco`: `outer-<run_id>` and `monitor-<run_id>`) and prints versions, islands, rounds, tokens and
  goodput so far (orchestrator/run/metrics.py::goodput_so_far, the same formulas as the final summary).

The command lines themselves (argparse, environment fallbacks) are in orchestrator/cli/jobs.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from orchestrator.config import load_config
from orchestrator.core.accounting import incarnation_tokens, shown_fates

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

# What never travels to the cluster (Ray also honours .gitignore inside working_dir).
EXCLUDES = ["runs/", ".git/", "**/__pycache__/", "**/*.pyc", "**/.ipynb_checkpoints/", "*.egg-info/", ".venv/",
            ".pytest_cache/", "build/", "dist/"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# `ray job stop` sends the entrypoint SIGTERM and, RAY_JOB_STOP_WAIT_TIME_S later (3 s by default), SIGKILL
# (ray/dashboard/modules/job/job_supervisor.py; the supervisor reads it from the job's env_vars). `diloco train`
# stops cleanly on SIGTERM (final flush, checkpoint, summary): give it the time. `--env` may set another value.
STOP_WAIT_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": "300"}
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


class JobError(RuntimeError):
    """A one-line, user-facing reason why submit or status cannot go on (with the fix)."""


# ---------------------------------------------------------------------------------------------- submit


@dataclass(frozen=True)
class JobPlan:
    """Everything a submission sends: the same values drive the SDK call and the printed CLI line."""

    address: str
    submission_id: str
    working_dir: str
    entrypoint: str
    run_dir: str
    env_vars: dict[str, str] = field(default_factory=dict)

    @property
    def runtime_env(self) -> dict:
        """The job's runtime environment: the project as working_dir, minus EXCLUDES, plus --env values."""
        env = {"working_dir": self.working_dir, "excludes": list(EXCLUDES)}
        if self.env_vars:
            env["env_vars"] = dict(self.env_vars)
        return env

    def ray_job_submit_line(self, *, no_wait: bool = False) -> str:
        """The equivalent `ray job submit` command line."""
        extra = {k: v for k, v in self.runtime_env.items() if k != "working_dir"}
        parts = ["ray", "job", "submit", "--address", self.address, "--submission-id", self.submission_id,
                 "--working-dir", self.working_dir, "--runtime-env-json", json.dumps(extra)]
        if no_wait:
            parts.append("--no-wait")
        return " ".join(shlex.quote(p) for p in parts) + " -- " + self.entrypoint


def project_root() -> Path:
    """The source checkout this package runs from (what a job ships as its working_dir)."""
    return Path(__file__).resolve().parents[2]


def _shell_path(path: str) -> str:
    # A leading ~/ is left to the job's shell, so it expands to the home directory on the cluster.
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def plan_job(*, address: str, config: str | None, overrides: list[str], run_dir: str | None = None,
             working_dir: str | Path | None = None, env: list[str] | None = None,
             submission_id: str | None = None) -> JobPlan:
    """Validate the run config here and build the submission. Raises ConfigError or JobError (one line)."""
    root = Path(working_dir or project_root()).resolve()
    if not (root / "orchestrator" / "cli" / "main.py").is_file():
        raise JobError(f"{root} is not a decoupled-diloco source checkout (no orchestrator/cli/main.py); "
                       "pass --working-dir with the project root")
    load_config(config, overrides)  # a wrong field fails here, before anything is sent
    sid = submission_id or f"diloco-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    args = ["python", "-m", "orchestrator.cli", "train"]
    if config is not None:
        path = Path(config).resolve()
        try:
            rel = path.relative_to(root)
        except ValueError:
            raise JobError(f"--config {config} lies outside the project ({root}), so the job would not have it; "
                           "copy it under the project (e.g. configs/) or use --set overrides") from None
        args += ["--config", rel.as_posix()]
    for item in overrides:
        args += ["--set", item]
    run_dir = run_dir or f"~/diloco-runs/{sid}"
    entrypoint = " ".join(shlex.quote(a) for a in args) + " --run-dir " + _shell_path(run_dir)
    env_vars = dict(STOP_WAIT_ENV)
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobError(f"--env {item!r} is not KEY=VALUE; e.g. --env HF_HOME=/data/hf")
        env_vars[key] = value
    return JobPlan(address=address, submission_id=sid, working_dir=str(root), entrypoint=entrypoint,
                   run_dir=run_dir, env_vars=env_vars)


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as err:  # noqa: BLE001 - ConnectionError, AuthenticationError, ...: one line for the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JobError(f"cannot reach the Ray dashboard at {address} ({first}); pass --address http://HEAD:8265 "
                       "(and RAY_AUTH_MODE/RAY_AUTH_TOKEN as the cluster needs)") from None


async def _tail(client, job_id: str, out: TextIO) -> None:
    async for chunk in client.tail_job_logs(job_id):
        out.write(chunk)
        out.flush()


def wait_for_end(client, job_id: str, *, timeout_s: float = 120.0) -> str:
    """The job's terminal status (the log stream can end a moment before the status turns terminal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def submit(plan: JobPlan, *, wait: bool = True, out: TextIO = sys.stdout) -> int:
    """Submit the job; with `wait`, stream its log and return 0 for SUCCEEDED, 1 otherwise."""
    client = _client(plan.address)
    try:
        job_id = client.submit_job(entrypoint=plan.entrypoint, runtime_env=plan.runtime_env,
                                   submission_id=plan.submission_id, metadata={"diloco_run_dir": plan.run_dir})
    except Exception as err:  # noqa: BLE001 - upload or HTTP failure: one line for the user
        lines = str(err).strip().splitlines()
        reason = lines[-1] if lines else type(err).__name__
        raise JobError(f"the cluster at {plan.address} refused the job: {reason}") from None
    stop = f"ray job stop {shlex.quote(job_id)} --address {shlex.quote(plan.address)}"
    print(f"submitted job {job_id}; run directory on the cluster: {plan.run_dir}", file=out, flush=True)
    if not wait:
        print(f"follow it: ray job logs --follow {shlex.quote(job_id)} --address {shlex.quote(plan.address)}\n"
              f"look at it: diloco status (on a cluster node, or with --address HEAD:6379)\nstop it: {stop}",
              file=out, flush=True)
        return 0
    try:
        asyncio.run(_tail(client, job_id, out))
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} keeps running. Stop it with: {stop}", file=out, flush=True)
        return 130
    status = wait_for_end(client, job_id)
    message = ""
    if status != "SUCCEEDED":
        info = client.get_job_info(job_id)
        lines = (info.message or "").strip().splitlines()
        message = f": {lines[-1]}" if lines else ""
    print(f"job {job_id} {status}{message}", file=out, flush=True)
    return 0 if status == "SUCCEEDED" else 1


# ---------------------------------------------------------------------------------------------- status


def connect(address: str | None) -> None:
    """Join the cluster as a short-lived driver (address: GCS `HOST:PORT`, `auto` or `ray://...`)."""
    import ray

    if address and address.startswith(("http://", "https://")):
        raise JobError(f"--address {address} is a dashboard URL; `diloco status` needs the cluster address "
                       "HEAD:6379 (or run it on a cluster node with no --address)")
    recorded = None
    if not address:
        # `auto` means the cluster this machine last started, recorded in /tmp/ray/ray_current_cluster;
        # the file outlives a stopped cluster, and Ray would then retry the dead address for minutes.
        from ray._private.services import get_ray_address_from_environment

        try:
            recorded = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            raise JobError("no Ray cluster found on this machine; start one (ray start --head) or pass "
                           "--address HEAD:6379") from None
    target = address or recorded or ""
    host, sep, port = target.rpartition(":")
    if sep and host and port.isdigit() and "://" not in target:
        # Ray keeps retrying an unreachable GCS for minutes; a plain TCP connect answers in seconds.
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as err:
            if recorded:
                raise JobError(f"the Ray cluster this machine last started ({recorded}) does not answer "
                               f"({err.strerror or err}); it has probably stopped: start it again or pass "
                               "--address HEAD:6379") from None
            raise JobError(f"nothing answers at {address} ({err.strerror or err}); pass the cluster address "
                           "HEAD:6379 to --address") from None
    try:
        ray.init(address=address or "auto", logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JobError(f"cannot connect to Ray at {address or 'auto'} ({first}); pass --address HEAD:6379") from None


@dataclass(frozen=True)
class RecordedRun:
    """Where a run directory's latest session ran: its run id and the GCS address of its Ray (run.json)."""

    run_dir: Path
    run_id: str
    address: str


def recorded_run(run_dir: str | Path) -> RecordedRun | None:
    """The latest session `run_dir`'s run.json records with a Ray address, or None (no run.json, or one written
    before runs recorded their address). `diloco status` attaches there, not to whichever Ray this machine
    started last (another user's, perhaps)."""
    path = Path(run_dir) / "run.json"
    try:
        sessions = json.loads(path.read_text()).get("sessions", [])
    except (OSError, ValueError, AttributeError):
        return None
    latest = sessions[-1] if sessions else {}
    if not latest.get("address") or not latest.get("run_id"):
        return None
    return RecordedRun(Path(run_dir), str(latest["run_id"]), str(latest["address"]))


def live_runs() -> list[str]:
    """Run ids of every live run on the connected cluster (those whose outer optimizer actor is alive)."""
    import ray

    from orchestrator.actors.runtime import NAMESPACE

    names = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e.get("namespace") == NAMESPACE}
    return sorted(n[len("outer-"):] for n in names if n.startswith("outer-") and f"monitor-{n[len('outer-'):]}" in names)


def pick_run(runs: list[str], run_id: str | None, where: str) -> str:
    """The run to show: --run-id if given (and live), else the only live run. Raises JobError otherwise."""
    if run_id is not None:
        if run_id not in runs:
            known = ", ".join(runs) if runs else "none"
            raise JobError(f"no live run {run_id!r} at {where} (live runs: {known}); pass one of them to --run-id")
        return run_id
    if not runs:
        raise JobError(f"no live diloco run at {where}; start one with `diloco submit` or `diloco train --address`")
    if len(runs) > 1:
        raise JobError(f"{len(runs)} live runs at {where}: {', '.join(runs)}; pick one with --run-id")
    return runs[0]


def run_view(run_id: str, *, timeout_s: float = 60.0) -> dict:
    """Everything `diloco status` prints, read from the run's actors (no driver involved)."""
    import ray

    from orchestrator.actors.handles import call
    from orchestrator.actors.health_monitor import HealthMonitor
    from orchestrator.actors.outer import _OuterShell
    from orchestrator.actors.runtime import NAMESPACE
    from orchestrator.run.metrics import estimated_run_start, goodput_so_far, live_ledger

    outer: ActorHandle[_OuterShell] = ray.get_actor(f"outer-{run_id}", namespace=NAMESPACE)
    monitor: ActorHandle[HealthMonitor] = ray.get_actor(f"monitor-{run_id}", namespace=NAMESPACE)
    # First: the islands' statuses never newer than the ledger.
    snapshot = ray.get(call(monitor, HealthMonitor.snapshot), timeout=timeout_s)
    status, accounting, extra = ray.get([call(outer, _OuterShell.status), call(outer, _OuterShell.accounting),
                                         call(outer, _OuterShell.restored_extra)], timeout=timeout_s)
    now = time.time()
    run_start = estimated_run_start(snapshot["timeline"])
    # The driver's token ledger, as it noted it at its last tick (every half second): the count its final table will
    # show. A driver from before it noted one: computed here from the actors.
    ledger = extra.get("token_ledger") or live_ledger(status=status, snapshot=snapshot)
    so_far = goodput_so_far(ledger=ledger, accounting=accounting, snapshot=snapshot, run_start=run_start, now=now,
                            useful_before=extra.get("useful_s_before", 0.0))
    return {"run_id": run_id, "status": status, "extra": extra, "snapshot": snapshot, "so_far": so_far,
            "run_start": run_start, "now": now}


def format_view(view: dict) -> str:
    """The status report of one run, as printed by `diloco status`."""
    st, snap, so_far = view["status"], view["snapshot"], view["so_far"]
    shown = shown_fates(so_far["fates"])  # fragment means that add up to processed, as the final table shows them
    P = max(1, len(st["versions"]))
    mean = lambda xs: sum(xs) / P  # noqa: E731 - tokens count once per fragment; show the fragment mean
    elapsed = f"{view['now'] - view['run_start']:.0f} s" if view["run_start"] else "not yet training"
    good = "n/a (islands not all training yet)" if so_far["goodput"] is None else (
        f"{so_far['goodput']:.3f}, uptime {so_far['uptime']:.3f} "
        "(goodput's clock from when every island first trained, uptime's from the first version advance after every island was merged)")
    lines = [
        f"run {view['run_id']} ({elapsed})",
        f"fragment versions   {st['versions']}",
        f"rounds (refusals)   {st['rounds']} ({st['refusals']})",
        f"tokens processed    {shown['processed']:,}, of which merged {shown['merged']:,}, refused {shown['refused']:,}, "
        f"in flight {shown['in_flight']:,}, lost {shown['lost']:,}, overwritten {shown['overwritten']:,} (per fragment, mean)",
        f"salvaged            {sum(mean(s.get('tokens') or [0]) for s in snap.get('salvages', [])):,.0f} tokens of dead "
        f"islands' unsubmitted progress ({sum(1 for s in snap.get('salvages', []) if any(s.get('tokens') or [])):d} salvages; "
        f"progress keepers replaced {sum(snap.get('keeper_restarts', {}).values()):d} times)",
        f"bytes up / down     {st['bytes_up'] / 1e6:,.2f} MB / {st['bytes_down'] / 1e6:,.2f} MB",
        f"goodput so far      {good}",
        "islands:",
    ]
    # An island's tokens as the ledger counts them (its status's, or more when the outer optimizer received more).
    counted = incarnation_tokens([], [], {(int(i), int(inc)): t for i, inc, t in st.get("received", [])})
    for island, slot in sorted(snap["slots"].items(), key=lambda kv: int(kv[0])):
        s = slot["status"]
        steps, tokens = (s.steps, max(s.tokens, counted.get((s.island, s.incarnation), 0))) if s is not None else (0, 0)
        lines.append(f"  island {island} pool {slot['pool']}: {slot['state']}, incarnation {slot['incarnation']}, "
                     f"{steps} steps, {tokens:,} tokens, {slot['failures']} failures, {slot['restarts']} restarts")
    return "\n".join(lines)
