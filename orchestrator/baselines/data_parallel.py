"""Synchronous data-parallel baseline on Ray Train's `TorchTrainer`, in the engine's harness (docs/baselines.md).

One Ray Train worker per island slot of `cfg.pools` (pinned to its pool's nodes by label selector,
tagged with its region), the same model and initial parameters (the run's ModelRecipe, as the engine
builds it: `model.factory`, `model.loss` and `model.optimizer` of the config, else the built-in byte
transformer of the preset), the same loss, the same inner optimizer (AdamW by default: lr, warmup,
lr schedule at DP's exact progress, clip, betas, weight decay) on every step on the gradient averaged
over all workers (one `all_reduce` of a flat buffer: DDP with one bucket; gloo on CPU pools, NCCL on GPU
pools, each worker on the card Ray Train gave it), the same per-worker
batch, the same data and the same global token budget: worker i streams island slot i's units in the order
island i reads them (islands/stream.py, the run's data plan), so the two methods differ in how they merge, not in
what they read. `in_memory=True` (`diloco baseline-dp --in-memory`) is the baseline of measurements before
2026-12-03: the whole corpus read into every worker and random windows of shard i of n drawn from it, which at a
short budget samples far more of the corpus than any stream does (benchmarks/RESULTS.md#dp-data-order).
After each exchange every worker sleeps the EMULATED ring all-reduce time
`network.allreduce_s(grad_bytes, regions)`; nothing is subtracted for the real gloo all-reduce
(processes on one machine: ~free next to the emulated time).
Gradients cross the emulated wire as bf16 by default (rounded locally so the math matches), or fp32.

Rank 0 evaluates on the engine's held-out batches before the first step, at the first step boundary
after each `eval.interval_s` of wall clock, and at the end; the others wait at the next all-reduce
(reported as `eval_s`, kept in `wall_s`). Under `run.average_window` rank 0 also keeps the engine's
moving average of the model (policies/averaging.py, one update per step) and evaluates and saves that,
beside the raw model. Run directory: `config.yaml`, `summary.json` (mode
"data-parallel"), `driver.log`, the `evals` event-log rows, the final parameters as one checkpoint in the
engine's format under `checkpoints/` (or `checkpoint.uri`; `diloco sample` and `diloco export` read it),
Ray Train's storage under `ray_train/`.

Ray Train 2.60: v2 is the default (`RAY_TRAIN_V2_ENABLED` unset = on); `Result.metrics` holds only
metrics reported with a checkpoint, so rank 0's record comes back as `Result.return_value`; start-up
(controller, placement group, worker processes: 15-20 s on a quiet 2-core box) is `startup_s`, kept
out of `wall_s` as the engine keeps island start-up out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from islands.distributed import describe_device
from islands.model_api import instantiate, state_tensors
from islands.spec import InnerSettings, ModelRecipe
from islands.stream import TokenStream
from islands.trainer import InnerTrainer, forward_backward
from orchestrator.config import DATA_PARALLEL_MODE, ConfigError, RunConfig
from orchestrator.core.checkpoint import AVERAGE_PREFIX, PARAM_PREFIX, CheckpointStore, run_checkpoint_uri
from orchestrator.core.evaluation import Evaluator
from orchestrator.run.evaluations import unigram_baseline  # the baseline scored as the engine's run scores it
from policies.averaging import average_weight
from policies.lr_schedule import lr_factor
from policies.network import NetworkModel
from policies.stopping import target_reached

log = logging.getLogger(__name__)

WIRE_BYTES = {"bf16": 2, "fp32": 4}  # bytes per gradient element on the emulated wire


@dataclass(frozen=True)
class WorkerSlot:
    """One island slot of the config, as one data-parallel worker: its pool, region and pacing."""

    island: int  # slot index in pool order; also the worker's data shard
    pool: str
    region: str
    labels: dict[str, str]
    emulated_slowdown: float
    emulated_jitter: float
    precision: str | None = None  # the pool's inner-step arithmetic; None follows inner.precision


def worker_slots(cfg: RunConfig) -> list[WorkerSlot]:
    """Every island slot of `cfg.pools` in pool order (the engine's island numbering)."""
    out: list[WorkerSlot] = []
    for pool in cfg.pools:
        for _ in range(pool.islands):
            out.append(WorkerSlot(len(out), pool.name, pool.region, dict(pool.labels),
                                  pool.emulated_slowdown, pool.emulated_jitter, pool.precision))
    return out


def assign_slots(slots: list[WorkerSlot], node_labels: list[dict[str, str]]) -> list[int]:
    """Rank -> slot index such that every rank's node carries its slot's pool labels.

    Ray Train orders ranks by node, not by placement bundle, so a worker learns which slot it holds
    from its node's labels. Greedy over slots in order, lowest free matching rank first; the label
    selectors that placed the workers guarantee a match. ValueError if none exists.
    """
    if len(slots) != len(node_labels):
        raise ValueError(f"{len(node_labels)} workers for {len(slots)} island slots; they must be equal")
    rank_of: dict[int, int] = {}
    free = list(range(len(node_labels)))
    for slot in slots:
        match = next((r for r in free if all(node_labels[r].get(k) == v for k, v in slot.labels.items())), None)
        if match is None:
            raise ValueError(f"no worker runs on a node with pool {slot.pool!r}'s labels {slot.labels}; "
                             "check the nodes' labels with `ray status`")
        free.remove(match)
        rank_of[slot.island] = match
    order = [0] * len(slots)
    for island, rank in rank_of.items():
        order[rank] = island
    return order


def steps_for_budget(token_budget: int, *, workers: int, batch_size: int, seq_len: int) -> int:
    """Whole synchronous steps until all workers together have processed at least `token_budget` tokens."""
    return max(1, math.ceil(token_budget / (workers * batch_size * seq_len)))


def parameter_checksum(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes in name order: equal on every rank iff the replicas are bitwise equal."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def uses_gpus(cfg: RunConfig) -> bool:
    """True when the workers train on GPUs (every pool's accelerator is not 'cpu'), False on CPUs.

    Raises ConfigError for what one Ray Train worker group cannot run: pools that mix CPU and GPU
    accelerators (one `use_gpu`, one collective backend), islands of several workers, and several GPU
    workers at a fraction of a GPU each (Ray packs them onto one card, where NCCL refuses two ranks).
    """
    if any(p.workers_per_island != 1 for p in cfg.pools):
        raise ConfigError("data-parallel: set workers_per_island=1 on every pool (one Ray Train worker per island slot)")
    kinds = {p.accelerator == "cpu" for p in cfg.pools}
    if len(kinds) > 1:
        cpu = ", ".join(p.name for p in cfg.pools if p.accelerator == "cpu")
        raise ConfigError(f"data-parallel: pools mix CPU ({cpu}) and GPU accelerators, and Ray Train runs one kind of "
                          "worker; compare on one kind (set the same accelerator on every pool)")
    gpu = kinds == {False}
    if gpu and cfg.num_islands > 1 and min(p.gpus_per_worker for p in cfg.pools) < 1:
        raise ConfigError(f"data-parallel: {cfg.num_islands} GPU workers need a whole GPU each (NCCL refuses two ranks "
                          "on one card), but a pool sets gpus_per_worker below 1; set gpus_per_worker: 1")
    return gpu


def scaling_config(cfg: RunConfig):
    """Ray Train's ScalingConfig: one worker per island slot, per-worker label selectors, the pools' CPUs and GPUs.

    Ray Train takes one `resources_per_worker` for all workers, so pools must agree on custom
    resources; CPUs (and GPUs) are the smallest `cpus_per_island` (`gpus_per_worker`) of the pools
    (never more than a pool offers).
    """
    from ray.train import ScalingConfig

    custom = {tuple(sorted(p.resources.items())) for p in cfg.pools}
    if len(custom) > 1:
        raise ConfigError("data-parallel: pools ask for different custom resources, and Ray Train takes one "
                          "resources_per_worker for all workers; pin pools with labels instead of resources")
    gpu = uses_gpus(cfg)
    slots = worker_slots(cfg)
    resources = {"CPU": min(p.cpus_per_island for p in cfg.pools), **cfg.pools[0].resources}
    if gpu:
        resources["GPU"] = min(p.gpus_per_worker for p in cfg.pools)
    return ScalingConfig(num_workers=len(slots), use_gpu=gpu, resources_per_worker=resources,
                         label_selector=[s.labels for s in slots])


# ---------------------------------------------------------------------------- the per-worker loop


@dataclass(frozen=True)
class _WorkerSettings:
    """What every data-parallel worker reads, as Ray Train's train_loop_config {"settings": ...}."""

    slots: list[WorkerSlot]
    recipe: ModelRecipe  # the run's model, loss and inner optimizer (orchestrator.run.workload.run_recipe)
    inner: InnerSettings  # the run's (orchestrator.run.driver.inner_settings)
    seed: int
    train: list[Any]  # [ObjectRef of the training tokens], fetched by each worker
    heldout: list[Any]  # [ObjectRef of the held-out tokens]
    eval_batches: int
    eval_batch_size: int
    eval_interval_s: float
    steps: int
    max_wall_s: float | None
    stop_at_eval_loss: float | None
    allreduce_delay_s: float  # EMULATED seconds slept after every step's all-reduce
    wire: str  # 'bf16' | 'fp32'
    average_window: int | None
    torch_threads: int
    progress: Any  # a ray.util.queue.Queue for rank 0's evaluations, or None
    gpu: bool


class _DPWorker:
    """One data-parallel worker inside Ray Train's train function: its slot, model, inner AdamW and the flat
    all-reduce buffer; rank 0 also holds the evaluator, the evaluations and the moving average."""

    def __init__(self, settings: _WorkerSettings) -> None:
        import ray
        import ray.train
        import ray.train.torch

        self.settings = settings
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        torch.set_num_threads(settings.torch_threads)
        # NCCL on GPU pools: the card Ray Train assigned this worker; the buffers below live there.
        self.device = ray.train.torch.get_device() if settings.gpu else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.device)
        slots = settings.slots
        labels = [None] * self.world
        dist.all_gather_object(labels, dict(ray.get_runtime_context().get_node_labels()))
        self.slot = slots[assign_slots(slots, labels)[self.rank]]
        self._build()

    def _build(self) -> None:
        """The model, optimizer, buffers and counters; the evaluator on rank 0."""
        import ray

        settings, slot = self.settings, self.slot
        self.recipe, self.inner = settings.recipe, settings.inner
        inner = self.inner
        self.precision = slot.precision or inner.precision  # the pool's arithmetic, as its islands would step
        train = ray.get(settings.train[0])  # the run's data plan (a TokenStream, no tokens), or the corpus in memory
        data = train if isinstance(train, TokenStream) else np.asarray(train)
        self.trainer = InnerTrainer(self.recipe, data, settings=inner, shard_index=slot.island, num_shards=self.world,
                                    seed=settings.seed, device=self.device, pool=slot.pool)
        self.model, self.opt = self.trainer.model, self.trainer.optimizer
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(self.numel + 2, device=self.device)  # [gradients..., loss, stop flag]: one all_reduce per step
        self.jitter_rng = random.Random(settings.seed * 1_000_003 + slot.island)  # islands/trainer.py's pacing draws
        self.evaluator = Evaluator(self.recipe, ray.get(settings.heldout[0]), batches=settings.eval_batches,
                                   batch_size=settings.eval_batch_size) if self.rank == 0 else None
        self.steps, self.tokens_per_step = settings.steps, self.world * inner.batch_size * self.recipe.seq_len
        self.stopped_by = "token_budget"  # rank 0 decides every stop and tells the others through the step's all-reduce
        self.evals: list[dict] = []
        self.eval_s = self.useful_s = self.network_s = 0.0
        # run.average_window: rank 0 serves a moving average of the model, as the engine's outer optimizer does.
        self.window = settings.average_window
        self.average = [p.detach().clone() for p in self.params] if self.rank == 0 and self.window is not None else None
        self.t0, self.wall_s, self.train_loss, self.done = 0.0, 0.0, math.nan, 0

    def served(self) -> dict[str, torch.Tensor]:
        """The state tensors rank 0 evaluates and saves: the moving average of the parameters where there is
        one, else the model's; trained buffers (islands.model_api.state_tensors) are rank 0's own, never averaged."""
        state = state_tensors(self.model)
        if self.average is None:
            return state
        return {**state, **{n: a for (n, _), a in zip(self.model.named_parameters(), self.average)}}

    def evaluate(self, step: int, train_loss: float | None) -> None:
        """Rank 0: score the served parameters after `step` steps, record the point and report its progress."""
        e0 = time.monotonic()
        loss, bpb = self.evaluator.evaluate(self.served())
        self.eval_s += time.monotonic() - e0
        tokens = step * self.tokens_per_step
        point = {"wall_s": e0 - self.t0, "at": time.time(), "tokens_processed": tokens, "tokens_merged": float(tokens),
                 "versions": [step], "eval_loss": loss, "eval_bits_per_byte": bpb}
        self.evals.append(point)
        if self.settings.progress is not None:  # best effort: a full queue only drops a progress line
            try:
                self.settings.progress.put_nowait({**point, "train_loss": train_loss})
            except Exception:  # noqa: BLE001
                pass

    def train(self) -> None:
        """Every synchronous step until the budget, or until rank 0's stop flag comes back in an all-reduce."""
        dist.barrier()  # every worker built and loaded: training starts now for all of them
        self.t0 = time.monotonic()
        if self.rank == 0:
            self.evaluate(0, None)
        next_eval = self.t0 + self.settings.eval_interval_s
        for step in range(self.steps):
            local_s = self._local_step(step)
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)  # local gloo: ~free next to the emulated time below
            if self.flat[self.numel + 1] > 0:
                # Stop before applying this step: the parameters stay those rank 0 last evaluated when it
                # decided to stop at the target, so the run's final evaluation is the one the rule saw.
                break
            self._apply_step()
            self.useful_s += local_s  # the worker's own step (compute + its pool's emulated pace); waits are not useful
            self.done = step + 1
            self._update_average()
            self.train_loss = float(self.flat[self.numel])
            if self.rank == 0 and time.monotonic() >= next_eval and self.done < self.steps:
                self.evaluate(self.done, self.train_loss)
                next_eval = time.monotonic() + self.settings.eval_interval_s
                if target_reached([e["eval_loss"] for e in self.evals], self.settings.stop_at_eval_loss):
                    self.stopped_by = "stop_at_eval_loss"  # the flag goes out with the next step's all-reduce
        self.wall_s = time.monotonic() - self.t0

    def _local_step(self, step: int) -> float:
        """Forward and backward on this worker's batch into the flat buffer, paced as its pool; the seconds it took."""
        inner, flat, numel = self.inner, self.flat, self.numel
        s0 = time.perf_counter()
        batch = self.trainer.next_batch()  # (inputs [B, T], targets [B, T]) on the worker's device
        factor = lr_factor(inner.lr_schedule, step=step, warmup_steps=inner.warmup_steps, progress=step / self.steps,
                           final_ratio=inner.lr_final_ratio)  # the islands' rule, at DP's exact progress
        for group, peak in zip(self.opt.param_groups, self.trainer._peak_lrs):  # each group's own peak, as the islands
            group["lr"] = peak * factor
        # The islands' arithmetic and the recipe's loss.
        loss = forward_backward(self.model, batch, precision=self.precision, loss_fn=self.trainer.loss_fn)
        torch.cat([p.grad.reshape(-1) for p in self.params], out=flat[:numel])
        if self.settings.wire == "bf16":  # what crosses the emulated wire: the gradient rounded to bf16
            flat[:numel] = flat[:numel].to(torch.bfloat16).to(torch.float32)
        flat[numel] = loss.detach()
        max_wall_s = self.settings.max_wall_s
        if self.rank == 0 and self.stopped_by == "token_budget" and max_wall_s is not None \
                and time.monotonic() - self.t0 >= max_wall_s:
            self.stopped_by = "max_wall_s"
        flat[numel + 1] = 1.0 if self.rank == 0 and self.stopped_by != "token_budget" else 0.0
        if self.cuda:  # the kernels above are only queued: time the step once the card finished it
            torch.cuda.synchronize(self.device)
        compute = time.perf_counter() - s0
        stretch = self.slot.emulated_slowdown  # EMULATION of the pool's speed, as islands/trainer.py
        if self.slot.emulated_jitter > 0:
            stretch *= 1.0 + self.jitter_rng.uniform(-1.0, 1.0) * self.slot.emulated_jitter
        if stretch > 1.0:
            time.sleep(compute * (stretch - 1.0))
        return time.perf_counter() - s0

    def _apply_step(self) -> None:
        """The averaged gradient into every parameter's .grad, clip, AdamW step, then the EMULATED all-reduce time."""
        flat, numel = self.flat, self.numel
        flat[:numel + 1] /= self.world
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if self.inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.inner.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        delay_s = self.settings.allreduce_delay_s
        if delay_s > 0:  # EMULATED network: the ring all-reduce among the workers' regions
            n0 = time.perf_counter()
            time.sleep(delay_s)
            self.network_s += time.perf_counter() - n0

    def _update_average(self) -> None:
        """Rank 0 under run.average_window: one step of the moving average (policies/averaging.py)."""
        if self.average is None:
            return
        w = average_weight(self.tokens_per_step, self.done * self.tokens_per_step, self.window)
        with torch.no_grad():
            for a, p in zip(self.average, self.params):
                a.lerp_(p.detach(), w)

    def finish(self) -> dict[str, Any] | None:
        """Gather every worker's record; rank 0 evaluates the final model and returns the run's record."""
        import ray

        done, model = self.done, self.model
        record = {"rank": self.rank, "island": self.slot.island, "pool": self.slot.pool, "region": self.slot.region,
                  "node": ray.get_runtime_context().get_node_id(), "steps": done,
                  "tokens": done * self.inner.batch_size * self.recipe.seq_len,
                  "useful_s": self.useful_s, "network_s": self.network_s, "checksum": parameter_checksum(model),
                  "device": describe_device(self.device), "precision": self.precision}
        records = [None] * self.world
        dist.all_gather_object(records, record)
        if self.rank != 0:
            return None
        if not self.evals or self.evals[-1]["versions"] != [done]:  # a stop right after an evaluation has it already
            self.evaluate(done, self.train_loss)
        raw_loss = None if self.average is None else self.evaluator.evaluate(state_tensors(model))[0]
        return {"world_size": self.world, "backend": dist.get_backend(), "steps": done,
                "tokens_per_step": self.tokens_per_step, "train_loss": self.train_loss, "raw_loss": raw_loss,
                "wall_s": self.wall_s, "eval_s": self.eval_s, "evals": self.evals, "stopped_by": self.stopped_by,
                "workers": sorted(records, key=lambda r: r["island"]),
                # The final model (every worker holds the same), saved by the driver: `diloco sample` / `export`.
                # As numpy arrays (bit for bit): Ray Train 2.60 refuses torch tensors in a return value.
                "params": {n: p.detach().cpu().numpy().copy() for n, p in state_tensors(model).items()},
                "average": None if self.average is None else {n: a.cpu().numpy().copy() for n, a in self.served().items()}}


