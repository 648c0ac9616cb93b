"""Setting up one driver session and taking it down: the run directory, checkpoint 0, and the control-plane actors.

The driver (orchestrator/run/driver.py) calls these in order from `Run._setup`; each does one step
and returns what the next needs; `Run.teardown` ends with `stop_session`. The control plane (outer optimizer,
health monitor, chaos injector) is pinned to the driver's node: losing a worker node must never take it along.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from islands.spec import IslandSpec
from orchestrator.actors.chaos_injector import ChaosInjector
from orchestrator.actors.handles import call
from orchestrator.actors.health_monitor import HealthMonitor
from orchestrator.actors.monitor_settings import ActorClasses, RunAddress
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.placement import remove_run_groups
from orchestrator.actors.remote import (
    NAMESPACE,
    ChaosInjectorActor,
    HealthMonitorActor,
    IslandActor,
    IslandWorkerActor,
    NodeEnderActor,
    OuterOptimizerActor,
    ProgressKeeperActor,
)
from orchestrator.actors.runtime import CONTROL_PLANE_RUNTIME_ENV
from orchestrator.config import ConfigError, RunConfig, build_config, resume_conflict
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.core.outer_optimizer import OuterOptimizer
from orchestrator.settings import (
    monitor_health,
    monitor_pools,
    monitor_restart,
    monitor_timeouts,
    outer_checkpoints,
    outer_settings,
)
from policies.fragments import FragmentPlan

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


def kill_run_actors(run_id: str) -> int:
    """Kill every named actor and placement group of a run (islands are detached: they would outlive a dead driver)."""
    n = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and run_id in entry["name"]:
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                n += 1
            except ValueError:
                pass  # already gone
    return n + remove_run_groups(run_id, keep=())


def prepare_run_dir(cfg: RunConfig, run_dir: Path, run_id: str, *, resume: bool, address: str | None = None) -> str:
    """Check that `run_dir` may start (or, with `resume`, continue) this run, record the session in
    run.json (with `address`, the GCS address of the Ray it runs on: `diloco status RUN_DIR` attaches
    there) and the resolved config in config.yaml, and return the checkpoint URI.

    Raises ConfigError (one line) before anything is written: a fresh run over existing checkpoints,
    or a resume whose config changes what the checkpoints and data cursors depend on."""
    meta_path = run_dir / "run.json"
    previous = json.loads(meta_path.read_text()) if meta_path.exists() else None
    ckpt_uri = run_checkpoint_uri(cfg.checkpoint.uri, run_dir)
    if not resume and CheckpointStore(ckpt_uri).list():
        raise ConfigError(f"{run_dir} already holds checkpoints; continue it with --resume or pick a new --run-dir")
    if resume:  # before anything is touched: a refused resume leaves the run directory as it was
        saved = run_dir / "config.yaml"
        conflict = resume_conflict(build_config(yaml.safe_load(saved.read_text()), recorded=True), cfg) if saved.is_file() else None
        if conflict:
            raise ConfigError(conflict)
    if resume and previous:
        killed = kill_run_actors(previous["run_id"])
        log.warning("resuming run %s (killed %d leftover actors)", previous["run_id"], killed)
    session = {"run_id": run_id, "started": time.time(), **({"address": address} if address else {})}
    sessions = (previous or {}).get("sessions", []) + [session]
    meta_path.write_text(json.dumps({"run_id": run_id, "sessions": sessions}, indent=2))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return ckpt_uri


def save_checkpoint_zero(cfg: RunConfig, initial: dict[str, torch.Tensor], plan: FragmentPlan, ckpt_uri: str) -> None:
    """Checkpoint 0 of a fresh run: the initial global parameters, the outer optimizer's first state."""
    seed = OuterOptimizer(initial, plan, settings=outer_settings(cfg))
    tensors, meta = seed.state_dict()
    CheckpointStore(ckpt_uri, keep=outer_checkpoints(cfg, ckpt_uri).keep).save(
        0, tensors, {"outer": meta, "epoch": -1, "extra": {}})


def here() -> NodeAffinitySchedulingStrategy:
    """Pins an actor to the driver's node. Hard affinity: soft affinity does not pin zero-CPU actors
    (measured on Ray 2.60)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_timeout_s(cfg: RunConfig) -> float:
    """How long a process start may take (the outer optimizer's, the first islands'): placement's bound."""
    return cfg.run.placement_timeout_s + 60


