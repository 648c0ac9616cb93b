"""Elastic pools on a real local Ray cluster (docs/cluster.md, spare machines): a pool of islands {min, max} waits
for its minimum and says so, fills its slots as a labelled node joins, never places more than its maximum, lets its
islands leave a node drained with a 20 s deadline with every token merged, and heals as today when a node goes
without notice.

One run on the session cluster plus two nodes this test adds and removes (S1 with room for four islands, S2 for
two), with the unique-id corpus of test_stream_resume: every window's first token is its id, and a loss that logs
the ids of every training step is the ground truth for exactly once. The islands' streams are replayed here from the
run's data plan (metadata only), so each process's steps can be placed in its slot's stream.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray
from ray.util.placement_group import placement_group_table

from islands.stream import StreamSampler
from orchestrator.actors.drains import drain_node, draining_nodes
from orchestrator.config import build_config
from orchestrator.core.eventlog import read_events
from orchestrator.run.driver import Run
from orchestrator.run.streams import corpus_stream
from orchestrator.run.summary import format_summary
from orchestrator.run.workload import Workload
from policies.chaos import Fault, FaultTape
from tests.engine.test_token_ledger import assert_shown_everywhere
from tests.integration.test_self_healing import actor, finish, wait_for
from tests.integration.test_self_healing import start as start_training
from tests.integration.test_stream_resume import BATCH, SEED, SEQ, VOCAB, WindowLog, unique_ids_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]

DEADLINE_S = 20.0  # the drained node's deadline, as a preemption notice gives it
SPOT = {"pool": "spot", "region": "us-west"}


def config(corpus) -> dict:
    return {
        "run": {"token_budget": 10**9, "seed": SEED, "call_timeout_s": 20},
        "model": {"seq_len": SEQ},
        "data": {"source": "tokens", "path": str(corpus), "token_dtype": "uint16", "vocab_size": VOCAB,
                 "unit_tokens": 1024, "batch_size": BATCH, "block_batches": 4},
        "outer": {"sync_every_steps": 8, "num_fragments": 2},
        "eval": {"interval_s": 5.0, "batches": 2, "batch_size": 8},
        # A node start on two loaded cores can starve island 0 for seconds: a hang (5 s floor) would be a third
        # failure this test does not mean to count; hang detection has tests of its own (test_self_healing).
        "health": {"warm_spares": 0, "salvage_every_steps": 0, "backoff_base_s": 0.2, "tick_s": 0.2, "hang_floor_s": 60.0},
        "pools": [  # EMULATION: throttled steps, so the 2 cores keep up with the process starts under test
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 20.0},
            {"name": "spot", "islands": {"min": 1, "max": 2}, "labels": {"pool": "spot"}, "cpus_per_island": 0.5,
             "region": "us-west", "emulated_slowdown": 20.0},
        ],
    }


def replay(cfg, island: int, batches: int) -> list[tuple[int, ...]]:
    sampler = StreamSampler(corpus_stream(cfg).stream, island=island, seq_len=SEQ, batch_size=BATCH, seed=SEED)
    return [tuple(sampler.next_batch()[0][:, 0].tolist()) for _ in range(batches)]


def free_cpus(node_id: str) -> float:
    return ray._private.state.available_resources_per_node().get(node_id, {}).get("CPU", 0.0)


def spot_groups() -> dict[str, int]:
    """State -> count of this run's placement groups on pool spot's slots (islands 1 and 2)."""
    out: dict[str, int] = {}
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if ("-island1-" in name or "-island2-" in name) and info["state"] != "REMOVED":
            out[info["state"]] = out.get(info["state"], 0) + 1
    return out


def test_an_elastic_pool_waits_for_its_minimum_fills_on_join_and_loses_nothing_on_a_drain(ray_cluster, tmp_path):
    cluster, _ = ray_cluster
    corpus = tmp_path / "corpus.bin"
    np.arange(VOCAB, dtype="<u2").tofile(corpus)
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    cfg = build_config(config(corpus))
    run = Run(cfg, tmp_path / "run", workload=Workload(model=unique_ids_model, loss=WindowLog(str(ids_dir))))
    th, out = start_training(run)
    added = []
    try:
        wait_for("the monitor", lambda: run.monitor is not None)
        monitor = lambda: actor(f"monitor-{run.run_id}")  # noqa: E731
        snap = lambda: ray.get(monitor().snapshot.remote(), timeout=10)  # noqa: E731

        # No node of pool spot yet: the run waits for the pool's minimum, and says what it waits for.
        wait_for("the run to say it waits for pool spot", lambda: snap()["waiting"])
        waiting = snap()["waiting"]
        assert len(waiting) == 1 and "pool 'spot'" in waiting[0] and "0 of min 1 islands placed" in waiting[0], waiting
        time.sleep(2.0)
        assert snap()["waiting"] and not run.training_began, "the run must not start below its pool's minimum"

        # S1 joins with room for four islands: both slots fill (a join each), never more than the maximum.
        s1 = cluster.add_node(num_cpus=2, object_store_memory=150 << 20, labels=SPOT)
        added.append(s1)
        trained = lambda: all(snap()["slots"][i]["steps"] > 0 for i in (1, 2))  # noqa: E731
        wait_for("both spot slots to train on S1", trained)
        first = snap()
        assert [first["slots"][i]["node"] for i in (1, 2)] == [s1.node_id] * 2
        assert len(first["joins"]) == 2 and not first["waiting"]
        time.sleep(3.0)  # a few rounds with all three islands
        assert free_cpus(s1.node_id) == pytest.approx(1.0), "pool spot holds max 2 islands of 0.5 CPU on S1"
        assert spot_groups() == {"CREATED": 2}, spot_groups()

        # S1 is drained with a 20 s deadline (a preemption notice): its islands leave, their progress merged.
        drained_at = time.time()
        drain_node(s1.node_id, DEADLINE_S, "test: preemption notice")
        assert s1.node_id in draining_nodes()
        wait_for("both spot islands to leave S1", lambda: len(snap()["leaves"]) == 2, timeout_s=DEADLINE_S)
        leaves = snap()["leaves"]
        assert all(leave["merged"] and leave["at"] < drained_at + DEADLINE_S for leave in leaves), leaves
        assert [snap()["slots"][i]["state"] for i in (1, 2)] == ["vacant", "vacant"]
        cluster.remove_node(s1)  # the cloud takes the machine (before its deadline: nothing runs there any more)
        added.remove(s1)

        # S2 joins: the vacant slots fill again (two more joins), reading on where the leavers' merged work ended.
        s2 = cluster.add_node(num_cpus=1, object_store_memory=150 << 20, labels=SPOT)
        added.append(s2)
        wait_for("both spot slots to train on S2", lambda: all(
            snap()["slots"][i]["node"] == s2.node_id and snap()["slots"][i]["steps"] > 0 for i in (1, 2)))
        time.sleep(2.0)
        # S2 vanishes without notice: today's path (its islands fail, are restarted, wait for room: vacant again).
        cluster.remove_node(s2, allow_graceful=False)
        added.remove(s2)
        wait_for("the spot islands to fail and wait for room", lambda: all(
            snap()["slots"][i]["failures"] == 1 and snap()["slots"][i]["state"] == "vacant" for i in (1, 2)))
    finally:
        try:
            summary = finish(run, th, out)
        finally:
            for node in added:
                cluster.remove_node(node)
    assert summary["joins"] == 4 and summary["leaves"] == 2 and summary["leaves_merged"] == 2, summary
    assert summary["drained_tokens_lost"] == 0 and all(leave["tokens"] > 0 for leave in leaves), leaves
    assert summary["failures"] == 2  # S2's two islands; the drain was no failure
    assert "joins / leaves" in format_summary(summary)
    assert_shown_everywhere(summary)  # leaves, joins and failures: every token counted once, and the tables add up
    # Goodput is over the capacity the run had: the spot slots' vacant time is not allocated.
    vacant = summary["time_by_state_s"]["vacant"]
    assert vacant > 0 and summary["allocated_s"] == pytest.approx(3 * (summary["run_end"] - summary["run_start"])
                                                                   - vacant, rel=1e-6)

    # Exactly once. Each island process trained a contiguous run of its slot's stream; in each spot slot, the
    # island that joined on S2 started exactly where the one that left S1 ended (all of its steps merged), and
    # per slot and fragment the merged cursors strictly increase.
    streams = {i: replay(cfg, i, 600) for i in range(3)}
    where: dict[tuple, tuple[int, int]] = {}
    for i, batches in streams.items():
        for k, b in enumerate(batches):
            where.setdefault(b, (i, k))
    runs: dict[int, list[tuple[int, int]]] = {0: [], 1: [], 2: []}  # slot -> (first batch, steps) per process
    for log in ids_dir.glob("ids-*.log"):
        batches = [tuple(int(t) for t in line.split()) for line in log.read_text().splitlines()]
        if batches[0] not in where:
            continue  # the driver's check of the loss (a held-out batch)
        slot, start = where[batches[0]]
        assert list(batches) == streams[slot][start:start + len(batches)], log.name
        runs[slot].append((start, len(batches)))
    rounds = read_events(tmp_path / "run", "rounds").to_pylist()
    merged: dict[tuple[int, int], list[int]] = {}
    ends: dict[tuple[int, int], int] = {}
    for r in rounds:
        for island, inc, cursor in zip(r["participants"], r["incarnations"], r["cursors"]):
            merged.setdefault((island, r["fragment"]), []).append(cursor)
            ends[island, inc] = max(ends.get((island, inc), 0), cursor)
    for key, cursors in merged.items():
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors), key
    for slot in (1, 2):
        (start1, steps1), (start2, _) = sorted(runs[slot])[:2]
        assert start1 == 0 and start2 == start1 + steps1, (slot, runs[slot])
        assert ends[slot, 1] == steps1, f"slot {slot}: the island that left merged up to batch {ends[slot, 1]} of {steps1}"


# Extended (about 22 s of CI's serial Ray group): benchmarks/elastic.py runs both capacity kinds from a tape on every
# run of it, the tapes and Poisson draws of them are pure tests (tests/policies/test_chaos_capacity.py), and the test
# above drains and adds nodes directly; this one checks the injector's own `ray start` node and GCS drain end to end.
@pytest.mark.extended
def test_chaos_tape_joins_a_node_and_drains_it_and_the_island_leaves_with_its_progress(ray_cluster, tmp_path):
    """The chaos kinds for capacity: `node_joins` starts a labelled node (EMULATION: `ray start` on this machine)
    whose island joins; `drain_node` drains it through the GCS with a deadline, its island leaves with every
    token merged, and the node the tape started is stopped with the run."""
    tape = tmp_path / "tape.yaml"
    FaultTape((Fault(island=1, kind="node_joins", at_s=1.0),
               Fault(island=1, kind="drain_node", at_s=1.0, duration_s=DEADLINE_S))).to_yaml(tape)
    cfg = build_config({
        "run": {"token_budget": 10**9, "seed": SEED, "call_timeout_s": 20},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 1_000_000},
        "eval": {"interval_s": 5.0, "batches": 2},
        "health": {"warm_spares": 0, "salvage_every_steps": 0, "tick_s": 0.2, "hang_floor_s": 60.0},
        "chaos": {"mode": "tape", "params": {"path": str(tape)}},
        "pools": [
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
            {"name": "scavenged", "islands": {"min": 0, "max": 1}, "labels": {"pool": "scavenged"},
             "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        ],
    })
    run = Run(cfg, tmp_path / "run")
    th, out = start_training(run)
    try:
        wait_for("the monitor", lambda: run.monitor is not None)
        snap = lambda: ray.get(actor(f"monitor-{run.run_id}").snapshot.remote(), timeout=10)  # noqa: E731
        wait_for("the scavenged island to join and then leave", lambda: len(snap()["leaves"]) == 1)
        # It left the node the tape started and then drained (once idle, a drained raylet may exit at once, so the
        # GCS's draining list is no witness here).
        assert snap()["leaves"][0]["node"] == snap()["joins"][0]["node"], snap()
    finally:
        summary = finish(run, th, out)
    assert summary["faults_injected"] == 2 and summary["joins"] == 1 and summary["leaves"] == 1, summary
    assert summary["leaves_merged"] == 1 and summary["drained_tokens_lost"] == 0 and summary["failures"] == 0, summary
    assert_shown_everywhere(summary)
    labels = [n.get("Labels", {}).get("pool") for n in ray.nodes() if n["Alive"]]
    assert "scavenged" not in labels, "the node the tape started must not outlive the run"