def _dp_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's train function: one data-parallel worker. Rank 0 returns the run's record."""
    worker = _DPWorker(config["settings"])
    worker.train()
    return worker.finish()


# ---------------------------------------------------------------------------- the driver side


@dataclass(frozen=True)
class _Plan:
    """What the driver works out before the workers start: the model's recipe, the slots, the EMULATED wire."""

    recipe: ModelRecipe
    network: NetworkModel  # the run's (orchestrator.run.driver.build_run_network)
    slots: list[WorkerSlot]
    grad_bytes: int  # one gradient on the emulated wire
    delay_s: float  # EMULATED seconds of one step's ring all-reduce
    per_worker_bytes: int  # what one worker sends per step
    steps: int


def _plan(cfg: RunConfig, data: Any, wire: str) -> _Plan:
    """The run's model recipe, network, slots, per-step wire bytes and time, and step count (`data`: the run's
    orchestrator.run.workload.TrainingData)."""
    from orchestrator.run.driver import build_run_network, measure_step_s, timing_data
    from orchestrator.run.workload import run_recipe

    recipe = run_recipe(cfg, data)  # model.factory / loss / optimizer, else the built-in model
    n_params = sum(p.numel() for p in instantiate(recipe.model, recipe.seed).parameters())  # every one all-reduced
    model_bytes = 4 * n_params  # float32: the network's scaling unit (policies.network)
    network, _ = build_run_network(cfg, model_bytes, lambda: measure_step_s(cfg, recipe, timing_data(data)))
    slots = worker_slots(cfg)
    regions = [s.region for s in slots]
    grad_bytes = WIRE_BYTES[wire] * n_params
    delay_s = network.allreduce_s(grad_bytes, regions) if network.emulated else 0.0
    per_worker_bytes = network.allreduce_bytes(grad_bytes, len(slots))
    steps = steps_for_budget(cfg.run.token_budget, workers=len(slots), batch_size=cfg.data.batch_size,
                             seq_len=recipe.seq_len)
    log.info("data-parallel: %s, %d workers, %d steps, %s; all-reduce of %d bytes (%s): %.3f s EMULATED per step",
             recipe.name, len(slots), steps, network.describe(), grad_bytes, wire, delay_s)
    return _Plan(recipe, network, slots, grad_bytes, delay_s, per_worker_bytes, steps)


