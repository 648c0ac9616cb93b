"""What the one-node Ray a driver started for itself can never host (it never grows), found before placement.

Here, in run/, because the driver asks it; `diloco check-cluster` (orchestrator.deploy.cluster_check) asks the
same questions of a cluster.yaml with the same placement helpers (orchestrator.actors.placement).
"""

from __future__ import annotations

from orchestrator.actors.placement import format_mapping, label_selector_matches, worker_bundle
from orchestrator.config import RunConfig


def local_problems(cfg: RunConfig, *, labels: dict[str, str], resources: dict[str, float]) -> list[str]:
    """One line per thing the one-node Ray a driver started for itself can never host (it never grows):
    a pool selecting labels the node lacks, or a resource the pools ask for (GPUs, custom resources)
    that the node lacks or holds too little of for every island, worker and warm spare at once (a warm
    spare reserves its pool's bundle too). CPUs are left out: the driver sizes the local Ray's logical
    CPUs to the config. Without this, such a run waits for placement forever, warning every
    placement_timeout_s; on a cluster it may be right to wait (nodes can join), so this is for local runs. An
    elastic pool of min 0 is never a problem: the run starts without it."""
    problems: list[str] = []
    total: dict[str, float] = {}
    askers: dict[str, list[str]] = {}
    for pool in cfg.pools:
        if pool.required_islands == 0:
            continue  # an elastic pool of min 0 needs no room to start; nodes may join (chaos node_joins does locally)
        if not label_selector_matches(pool.labels, labels):
            problems.append(f"pool {pool.name!r} selects nodes labelled {format_mapping(pool.labels)}, which the local Ray this "
                            f"run started is not; drop the pool's labels for a local run, or pass --address of a "
                            f"cluster that has such nodes")
            continue
        bundles = pool.reserved_bundles(cfg.health.warm_spares)
        for key, need in worker_bundle(pool).items():
            if key != "CPU":
                total[key] = total.get(key, 0.0) + need * bundles
                askers.setdefault(key, []).append(pool.name)
    for key, need in total.items():
        have = resources.get(key, 0.0)
        if have + 1e-9 < need:
            fix = ("lower gpus_per_worker (islands may share a card, e.g. 0.25) or health.warm_spares, set the pools' "
                   "accelerator: cpu, or pass --address of a cluster with more GPUs") if key == "GPU" else \
                  "drop it from the pools' resources for a local run, or pass --address of a cluster that has it"
            problems.append(f"pools {', '.join(askers[key])} need {key} {need:g} at once (every island, worker and "
                            f"warm spare) but the local Ray this run started has {have:g}; {fix}")
    return problems
