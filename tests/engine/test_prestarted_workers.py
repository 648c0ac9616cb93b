"""A Ray the driver starts itself prestarts workers that already hold torch, and the run's first actors take them.

The rule behind it (orchestrator/run/driver.py, ensure_ray; orchestrator/run/setup.py, monitor_runtime_env):
Ray hands a prestarted worker only to an actor whose runtime env is empty, so the local start passes the
workers' environment through its processes' environment rather than as the job's runtime env, and the health
monitor (whose runtime env the islands inherit) then runs without one. Pure rules first; then a real local
Ray, in a subprocess so that it does not meet the suite's session cluster.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.actors.runtime import CONTROL_PLANE_RUNTIME_ENV
from orchestrator.config import load_config
from orchestrator.run import driver
from orchestrator.run.driver import _environment, local_system_config
from orchestrator.run.setup import monitor_runtime_env


def test_the_monitor_runs_in_the_jobs_env_only_where_that_is_empty():
    assert monitor_runtime_env({}) is None
    job = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
    assert monitor_runtime_env(job) == CONTROL_PLANE_RUNTIME_ENV


def test_as_many_workers_are_prestarted_as_actors_start_before_the_first_step_at_most():
    cfg = load_config(None, [])  # 4 islands: with the outer optimizer and the monitor, 6 actors
    small = local_system_config(cfg, num_cpus=3)
    assert small["enable_worker_prestart"] and small["worker_maximum_startup_concurrency"] == 3
    assert local_system_config(cfg, num_cpus=16)["worker_maximum_startup_concurrency"] == 6
    multi = load_config(None, ["pools=[{name: m, islands: 2, workers_per_island: 3}]"])
    assert local_system_config(multi, num_cpus=64)["worker_maximum_startup_concurrency"] == 8
    # The preload module Ray imports in every worker is the one in this package.
    [module] = small["preload_python_modules"]
    assert module == "orchestrator.actors.preload" and (Path(__file__).parents[2] / "orchestrator/actors/preload.py").is_file()


def test_a_local_start_passes_the_workers_environment_through_the_process_not_the_job(monkeypatch):
    monkeypatch.setattr(driver.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", raising=False)
    calls: list[dict] = []

    def init(**kwargs):  # stands in for ray.init: what Ray's processes would inherit, and what was asked
        calls.append({**kwargs, "environ": {k: os.environ.get(k) for k in driver.WORKER_ENV}})

    cfg = load_config(None, [])
    assert driver.ensure_ray(cfg, None, init=init)
    assert "runtime_env" not in calls[0] and calls[0]["environ"] == driver.WORKER_ENV
    assert calls[0]["_system_config"]["enable_worker_prestart"]
    assert "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS" not in os.environ  # restored after the start
    # The data-parallel baseline's workers are Ray Train's: no prestarted workers for them to leave idle.
    assert driver.ensure_ray(cfg, None, init=init, prestart=False)
    assert calls[1]["_system_config"] == {"prestart_worker_first_driver": False}


def test_the_data_parallel_baseline_starts_its_ray_without_prestarted_workers(monkeypatch, tmp_path):
    from orchestrator.baselines.data_parallel import train_data_parallel

    asked: list[dict] = []

    class Stop(Exception):
        pass

    def ensure_ray(cfg, address, **kwargs):
        asked.append(kwargs)
        raise Stop

    monkeypatch.setattr(driver, "ensure_ray", ensure_ray)
    monkeypatch.setattr(driver, "with_measured_step", lambda cfg, address: cfg)
    handlers = list(logging.getLogger().handlers)
    with pytest.raises(Stop):
        train_data_parallel(load_config(None, ["model.preset=nano"]), tmp_path / "dp")
    assert asked == [{"prestart": False}]
    assert logging.getLogger().handlers == handlers, "a start that failed leaves no driver.log handler behind"


def test_workers_find_this_project_at_boot_unless_it_is_installed_in_site_packages(monkeypatch):
    root = str(Path(driver.__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setattr(driver.site, "getsitepackages", lambda: ["/usr/lib/python3/site-packages"])
    env = driver.local_worker_env()
    assert env["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])
    assert {k: env[k] for k in driver.WORKER_ENV} == driver.WORKER_ENV
    monkeypatch.setattr(driver.site, "getsitepackages", lambda: [root])  # an installed copy: nothing to add
    assert "PYTHONPATH" not in driver.local_worker_env()


def test_a_worker_stopped_during_its_preload_exits_quietly():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"}  # no torch: quick
    code = "import os, signal, time, orchestrator.actors.preload; os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and proc.stderr == "", (proc.returncode, proc.stderr)


def test_the_preload_asks_cuda_nothing():
    # Ray sets CUDA_VISIBLE_DEVICES when it hands a worker a GPU actor, after the preload; CUDA reads it when first
    # asked, so a preload that asked (device count, availability) would pin a prestarted worker to every GPU.
    code = ("import os, torch, json\n"
            "asked = []\n"
            "torch._C._cuda_getDeviceCount = lambda *a: asked.append('device count') or 0\n"
            "torch.cuda.is_available = lambda *a: asked.append('is_available') or False\n"
            "import sys, orchestrator.actors.preload\n"
            "print(json.dumps([asked, 'islands.island' in sys.modules]))")
    env = {**os.environ, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[], True]  # the whole preload ran, asking nothing


def test_the_workers_environment_is_set_for_the_start_and_then_restored(monkeypatch):
    monkeypatch.setenv("DILOCO_TEST_KEPT", "mine")
    monkeypatch.delenv("DILOCO_TEST_ADDED", raising=False)
    with _environment({"DILOCO_TEST_KEPT": "theirs", "DILOCO_TEST_ADDED": "1"}):
        assert (os.environ["DILOCO_TEST_KEPT"], os.environ["DILOCO_TEST_ADDED"]) == ("theirs", "1")
    assert os.environ["DILOCO_TEST_KEPT"] == "mine" and "DILOCO_TEST_ADDED" not in os.environ
    with pytest.raises(RuntimeError), _environment({"DILOCO_TEST_ADDED": "1"}):
        raise RuntimeError("a failed start")
    assert "DILOCO_TEST_ADDED" not in os.environ


# Starts a local Ray as `diloco train` does, waits for the raylet's prestarted workers, then starts an actor
# with the job's (empty) runtime env, as the outer optimizer and the islands are, and one with the control
# plane's, as the chaos injector is. Prints what each saw in its constructor.
_PROBE = r"""
import json, os, sys, time
import ray
from orchestrator.actors.runtime import CONTROL_PLANE_RUNTIME_ENV
from orchestrator.config import load_config
from orchestrator.run.driver import ensure_ray