def _loop_config(cfg: RunConfig, plan: _Plan, data: Any, *, wire: str, queue: Any, gpu: bool) -> dict[str, Any]:
    """Ray Train's train_loop_config: the settings every worker reads (the data plan or the corpus, and the held-out
    tokens, as object refs)."""
    import ray

    from orchestrator.settings import inner_settings

    return {"settings": _WorkerSettings(
        slots=plan.slots, recipe=plan.recipe, inner=inner_settings(cfg), seed=cfg.run.seed,
        train=[ray.put(data.train)], heldout=[ray.put(data.heldout)],
        eval_batches=cfg.eval.batches, eval_batch_size=cfg.eval.batch_size, eval_interval_s=cfg.eval.interval_s,
        steps=plan.steps, max_wall_s=cfg.run.max_wall_s, stop_at_eval_loss=cfg.run.stop_at_eval_loss,
        allreduce_delay_s=plan.delay_s, wire=wire, average_window=cfg.run.average_window,
        torch_threads=cfg.inner.torch_threads, progress=queue, gpu=gpu)}


def _refuse_used_checkpoints(ckpt_uri: str) -> None:
    """ConfigError when `ckpt_uri` already holds checkpoints: this run's model would be saved over another
    run's, or refused at the end."""
    if "://" in ckpt_uri or Path(ckpt_uri).is_dir():
        if CheckpointStore(ckpt_uri).list():
            raise ConfigError(f"{ckpt_uri} already holds checkpoints of another run; pick a new --run-dir")


