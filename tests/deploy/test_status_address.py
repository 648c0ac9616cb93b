"""`diloco status` with no --address attaches to the Ray the user's own run recorded, not the machine's last one.

No Ray: the connection and the run's actors are stood in for. A local `diloco train` records its Ray's GCS
address in RUN_DIR/run.json; `diloco status` reads runs/latest's (or RUN_DIR's). Before, it joined `auto`,
the Ray this machine started last, which on a shared machine was another user's run.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

import orchestrator.cli.jobs as cli_jobs
from orchestrator.cli.main import main


def _run_dir(root, name: str, run_id: str, address: str | None, *, link: bool = True):
    run = root / "runs" / name
    run.mkdir(parents=True)
    session = {"run_id": run_id, "started": 1.0, **({"address": address} if address else {})}
    (run / "run.json").write_text(json.dumps({"run_id": run_id, "sessions": [session]}))
    if link:
        os.symlink(name, root / "runs" / "latest", target_is_directory=True)
    return run


def _dead_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """This machine: its last-started Ray (Ray's `auto` record) is someone else's, never to be joined."""
    import ray._private.services as services

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    asked = []
    monkeypatch.setattr(services, "get_ray_address_from_environment",
                        lambda addr, temp_dir: asked.append(addr) or "10.9.9.9:6379")
    return tmp_path, asked


def test_status_attaches_to_the_ray_and_run_that_runs_latest_recorded(machine, monkeypatch, capsys):
    root, asked = machine
    _run_dir(root, "20261201-220000", "20261201-220000-abc123", "127.0.0.1:45678")
    joined, shown = [], []
    monkeypatch.setattr(cli_jobs, "connect", joined.append)
    # Two live runs on that Ray, the other user's first: the recorded run id picks ours.
    monkeypatch.setattr(cli_jobs, "live_runs", lambda: ["other-user-run", "20261201-220000-abc123"])
    monkeypatch.setattr(cli_jobs, "run_view", lambda run_id: shown.append(run_id) or {"run_id": run_id})
    monkeypatch.setattr(cli_jobs, "format_view", lambda view: f"run {view['run_id']}")
    assert main(["status"]) == 0
    assert joined == ["127.0.0.1:45678"] and shown == ["20261201-220000-abc123"] and asked == []
    assert capsys.readouterr().out.strip() == "run 20261201-220000-abc123"
    # --run-id still picks another run on that Ray; --address still wins over the record.
    assert main(["status", "--run-id", "other-user-run"]) == 0 and shown[-1] == "other-user-run"
    assert main(["status", "--address", "127.0.0.1:7777", "--run-id", "other-user-run"]) == 0
    assert joined[-1] == "127.0.0.1:7777"


def test_a_finished_local_run_is_named_not_swapped_for_another_users(machine, capsys):
    root, asked = machine
    dead = _dead_address()
    _run_dir(root, "20261201-220000", "20261201-220000-abc123", dead)
    assert main(["status"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"diloco status: the run in runs/latest (20261201-220000-abc123) is not running: its Ray at {dead} "
                   "does not answer (a local run's Ray stops with it); `diloco report runs/latest` shows how it ended, "
                   "or pass --address HEAD:6379 for a run elsewhere")
    assert asked == [], "the machine's last-started Ray was consulted"


def test_a_run_dir_argument_without_a_recorded_address_says_so(machine, capsys):
    root, _ = machine
    old = _run_dir(root, "old", "old-1", None, link=False)  # a run from before runs recorded their Ray
    assert main(["status", str(old)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"diloco status: {old} records no Ray address")


def test_without_a_run_of_its_own_here_status_joins_this_machines_cluster(machine, monkeypatch, capsys):
    _, asked = machine  # a cluster node: no runs/latest in the working directory
    joined = []
    monkeypatch.setattr(cli_jobs, "connect", joined.append)
    monkeypatch.setattr(cli_jobs, "live_runs", lambda: [])
    assert main(["status"]) == 2
    assert joined == [None]
    assert capsys.readouterr().err.strip().startswith("diloco status: no live diloco run at this machine's cluster (auto)")


def test_the_run_directory_records_its_rays_address(tmp_path):
    from orchestrator.config import RunConfig
    from orchestrator.run.setup import prepare_run_dir

    run = tmp_path / "run"
    run.mkdir()
    prepare_run_dir(RunConfig(), run, "run-1", resume=False, address="10.0.0.5:6379")
    (session,) = json.loads((run / "run.json").read_text())["sessions"]
    assert (session["run_id"], session["address"]) == ("run-1", "10.0.0.5:6379")
