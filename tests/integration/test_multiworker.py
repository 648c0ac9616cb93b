"""Islands of several workers on a real local Ray cluster: data parallel inside the island's own
placement group, one failure domain. The math of one data-parallel step against a single-process
reference is pinned without Ray in tests/islands/test_distributed.py.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import ray
from ray.util.placement_group import placement_group_table

from islands.messages import FragmentUpdate
from islands.model import build_model, model_config
from orchestrator.actors.placement import create_island_group, island_scheduling, release_group
from orchestrator.actors.remote import NAMESPACE, IslandActor, IslandWorkerActor
from orchestrator.config import PoolConfig, build_config
from orchestrator.core.eventlog import read_events
from orchestrator.run.driver import Run
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config, spec_from_config
from tests.integration.test_self_healing import actor, finish, start, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

POOL_A = PoolConfig(name="a", labels={"pool": "a"}, cpus_per_island=0.5, workers_per_island=2)


def node_pools() -> dict[str, str]:
    return {n["NodeID"]: n.get("Labels", {}).get("pool") for n in ray.nodes() if n["Alive"]}


def test_two_worker_island_trains_data_parallel_in_its_placement_group(ray_cluster):
    cfg = model_config("nano")
    init = {n: p.detach().clone() for n, p in build_model(cfg, seed=5).named_parameters()}
    plan = plan_fragments([(n, t.numel() * 4) for n, t in init.items()], 2)
    inner = inner_from_config(lr=1e-2, warmup_steps=0, batch_size=4)
    spec = spec_from_config(island=0, incarnation=1, pool="a", num_islands=2, model_config=cfg, plan=plan, inner=inner,
                            sync_every_steps=4, seed=5, workers=2, adoption="overwrite")
    data = [ray.put(np.random.default_rng(0).integers(0, 256, size=40_000, dtype=np.uint8))]
    initial = [FragmentUpdate(p, 0, [ray.put([init[n] for n in frag])]) for p, frag in enumerate(plan.fragments)]

    group = create_island_group(POOL_A, name=f"mw-{uuid.uuid4().hex[:6]}", timeout_s=60)
    leader = follower = None
    try:
        leader = IslandActor.options(namespace=NAMESPACE, num_cpus=0.5,
                                     scheduling_strategy=island_scheduling(group)).remote(spec, data, initial, 0)
        addr, port = ray.get(leader.rendezvous.remote(), timeout=120)
        follower = IslandWorkerActor.options(namespace=NAMESPACE, num_cpus=0.5,
                                             scheduling_strategy=island_scheduling(group, bundle=1)).remote(
            spec, data, 1, addr, port)

        # Both workers run in the island's own group, on its two bundles, on nodes of pool "a".
        table = placement_group_table(group)
        assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
        pools = node_pools()
        assert {pools[n] for n in table["bundles_to_node_id"].values()} == {"a"}
        assert ray.get(leader.placement_group_id.remote(), timeout=60) == group.id.hex()
        assert ray.get(follower.placement_group_id.remote(), timeout=120) == group.id.hex()
        assert pools[ray.get(follower.node_id.remote(), timeout=60)] == "a"

        wait_for("the island to take some steps", lambda: ray.get(leader.status.remote(), timeout=10).steps >= 6, 120)
        final = ray.get(leader.stop.remote(), timeout=60)
        assert ray.get(follower.watch.remote(30), timeout=60) == "stopped", "the leader's stop reached the follower"
        assert final.state == "stopped" and final.error is None
        assert ray.get(follower.steps.remote(), timeout=10) == final.steps
        # The leader counts the island's tokens: both workers' batches every step.
        assert final.tokens == final.steps * 2 * inner.batch_size * cfg.seq_len
        assert final.cursor.batch == final.steps, "the data cursor counts island steps"

        mine, theirs = ray.get(leader.parameters.remote(), timeout=30), ray.get(follower.parameters.remote(), timeout=30)
        assert mine.keys() == theirs.keys() == init.keys()
        for n in mine:
            assert mine[n].equal(theirs[n]), f"{n}: the two workers' parameters differ"
        assert any(not mine[n].equal(init[n]) for n in mine), "training moved the parameters"
    finally:
        for handle in (leader, follower):
            if handle is not None:
                ray.kill(handle, no_restart=True)
        release_group(group)


def test_run_with_two_worker_island_merges_rebuilds_whole_after_a_follower_dies(ray_cluster, tmp_path):
    cfg = {
        "run": {"token_budget": 10**9, "seed": 3, "call_timeout_s": 20},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 1_000_000, "batch_size": 8},
        "eval": {"interval_s": 5.0, "batches": 2},
        "outer": {"sync_every_steps": 8, "num_fragments": 2},
        # One spare asked for: pools of several workers per island must get none (no room is left for it anyway).
        # A generous hang floor: this test is about a dead follower, not about hangs on a loaded machine.
        "health": {"warm_spares": 1, "hang_floor_s": 30.0, "tick_s": 0.2},
        "pools": [{"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "workers_per_island": 2}],
    }
    run = Run(build_config(cfg), tmp_path / "run")
    th, out = start(run)
    try:
        wait_for("the run to start", lambda: run.monitor is not None and run.snapshot["slots"])
        monitor = lambda: actor(f"monitor-{run.run_id}")  # noqa: E731
        outer = lambda: actor(f"outer-{run.run_id}")  # noqa: E731
        rounds = lambda: ray.get(outer().status.remote(), timeout=10)["rounds"]  # noqa: E731
        wait_for("rounds from the two-worker island", lambda: rounds() >= 2)

        leader, first = (ray.get_actor(f"{run.run_id}-island0-inc1{w}", namespace=NAMESPACE) for w in ("", "-w1"))
        pg = ray.get(leader.placement_group_id.remote(), timeout=10)
        assert pg and ray.get(first.placement_group_id.remote(), timeout=10) == pg
        assert ray.get(monitor().snapshot.remote(), timeout=10)["spares"] == {"a": 0}

        ray.kill(first, no_restart=True)  # the follower dies: the leader's next collective fails
        wait_for("the island to be rebuilt whole as incarnation 2", lambda: (
            lambda s: s["incarnation"] == 2 and s["state"] == "training")(
            ray.get(monitor().snapshot.remote(), timeout=10)["slots"][0]))
        names = lambda: {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if run.run_id in a["name"]}  # noqa: E731
        assert {f"{run.run_id}-island0-inc2", f"{run.run_id}-island0-inc2-w1"} <= names()
        # Kills and group removal are asynchronous in Ray: wait for them, they must happen.
        wait_for("the old leader killed too and the old group removed", lambda: (
            not {f"{run.run_id}-island0-inc1", f"{run.run_id}-island0-inc1-w1"} & names()
            and placement_group_table().get(pg, {}).get("state") in (None, "REMOVED")), 60)
        after = rounds()
        wait_for("rounds from the rebuilt island", lambda: rounds() >= after + 2)
    finally:
        summary = finish(run, th, out)

    detections = read_events(tmp_path / "run", "detections").to_pylist()
    # The leader's collective error, seen by its watch ("failed") or by a status check ("dead"), whichever is first.
    assert len(detections) == 1 and detections[0]["kind"] in ("failed", "dead"), detections
    assert summary["failures"] == 1 and summary["restarts"] == 1, detections
    assert summary["islands"][0]["incarnation"] == 2
    ledger = summary["token_ledger"]
    for p in range(2):
        assert ledger["processed"][p] == (ledger["merged"][p] + ledger["refused"][p] + ledger["in_flight"][p]
                                          + ledger["lost"][p] + ledger["overwritten"][p])
    assert summary["tokens_merged"] > 0 and math.isfinite(summary["eval_loss"])
    # Every island step counts both workers' batches.
    step_tokens = 2 * 8 * 32
    assert summary["tokens_processed"] % step_tokens == 0


def test_run_with_fsdp_island_shards_merges_and_rebuilds_whole_after_a_worker_dies(ray_cluster, tmp_path):
    cfg = {
        "run": {"token_budget": 10**9, "seed": 3, "call_timeout_s": 20},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 1_000_000, "batch_size": 8},
        "eval": {"interval_s": 5.0, "batches": 2},
        "outer": {"sync_every_steps": 8, "num_fragments": 2},
        # An FSDP island leaves no progress snapshots (each would hold the whole model): salvage off, as the config asks.
        "health": {"hang_floor_s": 30.0, "tick_s": 0.2, "salvage_every_steps": 0},
        "pools": [{"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "workers_per_island": 2,
                   "shard": "fsdp"}],
    }
    run = Run(build_config(cfg), tmp_path / "run")
    th, out = start(run)
    whole = {n: tuple(p.shape) for n, p in build_model(model_config("nano"), seed=3).named_parameters()}
    try:
        wait_for("the run to start", lambda: run.monitor is not None and run.snapshot["slots"])
        monitor = lambda: actor(f"monitor-{run.run_id}")  # noqa: E731
        outer = lambda: actor(f"outer-{run.run_id}")  # noqa: E731
        rounds = lambda: ray.get(outer().status.remote(), timeout=10)["rounds"]  # noqa: E731
        wait_for("rounds from the FSDP island", lambda: rounds() >= 2)

        leader, worker = (ray.get_actor(f"{run.run_id}-island0-inc1{w}", namespace=NAMESPACE) for w in ("", "-w1"))
        # Each worker holds its half of every parameter (dim-0 shards), never the whole.
        for handle in (leader, worker):
            parts = ray.get(handle.parameters.remote(), timeout=30)
            assert {n: p.shape[0] for n, p in parts.items()} == {n: s[0] // 2 for n, s in whole.items()}
        assert ray.get(worker.steps.remote(), timeout=10) > 0

        ray.kill(worker, no_restart=True)  # one worker dies: the leader's next collective fails
        wait_for("the island to be rebuilt whole as incarnation 2", lambda: (
            lambda s: s["incarnation"] == 2 and s["state"] == "training")(
            ray.get(monitor().snapshot.remote(), timeout=10)["slots"][0]))
        names = lambda: {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if run.run_id in a["name"]}  # noqa: E731
        assert {f"{run.run_id}-island0-inc2", f"{run.run_id}-island0-inc2-w1"} <= names()
        wait_for("the old leader killed too", lambda: f"{run.run_id}-island0-inc1" not in names(), 60)
        after = rounds()
        wait_for("rounds from the rebuilt island", lambda: rounds() >= after + 2)
    finally:
        summary = finish(run, th, out)

    assert summary["failures"] == 1 and summary["restarts"] == 1
    assert summary["islands"][0]["incarnation"] == 2
    ledger = summary["token_ledger"]
    for p in range(2):
        assert ledger["processed"][p] == (ledger["merged"][p] + ledger["refused"][p] + ledger["in_flight"][p]
                                          + ledger["lost"][p] + ledger["overwritten"][p])
    assert summary["tokens_merged"] > 0 and math.isfinite(summary["eval_loss"])
    assert summary["tokens_processed"] % (2 * 8 * 32) == 0, "every island step counts both workers' batches"