def _log_to(path: Path) -> logging.Handler:
    """A handler on the root logger writing to `path` (driver.log); the caller removes and closes it."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def train_data_parallel(cfg: RunConfig, run_dir: str | Path, *, address: str | None = None,
                        progress: Callable[[dict], None] | None = None, wire: str = "bf16",
                        in_memory: bool = False) -> dict:
    """Train `cfg` with synchronous data parallelism on Ray Train's TorchTrainer; write RUN_DIR; return the summary.

    `progress` gets a dict (wall_s, tokens_processed, eval_loss, eval_bits_per_byte, train_loss) at
    every evaluation. `wire` is the gradient's format on the EMULATED wire: 'bf16' (default) or 'fp32'.
    Worker i streams island slot i's data as the engine would; `in_memory` reads the whole corpus into every
    worker and samples random windows of its shard instead (the baseline before 2026-12-03; module docstring).
    Joins the running Ray if there is one (never calls ray.init then), else starts one as
    `diloco train` does and shuts it down after.
    """
    import ray
    from ray.train import FailureConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    from orchestrator.run.driver import ensure_ray, with_measured_step

    if wire not in WIRE_BYTES:
        raise ConfigError(f"wire={wire!r}: use one of {', '.join(WIRE_BYTES)}")
    gpu = uses_gpus(cfg)
    run_dir = Path(run_dir).resolve()
    ckpt_uri = run_checkpoint_uri(cfg.checkpoint.uri, run_dir)
    _refuse_used_checkpoints(ckpt_uri)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = _log_to(run_dir / "driver.log")
    try:
        cfg = with_measured_step(cfg, address)
        started = ensure_ray(cfg, address, prestart=False)  # its workers are Ray Train's, not ours
    except BaseException:  # a local Ray that did not start: the caller's root logger keeps no handler of ours
        logging.getLogger().removeHandler(handler)
        handler.close()
        raise
    queue = None
    try:
        (run_dir / "config.yaml").write_text(yaml.safe_dump({**cfg.model_dump(mode="json"), "mode": DATA_PARALLEL_MODE}, sort_keys=False))
        data = _training_data(cfg, in_memory=in_memory)
        plan = _plan(cfg, data, wire)
        here = ray.get_runtime_context().get_node_id()
        queue = Queue(maxsize=1000, actor_options={"num_cpus": 0, "label_selector": {"ray.io/node-id": here}}) if progress else None
        loop_config = _loop_config(cfg, plan, data, wire=wire, queue=queue, gpu=gpu)
        trainer = TorchTrainer(
            _dp_worker, train_loop_config=loop_config, scaling_config=scaling_config(cfg),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            run_config=TrainRunConfig(name="dp", storage_path=str(run_dir / "ray_train"),
                                      failure_config=FailureConfig(max_failures=0)),
        )
        f0 = time.monotonic()
        result = _fit(trainer, queue, progress, Empty)
        fit_s = time.monotonic() - f0
        out = result.return_value
        if out is None:
            raise RuntimeError(f"Ray Train finished without a result from rank 0 (error: {result.error})")
        summary = _summary(cfg, out, plan, wire=wire, fit_s=fit_s, unigram=unigram_baseline(data),
                           corpus=data.source + ("" if data.is_streamed else "; read whole into every worker"),
                           result_path=result.path)
        _write_outputs(cfg, run_dir, ckpt_uri, out, summary)
        log.info("data-parallel done: loss %.4f after %d tokens, %.0f s (+%.0f s Ray Train start-up)",
                 summary["eval_loss"], summary["tokens_processed"], summary["wall_s"], summary["startup_s"])
        return summary
    finally:
        if queue is not None:
            queue.shutdown()
        logging.getLogger().removeHandler(handler)
        handler.close()
        if started:
            ray.shutdown()


def _training_data(cfg: RunConfig, *, in_memory: bool) -> Any:
    """The run's data as the islands would read it (a TokenStream plan), or the corpus read whole (`in_memory`)."""
    from orchestrator.run.workload import TrainingData, load_corpus, training_data

    return TrainingData.of_corpus(load_corpus(cfg)) if in_memory else training_data(cfg)


