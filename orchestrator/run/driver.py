"""The run driver: builds a run from a RunConfig, starts the outer optimizer, the health monitor (which
places and keeps the islands) and the chaos injector, watches progress, evaluates the global
parameters, stops on the token budget and writes the run directory.

Run directory: `config.yaml` (resolved), `run.json` (run id, sessions), `checkpoints/`, `events/`
(Parquet event log), `summary.json`, `driver.log`. `train(..., resume=True)` continues a run whose
driver died: the outer optimizer restores its newest valid checkpoint and the islands restart from
their last merged data positions.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import ray
import torch
import yaml
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from islands.data import Corpus, load_parquet_corpus, load_stdlib_corpus, unigram_bits_per_byte
from islands.island import IslandSpec
from islands.model import build_model
from islands.trainer import InnerSettings, InnerTrainer
from orchestrator.core.accounting import run_goodput, token_fates
from orchestrator.actors.remote import (NAMESPACE, WORKER_ENV, ChaosInjectorActor, HealthMonitorActor, IslandActor,
                                 IslandWorkerActor, OuterOptimizerActor, ProgressKeeperActor, ignore_zero_copy_warnings)
from orchestrator.core.checkpoint import CheckpointStore, run_checkpoint_uri
from orchestrator.config import ConfigError, PoolConfig, RunConfig, build_config, resume_conflict
from orchestrator.core.evaluation import Evaluator
from orchestrator.core.eventlog import EventLog
from orchestrator.actors.keeper import keeper_name
from orchestrator.actors.monitor_settings import ActorClasses, HealthThresholds, MonitorTimeouts, RunAddress
from orchestrator.run.metrics import RunMetrics
from orchestrator.core.outer_optimizer import OuterOptimizer, OuterSettings
from orchestrator.actors.placement import remove_run_groups
from orchestrator.actors.runtime import CONTROL_PLANE_RUNTIME_ENV
from policies.chaos import tape_from_config
from policies.fragments import plan_fragments
from policies.network import NetworkModel, build_network
from policies.restart import RestartBudget
from policies.stopping import target_reached

log = logging.getLogger(__name__)
_TRANSIENT = (RayActorError, RayTaskError, GetTimeoutError)


def _warn_transient(err: Exception) -> None:
    log.warning("control call failed (retrying): %s", str(err).strip().splitlines()[-1][:200])


@dataclass
class Progress:
    """What the driver knows at one moment, handed to the progress callback."""

    tokens: int
    budget: int
    versions: list[int]
    rounds: int
    train_loss: float | None
    eval_bpb: float | None
    elapsed_s: float
    islands: dict[str, str] = field(default_factory=dict)  # "pool/island" -> state


def load_corpus(cfg: RunConfig) -> Corpus:
    """The training corpus named by the config (the embedded stdlib corpus by default)."""
    d = cfg.data
    if d.source == "stdlib":
        return load_stdlib_corpus(heldout_fraction=d.heldout_fraction, max_bytes=d.max_bytes,
                                  shuffle_documents=d.shuffle_documents)
    return load_parquet_corpus(d.path, text_column=d.text_column, token_column=d.token_column,
                               heldout_fraction=d.heldout_fraction, shuffle_documents=d.shuffle_documents)


def outer_settings(cfg: RunConfig) -> OuterSettings:
    """Unpack the config's outer section into the plain values the outer optimizer takes."""
    o = cfg.outer
    return OuterSettings(
        min_quorum=cfg.min_quorum_count(), grace_gamma=o.grace_gamma, grace_cap_s=o.grace_cap_s,
        tau_steps=o.effective_tau_steps(), tau_schedule=o.tau_schedule(), weighting=o.weighting, staleness_discount=o.staleness_discount,
        merge_rule=o.merge_rule, lr=o.lr, momentum=o.momentum, partial_momentum=o.partial_momentum, max_staleness=o.max_staleness,
        compression=o.compression, step_scale=o.step_scale, rda_across_rounds=o.rda_across_rounds, downlink=o.downlink, downlink_delta=o.downlink_delta, block_size=o.compression_block_size,
        topk_density=o.topk_density, publish_to=o.publish_to, average_window=cfg.run.average_window,
    )


def inner_settings(cfg: RunConfig, pool: PoolConfig | None = None) -> InnerSettings:
    """The inner AdamW settings of the config, with `pool`'s precision override and speed emulation (none without a pool)."""
    i = cfg.inner
    return InnerSettings(
        lr=i.lr, weight_decay=i.weight_decay, beta1=i.beta1, beta2=i.beta2, warmup_steps=i.warmup_steps,
        lr_schedule=i.lr_schedule, lr_final_ratio=i.lr_final_ratio, grad_clip=i.grad_clip, torch_threads=i.torch_threads, batch_size=cfg.data.batch_size,
        precision=cfg.precision_of(pool) if pool else i.precision,
        **({"emulated_slowdown": pool.emulated_slowdown, "emulated_jitter": pool.emulated_jitter} if pool else {}),
    )


