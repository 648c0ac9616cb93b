"""What a Ray started by the driver itself can never host (orchestrator.run.local_fit.local_problems).

A local Ray is one node that never grows: a pool it cannot host would wait for placement forever,
warning every placement_timeout_s. The driver refuses such a run at once, in one line naming the pool,
the shortfall and the fix. Pure checks first, then the real thing: `diloco train` with a GPU pool on
this GPU-less machine starts its own Ray and stops with that line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from orchestrator.config import load_config
from orchestrator.run.local_fit import local_problems

CPU_NODE = {"CPU": 2.0, "memory": 1e10, "object_store_memory": 1e9}


def test_the_default_config_fits_a_local_ray():
    assert local_problems(load_config(None, []), labels={"ray.io/node-id": "abc"}, resources=CPU_NODE) == []


def test_gpus_are_counted_for_every_island_worker_and_warm_spare():
    # One island and its warm spare at one GPU each: 2 needed.
    cfg = load_config(None, ["pools=[{name: g, accelerator: H100, gpus_per_worker: 1}]"])
    [msg] = local_problems(cfg, labels={}, resources=CPU_NODE)
    assert msg.startswith("pools g need GPU 2 at once (every island, worker and warm spare) but the local Ray this "
                          "run started has 0; lower gpus_per_worker (islands may share a card")
    assert local_problems(cfg, labels={}, resources={**CPU_NODE, "GPU": 1.0})  # still one short
    assert local_problems(cfg, labels={}, resources={**CPU_NODE, "GPU": 2.0}) == []
    # The shape that ran on one H200: 2 islands + 1 spare at 0.25 GPU, beside a CPU pool.
    shared = load_config(None, ["pools=[{name: g, islands: 2, accelerator: H200, gpus_per_worker: 0.25}, {name: c}]"])
    assert local_problems(shared, labels={}, resources={**CPU_NODE, "GPU": 1.0}) == []
    # Multi-worker islands get no warm spare: 2 islands x 2 workers = 4 GPUs.
    multi = load_config(None, ["pools=[{name: m, islands: 2, workers_per_island: 2, accelerator: H100, gpus_per_worker: 1}]"])
    assert "need GPU 4 at once" in local_problems(multi, labels={}, resources={**CPU_NODE, "GPU": 3.0})[0]


def test_labels_and_custom_resources_the_node_lacks_are_named():
    cfg = load_config(None, ["pools=[{name: a, labels: {pool: a}}, {name: b, resources: {pool_b: 1}}, "
                             "{name: c, labels: {pool: '!x'}}]"])
    problems = local_problems(cfg, labels={"ray.io/node-id": "abc"}, resources=CPU_NODE)
    assert problems == [
        "pool 'a' selects nodes labelled {pool=a}, which the local Ray this run started is not; drop the pool's "
        "labels for a local run, or pass --address of a cluster that has such nodes",
        "pools b need pool_b 2 at once (every island, worker and warm spare) but the local Ray this run started "
        "has 0; drop it from the pools' resources for a local run, or pass --address of a cluster that has it",
    ]  # pool c's negated selector matches a node without the label
    assert local_problems(cfg, labels={"pool": "a"}, resources={**CPU_NODE, "pool_b": 2.0}) == []


@pytest.mark.ray  # the CLI starts a local Ray of its own
def test_diloco_train_refuses_a_gpu_pool_on_a_machine_without_gpus_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DILOCO_RAY_ADDRESS")}
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", "--quiet", "--run-dir", str(tmp_path / "run"),
         "--set", "pools=[{name: g, accelerator: H100, gpus_per_worker: 1}]", "--set", "model.preset=nano"],
        capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "need GPU" in ln]
    assert len(lines) == 1 and "pools g need GPU 2 at once" in lines[0], proc.stderr[-2000:]
    assert time.monotonic() - t0 < 120, "refused at start, not after waiting for placement"
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing started