def _write_outputs(cfg: RunConfig, run_dir: Path, ckpt_uri: str, out: dict, summary: dict) -> None:
    """The evals event-log rows, summary.json, then the final parameters as one checkpoint."""
    from orchestrator.core.eventlog import EventLog

    events = EventLog(run_dir)
    events.add("evals", out["evals"])
    events.flush()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    # The final parameters, in the engine's checkpoint format, so `diloco sample` / `diloco export` read
    # either method's model the same way (orchestrator.run.trained); after the summary, which a failed save
    # must not cost.
    average = out.pop("average") or {}  # the served model beside the raw one, as the engine's checkpoints
    CheckpointStore(ckpt_uri, keep=cfg.checkpoint.keep).save(
        out["steps"], {**{PARAM_PREFIX + n: torch.from_numpy(a) for n, a in out.pop("params").items()},
                       **{AVERAGE_PREFIX + n: torch.from_numpy(a) for n, a in average.items()}},
        {"mode": DATA_PARALLEL_MODE, "steps": out["steps"], "tokens_processed": summary["tokens_processed"]})


def _fit(trainer, queue, progress, empty) -> Any:
    """trainer.fit(), feeding `progress` from the workers' queue meanwhile (fit blocks, so it runs in a thread)."""
    if progress is None:
        return trainer.fit()
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread below
            box["error"] = err

    thread = threading.Thread(target=run, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive() or not queue.empty():
        try:
            progress(queue.get(timeout=0.5))
        except empty:
            pass
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _summary(cfg: RunConfig, out: dict, plan: _Plan, *, wire: str, fit_s: float, unigram: float | None, corpus: str,
             result_path: str | None) -> dict:
    """summary.json of a data-parallel run: the engine's summary fields where they apply, and DP's own."""
    final = out["evals"][-1]
    workers, steps, wall = out["workers"], out["steps"], out["wall_s"]
    useful = sum(w["useful_s"] for w in workers)
    allocated = len(workers) * wall
    tokens = steps * out["tokens_per_step"]
    return {
        "mode": DATA_PARALLEL_MODE,
        "trainer": "ray.train.torch.TorchTrainer",
        "world_size": out["world_size"],
        "backend": out["backend"],
        "emulation": _emulation_note(cfg),
        "eval_loss": final["eval_loss"],
        "eval_loss_raw": out["raw_loss"],  # the raw model's, on the same batches; None without run.average_window
        "eval_bits_per_byte": final["eval_bits_per_byte"],
        "unigram_bits_per_byte": unigram,
        "train_loss": out["train_loss"],
        "tokens_processed": tokens,
        "tokens_merged": tokens,  # every step's gradient reaches the parameters
        "token_budget": cfg.run.token_budget,
        "steps": steps,
        "tokens_per_step": out["tokens_per_step"],
        "goodput": useful / allocated if allocated > 0 else 0.0,  # local step time / (workers x wall): waits, network, eval are not useful
        "useful_s": useful,
        "allocated_s": allocated,
        "bytes_per_worker_per_step": plan.per_worker_bytes,
        "bytes_sent": steps * plan.per_worker_bytes * len(workers),
        "gradient_wire": wire,
        "gradient_bytes": plan.grad_bytes,
        "network": plan.network.describe(),
        "network_emulated": plan.network.emulated,
        "allreduce_emulated_s": plan.delay_s,  # EMULATED seconds slept after every step's all-reduce
        "network_wait_s": sum(w["network_s"] for w in workers) / len(workers),
        "eval_s": out["eval_s"],
        "wall_s": wall,
        "stopped_by": out["stopped_by"],  # token_budget | max_wall_s | stop_at_eval_loss
        "startup_s": max(0.0, fit_s - wall),  # Ray Train controller, placement, worker start, imports, data
        "corpus": corpus,
        "ray_train_path": result_path,
        "parameter_checksums": [w["checksum"] for w in workers],
        "islands": [_island_row(w) for w in workers],
        "failures": 0,
        "restarts": 0,
        "evals": out["evals"],
    }


def _emulation_note(cfg: RunConfig) -> str | None:
    """The summary's EMULATION line for pools whose speed is emulated; None when none is."""
    emulation = [f"{p.name} x{p.emulated_slowdown:g}" + (f" ±{p.emulated_jitter:.0%}" if p.emulated_jitter else "")
                 for p in cfg.pools if p.emulated]
    return f"EMULATION: pool speeds emulated by throttling on one machine ({', '.join(emulation)})" if emulation else None


def _island_row(w: dict) -> dict:
    """One worker's record as the engine's per-island summary row (one incarnation, never failed)."""
    return {"island": w["island"], "pool": w["pool"], "region": w["region"], "node": w["node"], "rank": w["rank"],
            "incarnation": 1, "failures": 0, "restarts": 0, "state": "finished", "steps": w["steps"],
            "tokens": w["tokens"], "device": w["device"], "precision": w["precision"]}
