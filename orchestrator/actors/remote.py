"""The Ray edge: thin actor shells over the plain classes. `ray.remote` is applied here and only here.

- `IslandActor` wraps islands.island.LearnerIsland (threaded: the inner loop runs in its own thread,
  control calls are served concurrently by the actor's thread pool). In an island of several workers
  it is rank 0, the leader; `IslandWorkerActor` wraps islands.follower.IslandFollower (ranks >= 1).
  Their shells live in orchestrator/actors/islands.py, which imports torch only inside an island's
  own process, so the health monitor that creates islands runs without torch.
- `OuterOptimizerActor` wraps orchestrator.core.outer_optimizer.OuterOptimizer (async: it keeps one
  outstanding `next_submission` call per island and takes results as they arrive, so it owns every
  submission ref; core work runs on one executor thread, so the plain class needs no locks). Its
  shell is in orchestrator/actors/outer.py.
- `ProgressKeeperActor` wraps orchestrator.actors.keeper.ProgressKeeper: one per pool, it holds the islands'
  latest progress snapshots outside their failure domain (policies/salvage.py).

No module of a shell imports torch at import time: Ray imports an actor's class module in every
process that holds a handle to it, and the control-plane processes (health monitor, chaos injector)
run without torch.

Ray facts that shape this are in docs/architecture.md section 4.
"""

from __future__ import annotations

import ray

from orchestrator.actors.chaos_injector import ChaosInjector, NodeEnder
from orchestrator.actors.health_monitor import HealthMonitor
from orchestrator.actors.islands import _IslandShell, _IslandWorker
from orchestrator.actors.keeper import ProgressKeeper
from orchestrator.actors.outer import _OuterShell
from orchestrator.actors.runtime import NAMESPACE, WORKER_ENV, ignore_zero_copy_warnings

__all__ = ["NAMESPACE", "WORKER_ENV", "ignore_zero_copy_warnings", "IslandActor", "IslandWorkerActor",
           "OuterOptimizerActor", "HealthMonitorActor", "ChaosInjectorActor", "NodeEnderActor", "ProgressKeeperActor"]


IslandActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=8)(_IslandShell)
# Followers are rebuilt with their leader (one failure domain), never restarted alone.
IslandWorkerActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(_IslandWorker)
# The outer optimizer restarts itself from its checkpoint; the island actors are rebuilt by the health
# monitor instead (a new incarnation each time), and the monitor re-adopts islands when it restarts.
OuterOptimizerActor = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=64)(_OuterShell)
HealthMonitorActor = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=64)(HealthMonitor)
ChaosInjectorActor = ray.remote(max_restarts=0, max_concurrency=16)(ChaosInjector)
NodeEnderActor = ray.remote(max_restarts=0)(NodeEnder)  # dies with the node it ends
# One call at a time keeps each island's snapshots in order; a dead keeper is replaced by the monitor.
ProgressKeeperActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=1)(ProgressKeeper)