def start_outer(cfg: RunConfig, run_id: str, ckpt_uri: str, *, plan: FragmentPlan, embedding_names: frozenset[str],
                buffer_names: frozenset[str], network: Any, island_regions: dict[int, str],
                optimizer: Any = None) -> tuple[str, ActorHandle[_OuterShell]]:
    """Start the run's outer optimizer on checkpoints under `ckpt_uri`: (its name, its handle). `optimizer`: the
    public API's outer optimizer factory, in place of the config's; `network`: the links it delivers over."""
    name = f"outer-{run_id}"
    outer = OuterOptimizerActor.options(name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here()).remote(
        plan, outer_settings(cfg, optimizer=optimizer), embedding_names, outer_checkpoints(cfg, ckpt_uri),
        network=network, island_regions=island_regions, buffer_names=buffer_names)
    return name, outer


def start_monitor(cfg: RunConfig, run_id: str, specs: list[IslandSpec], outer_name: str) -> tuple[str, ActorHandle[HealthMonitor]]:
    """Start the run's health monitor (which places and keeps the islands): (its name, its handle)."""
    name = f"monitor-{run_id}"
    job_env = dict(ray.get_runtime_context().runtime_env)
    monitor = HealthMonitorActor.options(name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here(),
                                         runtime_env=monitor_runtime_env(job_env)).remote(
        run=RunAddress(run_id=run_id, namespace=NAMESPACE, outer_name=outer_name), pools=monitor_pools(cfg),
        specs=specs, actors=ActorClasses(island=IslandActor, worker=IslandWorkerActor, keeper=ProgressKeeperActor,
                                         island_runtime_env=job_env),
        timeouts=monitor_timeouts(cfg), health=monitor_health(cfg), restart=monitor_restart(cfg),
    )
    return name, monitor


def monitor_runtime_env(job_env: dict) -> dict | None:
    """The health monitor's runtime env: the control plane's (zero-copy tensors off, so its process never
    imports torch) when the job has a runtime env of its own (a cluster's job carries WORKER_ENV), else none.

    With none, the job's is empty (a Ray this driver started, which passes WORKER_ENV through its processes'
    environment; or a plain `ray.init()`), and so is what the islands inherit from the monitor: Ray gives them
    its prestarted workers, which it gives only to actors of an empty runtime env. The price, in a Ray the
    driver started: the monitor's process holds torch too (zero-copy tensors are on in that environment), and a
    restarted monitor imports it again (ready in about 2.9 s, not 1.8 s, on an idle 2-core machine)."""
    return CONTROL_PLANE_RUNTIME_ENV if job_env else None


def start_injector(tape: Any, run_id: str, monitor_name: str, run_start: float, timeout_s: float,
                   join_nodes: dict[int, dict]) -> ActorHandle[ChaosInjector]:
    """Start the chaos injector on `tape` (its clock counts from `run_start`) and return its handle. `join_nodes`:
    what a `node_joins` node of each island's pool offers (orchestrator.settings.injector_join_nodes)."""
    injector = ChaosInjectorActor.options(name=f"chaos-{run_id}", namespace=NAMESPACE, num_cpus=0,
                                          scheduling_strategy=here(), runtime_env=CONTROL_PLANE_RUNTIME_ENV).remote(
        tape, namespace=NAMESPACE, monitor_name=monitor_name, run_start=run_start,
        protected_node=ray.get_runtime_context().get_node_id(), ender_cls=NodeEnderActor, join_nodes=join_nodes)
    ray.get(call(injector, ChaosInjector.start), timeout=timeout_s)
    return injector


def stop_session(run_id: str, monitor: ActorHandle[HealthMonitor] | None, injector: ActorHandle[ChaosInjector] | None,
                 timeout_s: float) -> None:
    """Take a session's actors down: the monitor's islands and placement groups, the chaos injector's nodes, then
    every named actor of the run (islands are detached: they would outlive the driver). Failures are logged."""
    if monitor is not None:
        try:
            ray.get(call(monitor, HealthMonitor.teardown), timeout=timeout_s)
        except Exception as err:
            log.warning("monitor teardown: %s", err)
    if injector is not None:  # the nodes its node_joins faults started must not outlive the run
        try:
            ray.get(call(injector, ChaosInjector.stop), timeout=60)
        except Exception as err:
            log.warning("chaos injector stop: %s", err)
    kill_run_actors(run_id)
