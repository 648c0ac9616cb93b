"""The runtime settings of a run, built from its RunConfig: the one place config sections become plain values.

Each setting is declared once, in the config (orchestrator/config.py). The classes the engine takes
(OuterSettings, CheckpointSettings, InnerSettings, IslandSpec, the health monitor's) have no defaults of their
own; one function per consumer here fills them from the config, so a default can only change in the config
(tests/engine/test_settings_once.py checks both). Every config value an actor takes reaches it through here.

No torch and no Ray at import: the CLI and the health monitor's process import the config's
neighbours, and the data-parallel baseline builds its inner settings here too.
"""

from __future__ import annotations

from typing import Any

from islands.builtin import ByteTransformerFactory
from islands.spec import InnerSettings, IslandSpec, ModelConfig, ModelRecipe
from orchestrator.actors.keeper import keeper_name
from orchestrator.actors.monitor_settings import HealthThresholds, MonitorPools, MonitorTimeouts
from orchestrator.config import PoolConfig, RunConfig
from orchestrator.core.settings import CheckpointSettings, OuterSettings
from policies.fragments import FragmentPlan
from policies.restart import RestartBudget

__all__ = ["injector_join_nodes", "inner_settings", "island_specs", "model_recipe", "monitor_health", "monitor_pools", "monitor_restart", "monitor_timeouts",
           "outer_checkpoints", "outer_settings"]


def outer_settings(cfg: RunConfig, *, optimizer: Any = None) -> OuterSettings:
    """The outer optimizer's settings: the config's outer section, K resolved, tau from H/P when unset.

    `optimizer`: the public API's outer optimizer factory (a callable travels to the actor by value), in place
    of the config's import path ``outer.optimizer``."""
    o = cfg.outer
    return OuterSettings(
        min_quorum=cfg.min_quorum_count(), grace_gamma=o.grace_gamma, grace_cap_s=o.grace_cap_s,
        tau_steps=o.effective_tau_steps(), tau_schedule=o.tau_schedule(), weighting=o.weighting,
        staleness_discount=o.staleness_discount, merge_rule=o.merge_rule, lr=o.lr, momentum=o.momentum,
        partial_momentum=o.partial_momentum, optimizer=optimizer if optimizer is not None else o.optimizer,
        max_staleness=o.max_staleness, compression=o.compression,
        step_scale=o.step_scale, rda_across_rounds=o.rda_across_rounds, downlink=o.downlink,
        downlink_delta=o.downlink_delta, publish_to=o.publish_to, compression_block_size=o.compression_block_size,
        topk_density=o.topk_density, average_window=cfg.run.average_window, torch_threads=o.torch_threads,
        elastic_slots=cfg.elastic_slots(), fixed_slots=cfg.num_islands - len(cfg.elastic_slots()),
        poison_guard=o.poison_guard, poison_restart_after=o.poison_restart_after,
    )


def outer_checkpoints(cfg: RunConfig, uri: str) -> CheckpointSettings:
    """The outer optimizer's checkpoints: the run's store at `uri` (orchestrator.core.checkpoint.run_checkpoint_uri
    of checkpoint.uri) saved every checkpoint.every_s seconds, the newest checkpoint.keep retained."""
    return CheckpointSettings(uri=uri, every_s=cfg.checkpoint.every_s, keep=cfg.checkpoint.keep)


def inner_settings(cfg: RunConfig, pool: PoolConfig | None = None) -> InnerSettings:
    """The inner AdamW settings of the config, with `pool`'s precision override and speed emulation.

    Without a pool (the data-parallel baseline, the step-time measurement): inner.precision and no
    emulation, i.e. PoolConfig's own defaults for the emulation fields."""
    i = cfg.inner
    no_pool = PoolConfig.model_fields
    return InnerSettings(
        lr=i.lr, weight_decay=i.weight_decay, beta1=i.beta1, beta2=i.beta2, warmup_steps=i.warmup_steps,
        lr_schedule=i.lr_schedule, lr_final_ratio=i.lr_final_ratio, grad_clip=i.grad_clip,
        torch_threads=i.torch_threads, batch_size=cfg.data.batch_size,
        precision=cfg.precision_of(pool) if pool else i.precision,
        emulated_slowdown=pool.emulated_slowdown if pool else no_pool["emulated_slowdown"].default,
        emulated_jitter=pool.emulated_jitter if pool else no_pool["emulated_jitter"].default,
    )


