"""Shared fixtures. Tests that start Ray share one session-scoped labelled cluster (docs/architecture.md section 7)."""

from __future__ import annotations

import os

import pytest

# Token authentication is on by default for local clusters in Ray 2.60; every Ray process this
# suite starts (Cluster nodes, `ray start` for Jobs tests) and every client must agree, so the suite
# turns it off once, before anything starts Ray.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
# Ray starts its worker processes (every actor) at nice 15 below its raylets and GCS at 0, so that they keep
# answering health checks. 10 keeps that order (a raylet weighs 9x a worker) and puts the actors well above the
# Ray-free tests that xdist runs beside them at nice 19 (RAY_FREE_NICE below): before, at equal nice 0 with the
# test processes, those took most of a contended core from the islands.
os.environ.setdefault("RAY_worker_niceness", "10")

# Node death noticed in a few seconds instead of ~20-45 s (docs/architecture.md section 4, Testing). Not
# the notes' 200 ms x 3: on a loaded 2-core machine a raylet can miss 600 ms of checks while processes
# start, the GCS then declares the head node dead, its raylet exits and takes the test driver with it
# (seen: pytest killed mid-suite). A node must stay silent for ~3.5 s here.
FAST_NODE_DEATH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
    "health_check_timeout_ms": 1500,
}

# Pools of the test cluster: pool "a" has two nodes (failover inside a pool), pool "b" one.
POOL_NODES = [("a1", "a", "us-east"), ("a2", "a", "us-east"), ("b1", "b", "eu-west")]


def add_pool_node(cluster, name: str):
    """Add node `name` of POOL_NODES to `cluster`: 1 CPU, labelled with its pool and region."""
    _, pool, region = next(p for p in POOL_NODES if p[0] == name)
    return cluster.add_node(num_cpus=1, object_store_memory=150 << 20, labels={"pool": pool, "region": region})


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster: a head with no CPUs and three 1-CPU worker nodes labelled by pool."""
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.actors.remote import WORKER_ENV

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 200 << 20,
                        "_system_config": FAST_NODE_DEATH},
    )
    nodes = {name: add_pool_node(cluster, name) for name, _, _ in POOL_NODES}
    cluster.wait_for_nodes()
    # RAY_ADDRESS in every worker of this driver: Ray Train's PlacementGroupCleaner asks the state API whether
    # its controller lives, and without an address it picks the newest Ray on the machine. Under xdist another
    # worker's test may have started one, where the controller is unknown, and the cleaner would then remove
    # the data-parallel baseline's placement group mid-run ("Found multiple active Ray instances" in the log).
    env = {**WORKER_ENV, "RAY_ADDRESS": cluster.address}
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level="WARNING")
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(autouse=True)
def no_leftovers(request):
    """After a test on the shared cluster: every CPU is free again and no placement group is left.

    A leak here would silently starve the next test's islands (they would wait for capacity).
    """
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import time

    import ray
    from ray.util.placement_group import placement_group_table

    deadline = time.monotonic() + 20
    while True:
        total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
        groups = {i["name"]: i["state"] for i in placement_group_table().values() if i["state"] != "REMOVED"}
        if free == total and not groups:
            return
        if time.monotonic() > deadline:
            actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
            pytest.fail(f"leftovers after the test: {free}/{total} CPUs free, groups {groups}, named actors {actors}")
        time.sleep(0.5)


# The xdist group (.ci/run: `pytest -n 2 --dist loadgroup`) of every test that starts or uses Ray: one
# worker runs them all, in collection order, on its own session cluster, while the other runs the Ray-free
# tests beside them.
RAY_GROUP = "ray"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group into each test's id
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, every test marked `ray` (the session cluster's, and those that start a Ray of their
    own: the Jobs test, the CLI runs) runs in one group, so in one worker, one at a time.

    The Ray tests keep about 1.5 of 2 cores busy on their own (start-up, waits for detection, emulated slow
    pools that sleep); the Ray-free tests (about 2 minutes of one core) fill the rest from the other worker.
    Two Ray tests at once (two clusters, or a cluster and a CLI run's own Ray) fought for the cores and made a
    start-up race fail (benchmarks/RESULTS.md#test-suite-timings). Without xdist the marks are inert.
    """
    for item in items:
        if item.get_closest_marker("ray") is not None or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))


# The Ray group is the suite's critical path (about 690 s alone on 2 cores, benchmarks/RESULTS.md#test-suite-timings);
# the Ray-free tests are about 230 s of one core. Ray runs its worker processes (every actor: islands, the outer
# optimizer, the monitor) at nice 15, so the Ray-free tests beside them at nice 0 took nearly all of a contended core:
# one Jobs test took 39 s alone and 118 s in the suite, which ran past CI's 15 minutes. At 19 they take what Ray's
# workers leave idle (waits for detection, emulated slow pools that sleep) and a share of the rest.
RAY_FREE_NICE = 19


def pytest_runtest_setup(item):
    """Under xdist, run a Ray-free test at nice RAY_FREE_NICE and a Ray test at 0 (the worker's thread and whatever it
    starts: a Ray test's cluster and CLI runs keep full priority). Lowering it back needs root (CI's machines); where
    that is refused, the worker stays where it is."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not hasattr(os, "setpriority"):
        return
    in_ray_group = any(m.args[:1] == (RAY_GROUP,) for m in item.iter_markers("xdist_group"))
    want = 0 if in_ray_group else RAY_FREE_NICE
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != want:
            os.setpriority(os.PRIO_PROCESS, 0, want)
    except OSError:
        pass