def island_specs(cfg: RunConfig, model_cfg, plan, run_id: str | None = None) -> list[IslandSpec]:
    """Incarnation-1 specs of every island slot, pools in config order (with `run_id`, each names its
    pool's progress keeper when `health.salvage_every_steps` > 0)."""
    specs, island, total = [], 0, cfg.num_islands
    for pool in cfg.pools:
        inner = inner_settings(cfg, pool)
        for _ in range(pool.islands):
            specs.append(IslandSpec(
                island=island, incarnation=1, pool=pool.name, num_islands=total, model_config=model_cfg, plan=plan,
                inner=inner, sync_every_steps=cfg.outer.sync_every_steps,
                sync_every_schedule=tuple(tuple(e) for e in cfg.outer.sync_every_schedule), adoption=cfg.outer.adoption,
                compression=cfg.outer.compression, compression_block_size=cfg.outer.compression_block_size,
                topk_density=cfg.outer.topk_density, feedback_decay=cfg.outer.feedback_decay,
                wait_for_round=cfg.outer.wait_for_round, seed=cfg.run.seed,
                workers=pool.workers_per_island, accelerator=pool.accelerator,
                salvage_every_steps=cfg.health.salvage_every_steps,
                keeper=(NAMESPACE, keeper_name(run_id, pool.name)) if run_id and cfg.health.salvage_every_steps else None,
            ))
            island += 1
    return specs


def emulation_note(cfg: RunConfig) -> str | None:
    """The line every report carries when pool speeds are emulated by throttling."""
    parts = [f"{p.name} x{p.emulated_slowdown:g}" + (f" ±{p.emulated_jitter:.0%}" if p.emulated_jitter else "")
             for p in cfg.pools if p.emulated]
    return f"EMULATION: pool speeds emulated by throttling on one machine ({', '.join(parts)})" if parts else None


def step_concurrency(cfg: RunConfig, *, gpu: bool = False) -> int:
    """How many inner steps `measure_step_s` times side by side: `network.step_concurrency`, or by default
    every island worker of the config on a one-node Ray cluster (they share its cores) and 1 on a
    multi-node cluster (islands on their own machines). Timed on a GPU (`gpu`), only the GPU pools'
    workers count, spread over this machine's cards (islands that share a card share its time)."""
    if cfg.network.step_concurrency is not None:
        return cfg.network.step_concurrency
    alive = [node for node in ray.nodes() if node.get("Alive")] if ray.is_initialized() else []
    if len(alive) > 1:
        return 1
    workers = sum(p.islands * p.workers_per_island for p in cfg.pools if not gpu or p.accelerator != "cpu")
    return max(1, math.ceil(workers / max(1, torch.cuda.device_count()))) if gpu else workers


def measure_step_s(cfg: RunConfig, model_cfg, train_data, *, steps: int = 4, concurrency: int | None = None) -> float:
    """Median compute time of one inner step of the model on this machine, as the run's islands will see it.

    The emulated network is scaled to it (policies.network), so it must be the step time of an island
    while the others step too: `concurrency` trainers (default `step_concurrency(cfg)`) step at once, one
    thread each with the islands' thread count, 2 warm-up steps each, before any island starts. Threads
    stand in for the island processes because torch releases the GIL inside its ops: on this 2-core
    machine 4 threads measured 0.287 s per step against 0.28 s for 4 processes and 0.12 s for one alone.
    """
    device = step_device(cfg)
    k = step_concurrency(cfg, gpu=device != "cpu") if concurrency is None else concurrency
    # In the timed pools' arithmetic (the first one's, when their precisions differ): a bf16 GPU step is
    # up to 3x shorter than an fp32 one, and the links follow the step.
    timed = [p for p in cfg.pools if device == "cpu" or p.accelerator != "cpu"]
    inner = replace(inner_settings(cfg), precision=cfg.precision_of(timed[0]))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.inner.torch_threads)
    try:
        trainers = [InnerTrainer(model_cfg, train_data, settings=inner, shard_index=i, num_shards=k, seed=cfg.run.seed,
                                 device=device) for i in range(k)]

        def run(trainer: InnerTrainer) -> list[float]:
            return [trainer.step().compute_s for _ in range(steps + 2)][2:]

        with ThreadPoolExecutor(max_workers=k) as pool:
            times = [t for ts in pool.map(run, trainers) for t in ts]
    finally:
        torch.set_num_threads(threads)
    step_s = sorted(times)[len(times) // 2]
    log.info("network scaling: inner step %.4f s on %s (median of %d steps, %d stepping side by side)", step_s,
             device, len(times), k)
    return step_s


def step_device(cfg: RunConfig) -> str:
    """Where `measure_step_s` times the step: a GPU when any pool trains on one (the links are scaled to
    the fastest islands' step; CPU pools of a mixed run are slower still), else the CPU.

    Raises ConfigError when GPU pools need a measurement this process cannot take (no CUDA here, e.g. a
    driver on a CPU head node): a CPU step, often 50x longer, would make the emulated links far too fast.
    Timing on a GPU leaves this process a CUDA context (a few hundred MB of the card) for the run.
    """
    gpu_pools = [p.name for p in cfg.pools if p.accelerator != "cpu"]
    if not gpu_pools:
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"network.scenario {cfg.network.scenario!r} scales its emulated links to the islands' step "
                          f"time, but pools {', '.join(gpu_pools)} train on GPUs and this driver has no CUDA to time "
                          f"their step; set network.local_step_s to their step time in seconds")
    return "cuda"