def model_recipe(cfg: RunConfig, *, shape: ModelConfig | None = None, model: Any = None, loss: Any = None,
                 optimizer: Any = None) -> ModelRecipe:
    """The run's model recipe: Python objects given here (the public API's callables) first, else the config's
    import paths (model.factory, model.loss, model.optimizer), else the built-in byte transformer of
    `shape` (default: the config's preset with its overrides), the default loss and AdamW."""
    m = cfg.model
    shape = shape or m.shape()
    return ModelRecipe(model=model if model is not None else m.factory or ByteTransformerFactory(shape),
                       loss=loss if loss is not None else m.loss,
                       optimizer=optimizer if optimizer is not None else m.optimizer, seed=cfg.run.seed,
                       seq_len=shape.seq_len)


def island_specs(cfg: RunConfig, recipe: ModelRecipe, plan: FragmentPlan,
                 run_id: str | None = None) -> list[IslandSpec]:
    """Incarnation-1 specs of every island slot, pools in config order.

    With `run_id`, each names its pool's progress keeper when `health.salvage_every_steps` > 0."""
    specs, island, total, o = [], 0, cfg.num_islands, cfg.outer
    for pool in cfg.pools:
        inner = inner_settings(cfg, pool)
        keeper = _keeper(cfg, run_id, pool.name)
        for _ in range(pool.islands):
            specs.append(IslandSpec(
                island=island, incarnation=1, pool=pool.name, num_islands=total, model=recipe, plan=plan,
                inner=inner, sync_every_steps=o.sync_every_steps,
                sync_every_schedule=tuple(tuple(e) for e in o.sync_every_schedule), adoption=o.adoption,
                compression=o.compression, compression_block_size=o.compression_block_size,
                topk_density=o.topk_density, feedback_decay=o.feedback_decay, wait_for_round=o.wait_for_round,
                seed=cfg.run.seed, workers=pool.workers_per_island, shard=pool.shard, accelerator=pool.accelerator,
                salvage_every_steps=cfg.health.salvage_every_steps, keeper=keeper,
            ))
            island += 1
    return specs


def _keeper(cfg: RunConfig, run_id: str | None, pool: str) -> tuple[str, str] | None:
    """(namespace, name) of `pool`'s progress keeper in run `run_id`, or None when nothing is salvaged."""
    if not (run_id and cfg.health.salvage_every_steps):
        return None
    from orchestrator.actors.runtime import (
        NAMESPACE,  # imports Ray: only a real run names keepers
    )

    return NAMESPACE, keeper_name(run_id, pool)


def monitor_health(cfg: RunConfig) -> HealthThresholds:
    """The health monitor's hang and reachability thresholds (policies.health.assess_island's keywords)."""
    h = cfg.health
    return HealthThresholds(factor=h.hang_factor, floor_s=h.hang_floor_s, startup_s=h.startup_s,
                            unreachable_s=h.unreachable_s)


def monitor_pools(cfg: RunConfig) -> MonitorPools:
    """The pools the health monitor places islands in (config order) and the warm spares it keeps per pool."""
    return MonitorPools(pools=tuple(cfg.pools), warm_spares=cfg.health.warm_spares)


def monitor_restart(cfg: RunConfig) -> RestartBudget:
    """The health monitor's restart budget."""
    h = cfg.health
    return RestartBudget(base_s=h.backoff_base_s, cap_s=h.backoff_cap_s, reset_after_s=h.reset_after_s,
                         max_restarts=h.max_restarts, reset_on_submission=h.reset_on_submission)


def monitor_timeouts(cfg: RunConfig) -> MonitorTimeouts:
    """How long the health monitor waits for placement, for control calls, and between health checks."""
    return MonitorTimeouts(placement_s=cfg.run.placement_timeout_s, call_s=cfg.run.call_timeout_s,
                           tick_s=cfg.health.tick_s)


def injector_join_nodes(cfg: RunConfig) -> dict[int, dict]:
    """The chaos injector's `join_nodes`: per island slot, what a `node_joins` node of its pool offers (the pool's
    labels and resources, and CPUs for one island of its workers), pools in config order."""
    join_nodes: dict[int, dict] = {}
    island = 0
    for pool in cfg.pools:
        node = {"labels": dict(pool.labels), "resources": dict(pool.resources),
                "num_cpus": pool.cpus_per_island * pool.workers_per_island}  # room for one island
        for _ in range(pool.islands):
            join_nodes[island] = node
            island += 1
    return join_nodes