assert ensure_ray(load_config(None, []), None)
raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
def idle():  # the raylet's children titled ray::IDLE, from /proc (psutil is not a dependency)
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            title = open(f"/proc/{entry}/cmdline").read().split("\0")[0]
        except (OSError, ValueError, IndexError):
            continue
        if ppid == raylet and title == "ray::IDLE":
            pids.add(int(entry))
    return pids
deadline = time.monotonic() + 120
while not idle() and time.monotonic() < deadline:
    time.sleep(0.2)
prestarted = idle()
time.sleep(3)  # let their preload finish: the actor must find it done, not wait for it

@ray.remote(num_cpus=0)
class Probe:
    def __init__(self):
        self.seen = {"pid": os.getpid(), "torch": "torch" in sys.modules, "island_code": "islands.island" in sys.modules,
                     "zero_copy": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")}
    def seen_(self):
        return self.seen

data = ray.get(Probe.remote().seen_.remote(), timeout=120)
control = ray.get(Probe.options(runtime_env=CONTROL_PLANE_RUNTIME_ENV).remote().seen_.remote(), timeout=120)
print(json.dumps({"prestarted": sorted(prestarted), "data": data, "control": control,
                  "driver_zero_copy": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")}))
ray.shutdown()
"""


@pytest.mark.ray  # starts a local Ray of its own, in a subprocess
# Extended (17-39 s of CI's serial Ray group): it guards a start-up optimization, which benchmarks/startup.py measures
# whole (first step within 15 s); the pure tests below pin the config, environment and preload it rests on.
@pytest.mark.extended
def test_a_local_start_prestarts_workers_that_hold_torch_for_the_runs_first_actors():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "DILOCO_RAY_ADDRESS", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS")}
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prestarted"], "the raylet prestarted no worker"
    data, control = out["data"], out["control"]
    # An actor of the job's runtime env starts in a prestarted worker, which imported torch and the island
    # code before it was handed out (only the preload imports islands.island before a constructor runs).
    assert data["pid"] in out["prestarted"], out
    assert data["torch"] and data["island_code"] and data["zero_copy"] == "1", out
    # A control-plane actor gets a new, light process: no torch, zero-copy tensors off.
    assert control["pid"] not in out["prestarted"], out
    assert not control["torch"] and control["zero_copy"] == "0", out
    # The workers' environment reached Ray's processes, not the driver's own environment.
    assert out["driver_zero_copy"] is None, out