def with_measured_step(cfg: RunConfig, address: str | None) -> RunConfig:
    """`cfg` with network.local_step_s measured now, when this driver is about to start a local Ray
    (no `address`, none running) for an emulated scenario that leaves it unset; else `cfg` as it is.

    Measured before ray.init: in the seconds after it, Ray's daemons and prestarted workers slowed the
    timed steps by up to 40% (0.35 s against 0.245 s for four islands on this machine). Joining a
    cluster, the run measures at setup instead (build_run_network). The measured value lands in the run
    directory's config.yaml, so a resumed run keeps the same links.
    """
    if (address is not None or ray.is_initialized() or cfg.network.scenario == "none"
            or cfg.network.local_step_s is not None):
        return cfg
    model_cfg = cfg.model.shape()
    step_s = measure_step_s(cfg, model_cfg, load_corpus(cfg).train)
    return cfg.model_copy(update={"network": cfg.network.model_copy(update={"local_step_s": step_s})})


def build_run_network(cfg: RunConfig, model_bytes: int, step_s: Callable[[], float]) -> tuple[NetworkModel, dict[int, str]]:
    """The run's network model (cfg.network) and island -> region (its pool's), islands in pool order.

    `step_s` measures the inner-step time; it is only called for an emulated scenario without
    network.local_step_s. Raises ConfigError (one line) for a pool region the scenario lacks.
    """
    regions = {i: pool.region for i, pool in enumerate(p for p in cfg.pools for _ in range(p.islands))}
    n = cfg.network
    local_step_s = n.local_step_s if n.local_step_s is not None or n.scenario == "none" else step_s()
    try:
        network = build_network(n.scenario, [p.region for p in cfg.pools], model_bytes=model_bytes,
                                local_step_s=local_step_s or 0.0, hub_region=n.hub_region)
    except ValueError as err:
        raise ConfigError(f"network: {err}") from None
    return network, regions


