"""Recovery from losing a node and from losing the driver, on a real local Ray cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from orchestrator.actors.remote import NAMESPACE
from orchestrator.config import apply_overrides, build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.run.driver import Run, resume_config, train
from tests.conftest import add_pool_node
from tests.engine.test_token_ledger import assert_shown_everywhere
from tests.integration.test_self_healing import actor, finish, held, start, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def small_config(**over) -> dict:
    cfg = {
        "run": {"token_budget": 10**9, "seed": 5, "call_timeout_s": 20},
        "model": {"preset": "nano"},  # about processes, not learning: leave the CPU to the restarts
        "data": {"max_bytes": 2_000_000},
        "eval": {"interval_s": 5.0, "batches": 2},
        "outer": {"sync_every_steps": 20},
        "checkpoint": {"every_s": 1.0, "keep": 5},
        # A node's loss on two loaded cores can starve the other pool's island for seconds (CI, 2026-12-03: island 1
        # restarted); a hang (5 s floor) there is not the failure these tests are about (test_self_healing's are).
        "health": {"warm_spares": 0, "tick_s": 0.2, "hang_floor_s": 60.0},
        "pools": [  # throttled (EMULATION): leave CPU for the restarts under test
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
            {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        ],
    }
    return apply_overrides(cfg, [f"{k}={v}" for k, v in over.items()])


def labels_of(node_id: str) -> dict:
    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)


def test_losing_a_node_rebuilds_the_island_on_its_pool_never_another(ray_cluster, tmp_path):
    cluster, nodes = ray_cluster
    run = Run(build_config(small_config()), tmp_path / "run")
    th, out = start(run)
    try:
        wait_for("island 0 to train", lambda: run.snapshot["slots"][0]["state"] == "training")
        first = run.snapshot["slots"][0]["node"]
        assert labels_of(first)["pool"] == "a"
        # Its pool's keeper holds its progress on the pool's other node (policies/keeper_placement.py).
        wait_for("island 0's progress to be with its keeper", lambda: 0 in held(f"{run.run_id}-keeper-a"))
        name = next(n for n, node in nodes.items() if node.node_id == first)
        cluster.remove_node(nodes.pop(name), allow_graceful=False)
        wait_for("island 0 to come back as incarnation 2",
                 lambda: run.snapshot["slots"][0]["incarnation"] >= 2 and run.snapshot["slots"][0]["state"] == "training")
        second = run.snapshot["slots"][0]["node"]
        assert second != first and labels_of(second)["pool"] == "a", "rebuilt in the same pool"
        assert run.snapshot["slots"][1]["incarnation"] == 1, (
            f"the other pool's island was not touched: {[d for d in run.snapshot.get('detections', []) if d['island'] == 1]}")
        # The node took the island, not its snapshot: what it had not submitted was salvaged.
        salvage = next(s for s in run.snapshot["salvages"] if (s["island"], s["incarnation"]) == (0, 1))
        assert sum(salvage.get("tokens") or []) > 0, salvage
        # The island now shares the pool's last node with the keeper. A node joining the pool is a better
        # place: the keeper moves there, and the island's snapshots go on being held.
        # While it moves, no actor has its name for a moment: get_actor raises ValueError and wait_for looks again.
        named = lambda: ray.get_actor(f"{run.run_id}-keeper-a", namespace=NAMESPACE)  # noqa: E731
        keeper_node = lambda: ray.get(named().node.remote(), timeout=10)  # noqa: E731
        assert keeper_node() == second
        joined = add_back(cluster, nodes, name)
        wait_for("the keeper to move to the joined node", lambda: keeper_node() == joined, timeout_s=60)
        wait_for("island 0 to shelve with it", lambda: ray.get(named().held.remote(), timeout=10).get(0, {}).get("incarnation") == 2)
        assert ray.get(actor(f"monitor-{run.run_id}").snapshot.remote(), timeout=10)["keeper_moves"] == {"a": 1}
    finally:
        summary = finish(run, th, out)
        if name not in nodes:  # give the session's cluster its node back for the tests that follow
            add_back(cluster, nodes, name)
    assert summary["failures"] == 1 and summary["restarts"] == 1 and summary["salvages"] == 1
    assert_shown_everywhere(summary)
    assert summary["keeper_restarts"] == 0, "the keeper was neither on the lost node nor lost when it moved"


def add_back(cluster, nodes: dict, name: str) -> str:
    """Re-add a removed node of the session's cluster with its labels; returns its node id."""
    nodes[name] = add_pool_node(cluster, name)
    cluster.wait_for_nodes()
    return nodes[name].node_id


