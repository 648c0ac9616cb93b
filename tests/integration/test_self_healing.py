"""Self-healing on a real local Ray cluster: faults from a tape, state checks instead of tuned sleeps."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table

from orchestrator.actors.remote import NAMESPACE
from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.core.eventlog import read_events
from orchestrator.run.driver import Run
from policies.chaos import Fault, FaultTape
from tests.engine.test_token_ledger import assert_shown_everywhere

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# An island with no progress for this long is hung (health.hang_floor_s; the factor x step time is below it here).
# 3 s let a loaded 2-core machine (the suite's other worker busy) stall a healthy island past it: seen twice, once
# as island 0 restarted, once as the corrupted island 2 declared hung (and salvaged) before its refusal; 6 s let it
# happen once more (2026-12-03, island 2 silent 6.1 s at step 10, its first cut, before its corrupt submission).
HANG_FLOOR_S = 10.0


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 150.0) -> None:
    """Poll a state check; the timeout only bounds a broken run, it is not a tuned delay."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except AssertionError:  # a check inside the condition failed: that is the test's answer
            raise
        except Exception:  # noqa: BLE001 - an actor restarting mid-check: look again
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for: {what}")


def config(tmp_path, tape: FaultTape | None = None, **health) -> dict:
    chaos = {"mode": "none"}
    if tape is not None:
        tape.to_yaml(tmp_path / "tape.yaml")
        chaos = {"mode": "tape", "params": {"path": str(tmp_path / "tape.yaml")}}
    return {
        "run": {"token_budget": 10**9, "seed": 3, "call_timeout_s": 20},
        # The smallest model: these tests are about processes, not learning, and an island that needs
        # little CPU leaves the 2 cores to the restarts under test.
        "model": {"preset": "nano"},
        "data": {"max_bytes": 3_000_000},
        "eval": {"interval_s": 5.0, "batches": 2},
        "outer": {"sync_every_steps": 20, "num_fragments": 2},
        "checkpoint": {"every_s": 2.0, "keep": 100},  # keep the restored one on disk for the check
        "health": {"warm_spares": 0, "hang_floor_s": HANG_FLOOR_S, "hang_factor": 10.0, "tick_s": 0.2, **health},
        "chaos": chaos,
        # Throttled (EMULATION) so islands leave CPU for the process starts these tests are about.
        "pools": [
            {"name": "a", "islands": 2, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
            {"name": "b", "islands": 2, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        ],
    }


def start(run: Run) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def body() -> None:
        try:
            out["summary"] = run.train()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = err

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, out


def finish(run: Run, th: threading.Thread, out: dict) -> dict:
    run.request_stop()
    th.join(120)
    run.teardown()
    if "error" in out:
        raise out["error"]
    assert "summary" in out, "run.train() did not return within the join timeout after the stop was asked"
    return out["summary"]


def held(prefix: str) -> dict:
    """What the keeper whose name starts with `prefix` holds; {} before it exists (a fresh run's keepers start
    once its islands have stepped, orchestrator/actors/health_monitor.py)."""
    if not any(a["name"].startswith(prefix) for a in ray.util.list_named_actors(all_namespaces=True)):
        return {}
    return ray.get(actor(prefix).held.remote(), timeout=10)


def actor(prefix: str, attempts: int = 3):
    """The one live actor whose name starts with `prefix`. Listing and looking up are two calls: an actor
    that is killed or replaced between them is looked up again (seen once: listed, then not found)."""
    for attempt in range(attempts):
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        assert len(names) == 1, names
        try:
            return ray.get_actor(names[0], namespace=NAMESPACE)
        except ValueError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5)


def test_islands_heal_and_no_single_point_of_failure(ray_cluster, tmp_path):
    tape = FaultTape((
        Fault(island=2, kind="corrupt_submission", at_step=12),
        Fault(island=3, kind="hang", at_step=12),
    ))
    run = Run(build_config(config(tmp_path, tape)), tmp_path / "run")
    th, out = start(run)
    try:
        wait_for("the run to start", lambda: run.monitor is not None and run.snapshot["slots"])
        monitor = lambda: actor(f"monitor-{run.run_id}")  # noqa: E731
        outer = lambda: actor(f"outer-{run.run_id}")  # noqa: E731

        # Island 1 is killed here, while its pool's keeper holds a snapshot of it (from step 30 on) that is still
        # worth salvaging. A tape fault at a fixed step raced the keeper: a fresh run's keepers start once every
        # island has stepped (seconds, on a loaded machine), and a snapshot sent while the previous one is in
        # flight is skipped. Seen in CI: killed at step 32 holding only a step-15 snapshot, both fragments cut
        # again since, nothing left to salvage. Cuts come every 10 steps (H=20, 2 fragments) and a snapshot at
        # step s holds what was not yet cut, so it is worth salvaging until the second cut after s: 10 steps
        # on when s is a cut step (only the other fragment has progress), 15 otherwise. Killing within 4 steps
        # of s leaves 6 steps for the kill to land.
        killed: dict = {}

        def kill_island_1_while_its_snapshot_holds() -> bool:
            kept = held(f"{run.run_id}-keeper-a").get(1)
            if kept is None or kept["incarnation"] != 1 or kept["step"] < 30:
                return False
            island = actor(f"{run.run_id}-island1-inc1")
            steps = ray.get(island.status.remote(), timeout=10).steps
            if steps > kept["step"] + 4:
                return False  # arrived too late to be sure of it: wait for a newer one
            ray.kill(island, no_restart=True)
            killed.update(snapshot_step=kept["step"], island_step=steps)
            return True

        wait_for("a fresh snapshot of island 1 in pool a's keeper, to kill it", kill_island_1_while_its_snapshot_holds)

        def healed() -> bool:
            slots = ray.get(monitor().snapshot.remote(), timeout=10)["slots"]
            return all(slots[i]["incarnation"] >= 2 and slots[i]["state"] == "training" for i in (1, 2, 3))

        # Killed, corrupted (NaN refused -> restarted) and hung islands all come back as incarnation 2.
        wait_for("islands 1, 2, 3 to rejoin as incarnation 2", healed)
        snap = ray.get(monitor().snapshot.remote(), timeout=10)
        assert [snap["slots"][i]["failures"] for i in range(4)] == [0, 1, 1, 1]
        assert snap["slots"][0]["incarnation"] == 1
        # What island 1 had not yet submitted was salvaged from its pool's keeper; the diverged island's was not.
        salvaged = {(s["island"], s["incarnation"]): s for s in snap["salvages"]}
        assert sum(salvaged[(1, 1)]["tokens"]) > 0 and salvaged[(1, 1)]["step"] >= 30, (killed, salvaged)
        assert not sum(salvaged.get((2, 1), {}).get("tokens") or [0]), (
            f"a diverged island's progress is not merged: {salvaged[(2, 1)]}, slot 2: {snap['slots'][2]}")
        keeper = actor(f"{run.run_id}-keeper-a")._actor_id.hex()
        for i in (1, 2, 3):
            assert ray.get(actor(f"{run.run_id}-island{i}-inc2").ping.remote(), timeout=10)[:2] == (i, 2)
        # The monitor restarted three islands without ever loading torch (its process stays light);
        # the islands it started did not inherit its runtime env's zero-copy switch.
        assert not ray.get(monitor().__ray_call__.remote(lambda _: "torch" in sys.modules), timeout=10)
        zero_copy = lambda _: os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")  # noqa: E731
        assert ray.get(actor(f"{run.run_id}-island1-inc2").__ray_call__.remote(zero_copy), timeout=10) == "1"

        # Killing the health monitor takes no island with it; the restarted monitor re-adopts them.
        before = {i: s["name"] for i, s in snap["slots"].items()}
        ids = {i: actor(n)._actor_id.hex() for i, n in before.items()}
        pid = lambda: ray.get(monitor().__ray_call__.remote(lambda _: os.getpid()), timeout=10)  # noqa: E731
        old_pid = pid()
        # A group the monitor reserved for a restart it did not finish when it was killed (as a soak's kill did):
        # it holds pool capacity with no island in it, and its name is the one that slot's next restart asks for.
        unfinished = placement_group([{"CPU": 0.01}], name=f"{run.run_id}-island0-inc9", lifetime="detached")
        ray.get(unfinished.ready(), timeout=30)
        ray.kill(monitor(), no_restart=False)  # asynchronous: the old process may answer once more
        wait_for("the monitor to restart", lambda: pid() != old_pid)
        wait_for("the monitor to re-adopt the islands", lambda: ray.get(monitor().snapshot.remote(), timeout=10)["slots"][0]["name"] == before[0])
        groups = lambda: {g["name"]: g["state"] for g in placement_group_table().values()  # noqa: E731
                          if run.run_id in (g["name"] or "")}
        wait_for("the restarted monitor to remove the unfinished group",
                 lambda: groups()[f"{run.run_id}-island0-inc9"] == "REMOVED")
        assert all(groups()[name] == "CREATED" for name in before.values()), ("it kept its islands'", groups())
        after = ray.get(monitor().snapshot.remote(), timeout=10)
        assert {i: s["name"] for i, s in after["slots"].items()} == before
        assert {i: actor(n)._actor_id.hex() for i, n in before.items()} == ids
        assert [after["slots"][i]["failures"] for i in range(4)] == [0, 1, 1, 1], "its bookkeeping survived"
        assert actor(f"{run.run_id}-keeper-a")._actor_id.hex() == keeper, "the keeper, too, outlived the monitor"
        assert after["salvages"] == snap["salvages"]

        # Killing the outer optimizer: it restores its newest checkpoint and rounds go on. Periodic
        # checkpoints (every 2 s) may land between ours and the kill, so the restart restores ours
        # or a newer one, and exactly the versions that checkpoint holds on disk.
        taken = ray.get(outer().checkpoint.remote(), timeout=20)
        ray.kill(outer(), no_restart=False)
        wait_for("the outer optimizer to come back from its checkpoint", lambda: ray.get(outer().health.remote(), timeout=10)["epoch"] >= 1)
        status = ray.get(outer().status.remote(), timeout=10)
        source = status["restored_from"]
        assert source["step"] >= taken["step"]
        assert all(r >= t for r, t in zip(source["versions"], taken["versions"])), (source, taken)
        on_disk = CheckpointStore(str(tmp_path / "run" / "checkpoints")).load(source["step"]).meta["outer"]["versions"]
        assert source["versions"] == on_disk, "restored exactly the versions its checkpoint holds"
        restored = source["versions"]
        wait_for("rounds to continue after the restore",
                 lambda: sum(ray.get(outer().status.remote(), timeout=10)["versions"]) > sum(restored) + 2)
    finally:
        summary = finish(run, th, out)

    # The run finished with every token accounted for: processed = the sum of its fates in each fragment, one
    # count in summary.json, the final table, report.md, the islands' rows and events, and the last evaluation.
    assert_shown_everywhere(summary)
    rows = read_events(tmp_path / "run", "islands").to_pylist()
    assert sum(r["tokens_processed"] for r in rows) == summary["tokens_processed"], rows
    assert summary["tokens_lost"] > 0 and summary["tokens_refused"] > 0
    assert summary["failures"] == 3 and summary["restarts"] == 3 and summary["faults_injected"] == 2
    assert math.isfinite(summary["eval_loss"]) and summary["eval_loss"] < summary["evals"][0]["eval_loss"]
    refusals = read_events(tmp_path / "run", "refusals").to_pylist()
    assert any(r["island"] == 2 and "non-finite" in r["reason"] for r in refusals)

    # Global versions kept advancing while island 1 was down (no global stall).
    timeline = read_events(tmp_path / "run", "timeline").to_pylist()
    down = min(e["at"] for e in timeline if e["island"] == 1 and e["state"] == "dead")
    up = min(e["at"] for e in timeline if e["island"] == 1 and e["incarnation"] == 2 and e["state"] == "training")
    rounds = read_events(tmp_path / "run", "rounds").to_pylist()
    assert any(down < r["wall_time"] < up for r in rounds)
    # Island 1's salvaged progress was merged after it died, in rounds of the live islands.
    keys = {(i, inc, seq) for r in rounds for i, inc, seq in zip(r["participants"], r["incarnations"], r["seqs"])}
    assert {(1, 1, seq) for seq in salvaged[(1, 1)]["seqs"]} <= keys
    assert summary["salvaged_tokens"] > 0 and summary["salvage_snapshot_bytes"] > 0
    # The hang was detected within the island's own timeout (factor x step time, at least the floor).
    faults = {f["island"]: f for f in read_events(tmp_path / "run", "faults").to_pylist()}
    assert set(faults) == {2, 3} and all(f["outcome"] == "fired" for f in faults.values())
    detected = {d["island"]: d for d in read_events(tmp_path / "run", "detections").to_pylist()}
    assert {i: detected[i]["kind"] for i in (1, 2, 3)} == {1: "dead", 2: "diverged", 3: "hung"}
    # Hung: no progress for max(the floor, 10 step times); seen within that plus a few health ticks.
    latency = detected[3]["detected_at"] - detected[3]["fault_at"]
    assert HANG_FLOOR_S <= latency <= HANG_FLOOR_S + 27.0, latency


def test_a_keeper_is_placed_in_its_pool_away_from_its_islands(ray_cluster, tmp_path):
    """Pool a has two nodes and one island: its keeper takes the other node, so losing either node
    leaves the island or its snapshot. Pool b has one node, alone in its region: its keeper shares it
    (the fallback). Pool solo has one node in a region with another: its keeper takes that one. A
    keeper that dies is replaced at once."""
    _, nodes = ray_cluster
    cfg = config(tmp_path)
    # Pool "solo" is one node (a1, named by its id) in region us-east, like a pool of configs/multi-region.yaml:
    # its keeper goes to the region's other node (a2), not onto its island's.
    cfg["pools"] = [
        {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        {"name": "solo", "islands": 1, "labels": {"ray.io/node-id": nodes["a1"].node_id, "region": "us-east"},
         "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
    ]
    run = Run(build_config(cfg), tmp_path / "run")
    th, out = start(run)
    try:
        wait_for("the run to start", lambda: run.monitor is not None and run.snapshot["slots"])
        monitor = lambda: actor(f"monitor-{run.run_id}")  # noqa: E731
        node = lambda handle: ray.get(handle.__ray_call__.remote(  # noqa: E731
            lambda _: ray.get_runtime_context().get_node_id()), timeout=20)
        # Both islands shelve into their keeper: the late-started keeper was found by name.
        wait_for("every keeper to hold a snapshot", lambda: all(held(f"{run.run_id}-keeper-{p}") for p in ("a", "b", "solo")))
        slots = ray.get(monitor().snapshot.remote(), timeout=10)["slots"]
        island_a, island_b = slots[0]["node"], slots[1]["node"]
        pool_a = {nodes["a1"].node_id, nodes["a2"].node_id}
        assert island_a in pool_a and island_b == nodes["b1"].node_id
        assert node(actor(f"{run.run_id}-keeper-a")) == (pool_a - {island_a}).pop(), "pool a's keeper is not on its island's node"
        assert node(actor(f"{run.run_id}-keeper-b")) == nodes["b1"].node_id, "pool b's keeper stays in its pool"
        assert slots[2]["node"] == nodes["a1"].node_id
        assert node(actor(f"{run.run_id}-keeper-solo")) == nodes["a2"].node_id, "in its region, off its island's node"

        # A keeper that dies (killed here, as with its node) is replaced before any island needs it; the
        # islands shelve into the new one, which is placed by the same rule.
        old = actor(f"{run.run_id}-keeper-a")
        ray.kill(old, no_restart=True)

        def replaced() -> bool:
            # One lookup: between two, the killed keeper's name can go (seen: listed, then not found).
            try:
                return ray.get_actor(f"{run.run_id}-keeper-a", namespace=NAMESPACE)._actor_id != old._actor_id
            except ValueError:  # no actor of that name: the old one is gone, the new one not yet registered
                return False

        wait_for("a new keeper of pool a", replaced, timeout_s=60)
        wait_for("island 0 to shelve into it", lambda: ray.get(actor(f"{run.run_id}-keeper-a").held.remote(), timeout=10))
        assert node(actor(f"{run.run_id}-keeper-a")) == (pool_a - {island_a}).pop()
        assert ray.get(monitor().snapshot.remote(), timeout=10)["keeper_restarts"] == {"a": 1}
    finally:
        summary = finish(run, th, out)
    assert summary["keeper_restarts"] == 1