def ensure_ray(cfg: RunConfig, address: str | None) -> bool:
    """Connect to `address` or start a local Ray; returns True when this call started it."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
        return True
    # Logical CPUs may exceed physical cores: islands are throttled or small; Ray only counts.
    needed = math.ceil(sum(p.cpus_per_island * p.reserved_bundles(cfg.health.warm_spares) for p in cfg.pools))
    # address="local": never join some other cluster running on this machine by accident.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False,
             runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
    return True


def check_local_fit(cfg: RunConfig) -> None:
    """Raise ConfigError (one line; the local Ray shut down) when the one-node Ray this driver started cannot
    host every pool (orchestrator.deploy.cluster_check.local_problems), instead of waiting for placement forever."""
    from orchestrator.deploy.cluster_check import local_problems

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    problems = local_problems(cfg, labels=dict(nodes[0].get("Labels") or {}) if nodes else {},
                              resources=ray.cluster_resources())
    if problems:
        ray.shutdown()
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)


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
    return n + remove_run_groups(run_id)


class Run:
    """One driver session of a training run, from placement to summary. `train()` is the entry point."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, progress: Callable[[Progress], None] | None = None,
                 resume: bool = False) -> None:
        self.cfg = cfg
        # Absolute: the actors that write under it (the outer optimizer's checkpoints) run with the Ray
        # worker's working directory, not the driver's (a relative path broke a notebook that joined a
        # running cluster).
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.progress = progress
        self.resume = resume
        self.run_id = f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self.events = EventLog(self.run_dir)
        self.outer = self.monitor = self.injector = None
        self.eval_points: list[dict] = []
        self.before_flush_loss: float | None = None  # held-out loss just before the final flush (summary)
        self.raw_loss: float | None = None  # final held-out loss of the raw global model, under run.average_window
        self.tokens_before = 0
        self.snapshot: dict = {"slots": {}, "timeline": [], "detect_s": [], "rejoin_s": []}
        self._stop_requested = False
        self.stopped_by = "token_budget"
        self.metrics = RunMetrics(self.run_id)  # Prometheus metrics via ray.util.metrics (docs/metrics.md)

    def request_stop(self) -> None:
        """Ask a running `train()` to finish now (from another thread, e.g. a notebook or a test)."""
        self._stop_requested = True

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg = self.cfg
        meta_path = self.run_dir / "run.json"
        previous = json.loads(meta_path.read_text()) if meta_path.exists() else None
        ckpt_uri = run_checkpoint_uri(cfg.checkpoint.uri, self.run_dir)
        if not self.resume and CheckpointStore(ckpt_uri).list():
            raise ConfigError(f"{self.run_dir} already holds checkpoints; continue it with --resume or pick a new --run-dir")
        if self.resume:  # before anything is touched: a refused resume leaves the run directory as it was
            saved = self.run_dir / "config.yaml"
            conflict = resume_conflict(build_config(yaml.safe_load(saved.read_text())), cfg) if saved.is_file() else None
            if conflict:
                raise ConfigError(conflict)
        if self.resume and previous:
            killed = kill_run_actors(previous["run_id"])
            log.warning("resuming run %s (killed %d leftover actors)", previous["run_id"], killed)
        sessions = (previous or {}).get("sessions", []) + [{"run_id": self.run_id, "started": time.time()}]
        meta_path.write_text(json.dumps({"run_id": self.run_id, "sessions": sessions}, indent=2))
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.corpus = load_corpus(cfg)
        self.model_cfg = cfg.model.shape()
        model = build_model(self.model_cfg, seed=cfg.run.seed)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], cfg.outer.num_fragments)
        model_bytes = sum(t.numel() * 4 for t in initial.values())  # float32 bytes: the network's scaling unit
        self.network, island_regions = build_run_network(
            cfg, model_bytes, lambda: measure_step_s(cfg, self.model_cfg, self.corpus.train))
        log.info("%s", self.network.describe())
        self.unigram_bpb = unigram_bits_per_byte(self.corpus.train, self.corpus.heldout, vocab_size=self.corpus.vocab_size)
        self.evaluator = Evaluator(self.model_cfg, self.corpus.heldout, batches=cfg.eval.batches, batch_size=cfg.eval.batch_size)
        self.tape = tape_from_config(cfg.chaos.spec(), islands=cfg.num_islands, horizon_s=cfg.chaos.horizon_s)
        log.info("corpus: %s; model %s (%d params); %d fragments; unigram %.3f bits/byte; %d faults on the tape",
                 self.corpus.source, cfg.model.preset, sum(t.numel() for t in initial.values()),
                 self.plan.num_fragments, self.unigram_bpb, len(self.tape))
        if not self.resume:  # checkpoint 0: the initial global parameters, the outer optimizer's first state
            seed = OuterOptimizer(initial, self.plan, settings=outer_settings(cfg))
            tensors, meta = seed.state_dict()
            CheckpointStore(ckpt_uri, keep=cfg.checkpoint.keep).save(0, tensors, {"outer": meta, "epoch": -1, "extra": {}})
        # The control plane lives beside the driver (the head node on a cluster): losing a worker node must
        # never take it along. Hard affinity: soft affinity does not pin zero-CPU actors (measured on 2.60).
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.outer_name = f"outer-{self.run_id}"
        self.outer = OuterOptimizerActor.options(name=self.outer_name, namespace=NAMESPACE, num_cpus=0,
                                                 scheduling_strategy=here).remote(
            self.plan, outer_settings(cfg), model.embedding_parameter_names(),
            ckpt_uri, cfg.checkpoint.every_s, cfg.checkpoint.keep, network=self.network, island_regions=island_regions)
        if self.resume:
            # New incarnations continue above every incarnation the restored outer optimizer has heard of.
            extra = self._get(self.outer.restored_extra.remote(), timeout=self._start_timeout_s())  # starts, restores
            acct = self._get(self.outer.accounting.remote())
            self.baseline = self._get(self.outer.status.remote())["ledger"]
            last_inc = {int(i): inc for i, inc in extra.get("incarnations", {}).items()}
            for island, inc, _ in acct["received"]:
                last_inc[island] = max(last_inc.get(island, 0), inc)
        else:
            # A fresh run has nothing to ask the outer optimizer first: the monitor (and through it the
            # islands) starts while the outer's process is still importing, not after it (~5 s per run).
            extra, last_inc, self.baseline = {}, {}, None
        self.tokens_before = int(extra.get("tokens_processed", 0))
        specs = [s if s.island not in last_inc else replace(s, incarnation=last_inc[s.island] + 1)
                 for s in island_specs(cfg, self.model_cfg, self.plan, self.run_id)]
        self.first_inc = {s.island: s.incarnation for s in specs}
        self.data_ref = ray.put(self.corpus.train)
        h = cfg.health
        self.monitor_name = f"monitor-{self.run_id}"
        self.monitor = HealthMonitorActor.options(name=self.monitor_name, namespace=NAMESPACE, num_cpus=0,
                                                  scheduling_strategy=here, runtime_env=CONTROL_PLANE_RUNTIME_ENV).remote(
            run=RunAddress(run_id=self.run_id, namespace=NAMESPACE, outer_name=self.outer_name),
            pools=cfg.pools, specs=specs,
            actors=ActorClasses(island=IslandActor, worker=IslandWorkerActor, keeper=ProgressKeeperActor,
                                island_runtime_env=dict(ray.get_runtime_context().runtime_env)),
            timeouts=MonitorTimeouts(placement_s=cfg.run.placement_timeout_s, call_s=cfg.run.call_timeout_s,
                                     tick_s=h.tick_s),
            health=HealthThresholds(factor=h.hang_factor, floor_s=h.hang_floor_s, startup_s=h.startup_s,
                                    unreachable_s=h.unreachable_s),
            restart=RestartBudget(base_s=h.backoff_base_s, cap_s=h.backoff_cap_s, reset_after_s=h.reset_after_s,
                                  max_restarts=h.max_restarts, reset_on_submission=h.reset_on_submission),
            warm_spares=h.warm_spares,
        )
        started = self.monitor.ensure_started.remote(fresh=not self.resume, data=[self.data_ref])
        if not self.resume:  # (a resumed run asked it for its metadata above)
            # The outer optimizer is up (or says why not) while islands start. A process start, not a
            # control call: on a loaded machine it can take longer than call_timeout_s.
            self._get(self.outer.restored_extra.remote(), timeout=self._start_timeout_s())
        # The starting point, how far the loss fell from. A fresh run evaluates the parameters it seeded
        # (version 0 of every fragment): asking the outer optimizer raced the islands, which on a quick
        # start had merged a few rounds before it answered (seen in a notebook). A resumed run's islands
        # start only below, so the outer's restored parameters are the starting point.
        if self.resume:
            self._evaluate(time.monotonic())
        else:
            self._evaluate(time.monotonic(), start=(initial, [0] * self.plan.num_fragments))
        try:
            self._get(started, timeout=self._start_timeout_s())
        except RayTaskError as err:
            cause = str(err).strip().splitlines()[-1]
            raise RuntimeError(f"islands failed to start: {cause}") from None
        # Goodput's clock starts when every island of the first placement trains (startup is the same
        # for every method and is reported apart in driver.log); the chaos tape counts from here too.
        self.run_start = time.time()
        if len(self.tape):
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self.injector = ChaosInjectorActor.options(name=f"chaos-{self.run_id}", namespace=NAMESPACE, num_cpus=0,
                                                       scheduling_strategy=here, runtime_env=CONTROL_PLANE_RUNTIME_ENV).remote(
                self.tape, namespace=NAMESPACE, monitor_name=self.monitor_name, run_start=self.run_start,
                protected_node=ray.get_runtime_context().get_node_id())
            self._get(self.injector.start.remote())

    def _start_timeout_s(self) -> float:
        """How long a process start may take (the outer optimizer's, the first islands'): placement's bound."""
        return self.cfg.run.placement_timeout_s + 60

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        return ray.get(ref, timeout=timeout or self.cfg.run.call_timeout_s)

    # ------------------------------------------------------------------ loop

    def _refresh(self) -> None:
        self._get(self.monitor.ensure_started.remote(data=[self.data_ref]))  # re-adopts islands after a monitor restart
        self.snapshot = self._get(self.monitor.snapshot.remote())

    def _statuses(self) -> tuple[list, list]:
        live, dead = [], []
        for slot in self.snapshot["slots"].values():
            if slot["status"] is not None:
                live.append(slot["status"])
            dead.extend(slot["finals"])
        return live, dead

    def _tokens(self) -> int:
        live, dead = self._statuses()
        return self.tokens_before + sum(s.tokens for s in live) + sum(s.tokens for s in dead)

    def _evaluate(self, t0: float, start: tuple[dict, list[int]] | None = None) -> dict:
        """Evaluate the run's model now (the global parameters, or their moving average under
        run.average_window), or `start` = (parameters, versions) before anything merged.

        The point's `wall_s`/`at` are when the parameters were read, not when scoring them ended: the
        first evaluation in a process is slow (seconds under load), and the starting point must sort first.
        """
        read_mono, read_at, tokens = time.monotonic(), time.time(), self._tokens()
        if start is None:
            params = self._get(self.outer.served_parameters.remote())
            status = self._get(self.outer.status.remote())
            versions, merged = list(status["versions"]), sum(status["ledger"]["merged"]) / len(status["ledger"]["merged"])
        else:
            (params, versions), merged = start, 0.0
        loss, bpb = self.evaluator.evaluate(params)
        point = {"wall_s": read_mono - t0, "at": read_at, "tokens_processed": tokens, "tokens_merged": merged,
                 "versions": versions, "eval_loss": loss, "eval_bits_per_byte": bpb}
        self.eval_points.append(point)
        self.events.add("evals", [point])
        log.info("eval at %.0fs: loss %.4f, %.3f bits/byte (%d tokens processed)", point["wall_s"], loss, bpb, point["tokens_processed"])
        return point

    def _drain_events(self) -> None:
        got = self._get(self.outer.drain_events.remote())
        self.events.add("rounds", got["rounds"])
        self.events.add("refusals", got["refusals"])
        self.metrics.record_events(got["rounds"], got["refusals"], self.snapshot)

    def _report(self, t0: float, status: dict) -> None:
        if self.progress is None:
            return
        live, _ = self._statuses()
        losses = [s.train_loss for s in live if s.train_loss is not None]
        self.progress(Progress(
            tokens=self._tokens(), budget=self.cfg.run.token_budget, versions=status["versions"], rounds=status["rounds"],
            train_loss=sum(losses) / len(losses) if losses else None,
            eval_bpb=self.eval_points[-1]["eval_bits_per_byte"] if self.eval_points else None,
            elapsed_s=time.monotonic() - t0,
            islands={f"{s['pool']}/{i}": s["state"] for i, s in self.snapshot["slots"].items()},
        ))

    def train(self) -> dict:
        """Run to the token budget (or max_wall_s) and return the summary (also written to summary.json)."""
        self._setup()
        t0 = time.monotonic()
        next_eval, next_flush = t0 + self.cfg.eval.interval_s, t0 + 5.0
        status = {"versions": [], "rounds": 0}
        while True:
            try:
                self._refresh()
                status = self._get(self.outer.status.remote())
                incarnations = {str(i): s["incarnation"] for i, s in self.snapshot["slots"].items()}
                self._get(self.outer.note.remote(tokens_processed=self._tokens(), run_id=self.run_id,
                                                 incarnations=incarnations,
                                                 progress=self._tokens() / self.cfg.run.token_budget))
            except _TRANSIENT as err:  # an actor restarting: Ray brings it back, try again next tick
                _warn_transient(err)
                time.sleep(0.5)
                continue
            self._report(t0, status)
            self.metrics.record_status(status, self.snapshot, tokens_processed=self._tokens())
            now = time.monotonic()
            if self._tokens() >= self.cfg.run.token_budget or self._stop_requested:
                self.stopped_by = "token_budget" if not self._stop_requested else "stop request"
                break
            if self.cfg.run.max_wall_s is not None and now - t0 >= self.cfg.run.max_wall_s:
                log.warning("stopping on max_wall_s=%s before the token budget", self.cfg.run.max_wall_s)
                self.stopped_by = "max_wall_s"
                break
            next_eval, next_flush, stop = self._periodic(t0, now, next_eval, next_flush, status)
            if stop:
                break
            time.sleep(0.5)
        return self._finish(t0)

    def _periodic(self, t0: float, now: float, next_eval: float, next_flush: float, status: dict) -> tuple[float, float, bool]:
        """Evaluate and drain events when due: (next eval time, next drain time, whether the eval target stops the
        run). A call that fails because the outer optimizer is restarting (a kill between the loop's status call
        and these) leaves what it was doing due, to be done at the next tick, instead of failing the run."""
        try:
            if now >= next_eval:
                self._evaluate(t0)
                next_eval = now + self.cfg.eval.interval_s
                if target_reached([p["eval_loss"] for p in self.eval_points], self.cfg.run.stop_at_eval_loss):
                    log.warning("stopping on stop_at_eval_loss=%s before the token budget", self.cfg.run.stop_at_eval_loss)
                    self.stopped_by = "stop_at_eval_loss"
                    return next_eval, next_flush, True
            if now >= next_flush:
                self._drain_events()
                self.events.flush()
                next_flush = now + 5.0
                self.metrics.record_goodput_so_far(lambda: self._get(self.outer.accounting.remote()), status=status,
                                                   snapshot=self.snapshot, run_start=self.run_start, baseline=self.baseline)
        except _TRANSIENT as err:
            _warn_transient(err)
        return next_eval, next_flush, False

    def _finish(self, t0: float) -> dict:
        flush = self.cfg.run.final_flush
        stop_began = time.time()  # uptime's clock ends here: from now on versions are held on purpose
        if flush:  # no round closes between the islands' last cuts and the final merge
            self._get(self.outer.hold.remote())
        t_stop = time.monotonic()
        self.snapshot = self._get(self.monitor.stop.remote(flush=flush), timeout=self.cfg.run.call_timeout_s + 30)
        log.info("islands stopped in %.1fs", time.monotonic() - t_stop)
        run_end = time.time()
        wall = time.monotonic() - t0
        if flush:
            # The global model as the last regular round left it, scored on the same held-out batches: what
            # the final flush changes shows in the summary without another run's noise (RESULTS.md: a lead).
            self.before_flush_loss, _ = self.evaluator.evaluate(self._get(self.outer.served_parameters.remote()))
            closed = self._get(self.outer.finish.remote(self.cfg.run.call_timeout_s), timeout=self.cfg.run.call_timeout_s + 30)
            log.info("final flush: %d rounds closed with the islands' last progress (%.1fs after stop began)",
                     closed, time.monotonic() - t_stop)
            self.snapshot = self._get(self.monitor.refresh_statuses.remote(), timeout=self.cfg.run.call_timeout_s + 30)
        ledger = self._get(self.outer.stop.remote(), timeout=self.cfg.run.call_timeout_s + 30)
        acct = self._get(self.outer.accounting.remote())
        status = self._get(self.outer.status.remote())
        # The last checkpoint holds the final model (orchestrator.run.trained reads it) and the final token count.
        self._get(self.outer.note.remote(tokens_processed=self._tokens()))
        self._get(self.outer.checkpoint.remote())
        faults = self._get(self.injector.report.remote()) if self.injector is not None else []
        self._drain_events()
        final_eval = self._evaluate(t0)
        if self.cfg.run.average_window is not None:  # the raw global model on the same batches: what averaging gave
            self.raw_loss, _ = self.evaluator.evaluate(self._get(self.outer.global_parameters.remote()))
        self._report(t0, status)
        live, dead = self._statuses()
        received = {(i, inc): toks for i, inc, toks in acct["received"] if inc >= self.first_inc.get(i, 1)}
        fates = token_fates(fragments=self.plan.num_fragments, ledger=ledger, baseline=self.baseline,
                            received=received, live=live, dead=dead)
        good = run_goodput(timeline=self.snapshot["timeline"], useful_s=acct["useful_s"], run_start=self.run_start,
                           run_end=run_end, islands=self.cfg.num_islands, advances=acct["advances"], fates=fates,
                           stop_began=stop_began)
        self.metrics.record_status(status, self.snapshot, tokens_processed=self._tokens())
        self.metrics.record_goodput(good["goodput"], good["uptime"])
        self.events.add("islands", [{**asdict(s), "alive_at_stop": s in live} for s in live + dead])
        self.events.add("timeline", [{"at": t, "island": i, "incarnation": inc, "state": st}
                                     for t, i, inc, st in self.snapshot["timeline"]])
        self.events.add("faults", faults)
        self.events.add("detections", self.snapshot.get("detections", []))
        self.events.add("salvages", [{"island": s["island"], "incarnation": s["incarnation"], "step": s.get("step"),
                                      "tokens": list(s.get("tokens") or []), "seqs": list(s.get("seqs") or []),
                                      "skipped": json.dumps(s.get("skipped") or {}), "keeper_error": s.get("keeper_error")}
                                     for s in self.snapshot.get("salvages", [])])
        self.events.flush()
        summary = self._summary(fates, good, status, final_eval, wall, faults)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _summary(self, fates: dict, good: dict, status: dict, final_eval: dict, wall: float, faults: list) -> dict:
        P = self.plan.num_fragments
        mean = lambda xs: sum(xs) / P  # noqa: E731 - tokens count once per fragment; report the fragment mean
        slots = self.snapshot["slots"].values()
        precision = {p.name: self.cfg.precision_of(p) for p in self.cfg.pools}
        detect, rejoin = self.snapshot["detect_s"], self.snapshot["rejoin_s"]
        salvages = self.snapshot.get("salvages", [])
        live, dead = self._statuses()
        return {
            "mode": self.cfg.mode,
            "emulation": emulation_note(self.cfg),
            "eval_loss": final_eval["eval_loss"],
            "eval_loss_before_flush": self.before_flush_loss,  # None without run.final_flush
            "eval_loss_raw": self.raw_loss,  # the raw global model's; None without run.average_window
            "eval_bits_per_byte": final_eval["eval_bits_per_byte"],
            "unigram_bits_per_byte": self.unigram_bpb,
            "tokens_processed": self._tokens(),
            "tokens_merged": mean(fates["merged"]),
            "tokens_refused": mean(fates["refused"]),
            "tokens_lost": mean(fates["lost"]),
            "tokens_in_flight": mean(fates["in_flight"]),
            "tokens_overwritten": mean(fates["overwritten"]),  # replaced by an overwrite adoption before a cut
            "token_ledger": fates,
            "goodput": good["goodput"],
            "uptime": good["uptime"],  # from the first version advance (policies/goodput.py)
            "fill_s": good["fill_s"],  # run start to the first version advance: the pipeline fill
            "time_by_state_s": good["time_by_state_s"],
            "useful_s": good["useful_s"],
            "allocated_s": good["allocated_s"],
            "failures": sum(s["failures"] for s in slots),
            "restarts": sum(s["restarts"] for s in slots),
            "faults_injected": sum(1 for f in faults if f["outcome"] == "fired"),
            "mean_time_to_detect_s": sum(detect) / len(detect) if detect else None,
            "mean_time_to_rejoin_s": sum(rejoin) / len(rejoin) if rejoin else None,
            # Progress of dead incarnations merged instead of lost (health.salvage_every_steps), and what the
            # islands' snapshots for it cost: inner-loop seconds and in-pool bytes (never over the WAN).
            "salvaged_tokens": sum(mean(s["tokens"]) for s in salvages if s.get("tokens")),
            "salvages": sum(1 for s in salvages if any(s.get("tokens") or [])),
            "salvage_snapshot_s": sum(st.shelve_s for st in live + dead),
            "salvage_snapshot_bytes": sum(st.shelved_bytes for st in live + dead),
            "keeper_restarts": sum(self.snapshot.get("keeper_restarts", {}).values()),  # keepers that died, replaced
            "rounds": status["rounds"],
            "refusals": status["refusals"],
            "versions": status["versions"],
            "bytes_up": status["bytes_up"],
            "bytes_down": status["bytes_down"],
            "bytes_sent": status["bytes_up"] + status["bytes_down"],
            "bytes_by_link": status["bytes_by_link"],  # {region: {up, down}} bytes on each region's link to the hub
            "transfers_by_link": status["transfers_by_link"],  # {region: {up, down}} transfers, as docs/network.md says
            "network": self.network.describe(),
            "network_emulated": self.network.emulated,
            "network_wait_s": status["network_wait_s"],  # delivery delay the emulated links added, per direction
            "wall_s": wall,
            "stopped_by": self.stopped_by,  # token_budget | max_wall_s | stop_at_eval_loss | stop request
            "run_start": self.run_start,  # wall clock (time.time) that goodput, chaos tapes and `at` fields count from
            "resumed": self.resume,
            "corpus": self.corpus.source,
            "islands": [{"island": s["island"], "pool": s["pool"], "node": s["node"], "incarnation": s["incarnation"],
                         "failures": s["failures"], "restarts": s["restarts"], "state": s["state"],
                         "device": s["status"].device if s["status"] else None,  # where it trained: cpu, cuda:0 (card)
                         "precision": precision[s["pool"]],  # its inner steps' arithmetic (pool's, else inner.precision)
                         "steps": s["status"].steps if s["status"] else 0,
                         "tokens": (s["status"].tokens if s["status"] else 0) + sum(f.tokens for f in s["finals"])}
                        for s in slots],
            "evals": self.eval_points,
        }

    def teardown(self) -> None:
        """Kill the run's actors and placement groups (islands are detached: they would outlive us)."""
        if self.monitor is not None:
            try:
                self._get(self.monitor.teardown.remote())
            except Exception as err:  # noqa: BLE001 - fall through to killing by name
                log.warning("monitor teardown: %s", err)
        kill_run_actors(self.run_id)


def train(cfg: RunConfig, run_dir: str | Path, *, address: str | None = None,
          progress: Callable[[Progress], None] | None = None, resume: bool = False) -> dict:
    """Run one training job: start or join Ray, train to the token budget, write RUN_DIR, return the summary."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    cfg = with_measured_step(cfg, address)
    started = ensure_ray(cfg, address)
    if started and not address:  # a Ray of our own never grows: what it cannot host now, it never will
        check_local_fit(cfg)
    ignore_zero_copy_warnings()
    run = Run(cfg, run_dir, progress=progress, resume=resume)
    try:
        return run.train()
    finally:
        run.teardown()
        logging.getLogger().removeHandler(handler)
        handler.close()
        if started:
            ray.shutdown()


def resume_config(run_dir: str | Path) -> RunConfig:
    """The config a run directory was started with (for `diloco train --resume RUN_DIR`)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; --resume needs the directory of an earlier run")
    return build_config(yaml.safe_load(path.read_text()))