def test_resume_after_the_driver_dies_skipping_a_corrupt_checkpoint(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(small_config()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    err_path = tmp_path / "driver.err"  # a file, not a pipe nobody reads: a full pipe would stall the driver
    with err_path.open("w") as err:
        driver = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "train", "--address", cluster.address, "--config", str(cfg_path),
             "--run-dir", str(run_dir), "--quiet"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    store = CheckpointStore(str(run_dir / "checkpoints"))

    def driver_alive() -> bool:
        assert driver.poll() is None, f"the driver exited with {driver.returncode}: {err_path.read_text()[-2000:]}"
        return True

    try:
        # The one before the newest (the resume falls back to it) must already hold merged rounds and
        # the driver's token count, which it notes every half second.
        wait_for("a few checkpoints with merged rounds and counted tokens", lambda: driver_alive() and len(store.list()) >= 3 and (
            lambda meta: sum(meta["outer"]["versions"]) >= 2 and meta["extra"].get("tokens_processed", 0) > 0)(
            store.load(store.list()[-2]).meta), timeout_s=180)
    finally:
        driver.send_signal(signal.SIGKILL)  # the driver dies without any cleanup
        driver.wait(30)
    old_run = json.loads((run_dir / "run.json").read_text())["run_id"]
    # Ray kills the dead driver's outer optimizer (not detached) only after it notices the owner is
    # gone: until then it may still write a checkpoint, which would land after the one corrupted below.
    wait_for("the dead driver's outer optimizer to be gone", lambda: f"outer-{old_run}" not in {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}, timeout_s=120)
    steps = store.list()
    newest, previous = store.load(steps[-1]), store.load(steps[-2])
    payload = Path(newest.path) / "tensors.bin"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flip one byte: the checksum must catch it
    payload.write_bytes(bytes(data))

    cfg = build_config(apply_overrides(resume_config(run_dir).model_dump(mode="json"), ["run.max_wall_s=5"]))
    summary = train(cfg, run_dir, resume=True)

    assert summary["resumed"] is True
    # The corrupt newest checkpoint was skipped: the resumed run started from the previous one.
    assert summary["evals"][0]["versions"] == previous.meta["outer"]["versions"]
    # The earlier session's ledger as of that checkpoint: its merged and refused tokens as it counts them, its
    # processed count as the dead driver last noted it (or more, where the checkpoint merged after the note), the
    # rest lost to the interruption. The resumed run counts on from there, and the whole run adds up.
    before, meta = summary["token_ledger_before"], previous.meta
    assert before["merged"] == meta["outer"]["tokens_merged"] and before["refused"] == meta["outer"]["tokens_refused"]
    assert summary["evals"][0]["tokens_processed"] == before["processed"][0] >= meta["extra"]["tokens_processed"] > 0
    assert summary["tokens_processed"] > summary["evals"][0]["tokens_processed"]
    assert_shown_everywhere(summary)
    assert summary["versions"] > previous.meta["outer"]["versions"] or sum(summary["versions"]) > sum(previous.meta["outer"]["versions"])
    # New incarnations continue above the dead driver's, and nothing of the old run is left behind.
    assert all(isl["incarnation"] >= 2 for isl in summary["islands"])
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if old_run in a["name"]]
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert len(sessions) == 2
