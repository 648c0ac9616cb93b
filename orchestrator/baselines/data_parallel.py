"""Synchronous data-parallel baseline on Ray Train's `TorchTrainer`, in the engine's harness (docs/baselines.md).

One Ray Train worker per island slot of `cfg.pools` (pinned to its pool's nodes by label selector,
tagged with its region), the same model and initial parameters, the same inner AdamW (lr, warmup,
lr schedule at DP's exact progress, clip, betas, weight decay) on every step on the gradient averaged
over all workers (one `all_reduce` of a flat buffer: DDP with one bucket; gloo on CPU pools, NCCL on GPU
pools, each worker on the card Ray Train gave it), the same per-worker
batch, disjoint shards (slot i reads shard i of n, as island i does) and the same global token
budget. After each exchange every worker sleeps the EMULATED ring all-reduce time
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

import argparse
import hashlib
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import yaml

from islands.data import unigram_bits_per_byte
from islands.model import build_model
from islands.trainer import InnerTrainer, forward_backward
from orchestrator.core.checkpoint import AVERAGE_PREFIX, PARAM_PREFIX, CheckpointStore, run_checkpoint_uri
from orchestrator.cli.main import held_out_loss_cell
from orchestrator.config import ConfigError, RunConfig, load_config
from policies.averaging import average_weight
from policies.lr_schedule import lr_factor

log = logging.getLogger(__name__)

MODE = "data-parallel"
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


def _dp_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's train function: one data-parallel worker. Rank 0 returns the run's record."""
    import ray
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from orchestrator.core.evaluation import Evaluator
    from policies.stopping import target_reached

    from islands.distributed import describe_device

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["torch_threads"])
    # NCCL on GPU pools: the card Ray Train assigned this worker; the buffers below live there.
    device = ray.train.torch.get_device() if config["gpu"] else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    slots: list[WorkerSlot] = config["slots"]
    labels = [None] * world
    dist.all_gather_object(labels, dict(ray.get_runtime_context().get_node_labels()))
    slot = slots[assign_slots(slots, labels)[rank]]

    model_cfg, inner = config["model_config"], config["inner"]
    precision = slot.precision or inner.precision  # the pool's arithmetic, as its islands would step
    train = ray.get(config["train"][0])
    trainer = InnerTrainer(model_cfg, np.asarray(train), settings=inner, shard_index=slot.island,
                           num_shards=world, seed=config["seed"], device=device)
    model, opt = trainer.model, trainer.optimizer
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(numel + 2, device=device)  # [gradients..., loss, stop flag]: one all_reduce per step
    jitter_rng = random.Random(config["seed"] * 1_000_003 + slot.island)  # islands/trainer.py's pacing draws
    evaluator = Evaluator(model_cfg, ray.get(config["heldout"][0]), batches=config["eval_batches"],
                          batch_size=config["eval_batch_size"]) if rank == 0 else None
    steps, tokens_per_step = config["steps"], world * inner.batch_size * model_cfg.seq_len
    delay_s, max_wall_s, interval = config["allreduce_delay_s"], config["max_wall_s"], config["eval_interval_s"]
    stopped_by = "token_budget"  # rank 0 decides every stop and tells the others through the step's all-reduce
    bf16 = config["wire"] == "bf16"

    evals: list[dict] = []
    eval_s = useful_s = network_s = 0.0
    # run.average_window: rank 0 serves a moving average of the model, as the engine's outer optimizer does.
    window = config["average_window"]
    average = [p.detach().clone() for p in params] if rank == 0 and window is not None else None

    def served() -> dict[str, torch.Tensor]:
        if average is None:
            return dict(model.named_parameters())
        return {n: a for (n, _), a in zip(model.named_parameters(), average)}

    def evaluate(step: int, t0: float, train_loss: float | None) -> None:
        nonlocal eval_s
        e0 = time.monotonic()
        loss, bpb = evaluator.evaluate(served())
        eval_s += time.monotonic() - e0
        tokens = step * tokens_per_step
        point = {"wall_s": e0 - t0, "at": time.time(), "tokens_processed": tokens, "tokens_merged": float(tokens),
                 "versions": [step], "eval_loss": loss, "eval_bits_per_byte": bpb}
        evals.append(point)
        if config["progress"] is not None:  # best effort: a full queue only drops a progress line
            try:
                config["progress"].put_nowait({**point, "train_loss": train_loss})
            except Exception:  # noqa: BLE001
                pass

    dist.barrier()  # every worker built and loaded: training starts now for all of them
    t0 = time.monotonic()
    if rank == 0:
        evaluate(0, t0, None)
    next_eval = t0 + interval
    train_loss, done = math.nan, 0
    for step in range(steps):
        s0 = time.perf_counter()
        x, y = trainer.next_batch()  # [B, T], [B, T], on the worker's device
        lr = inner.lr * lr_factor(inner.lr_schedule, step=step, warmup_steps=inner.warmup_steps, progress=step / steps,
                                  final_ratio=inner.lr_final_ratio)  # the islands' rule, at DP's exact progress
        for group in opt.param_groups:
            group["lr"] = lr
        loss = forward_backward(model, x, y, precision=precision)  # the islands' arithmetic
        torch.cat([p.grad.reshape(-1) for p in params], out=flat[:numel])
        if bf16:  # what crosses the emulated wire: the gradient rounded to bf16
            flat[:numel] = flat[:numel].to(torch.bfloat16).to(torch.float32)
        flat[numel] = loss.detach()
        if rank == 0 and stopped_by == "token_budget" and max_wall_s is not None and time.monotonic() - t0 >= max_wall_s:
            stopped_by = "max_wall_s"
        flat[numel + 1] = 1.0 if rank == 0 and stopped_by != "token_budget" else 0.0
        if cuda:  # the kernels above are only queued: time the step once the card finished it
            torch.cuda.synchronize(device)
        compute = time.perf_counter() - s0
        stretch = slot.emulated_slowdown  # EMULATION of the pool's speed, as islands/trainer.py
        if slot.emulated_jitter > 0:
            stretch *= 1.0 + jitter_rng.uniform(-1.0, 1.0) * slot.emulated_jitter
        if stretch > 1.0:
            time.sleep(compute * (stretch - 1.0))
        local_s = time.perf_counter() - s0
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # local gloo: ~free next to the emulated time below
        if flat[numel + 1] > 0:
            # Stop before applying this step: the parameters stay those rank 0 last evaluated when it
            # decided to stop at the target, so the run's final evaluation is the one the rule saw.
            break
        flat[:numel + 1] /= world
        offset = 0
        with torch.no_grad():
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        if inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if delay_s > 0:  # EMULATED network: the ring all-reduce among the workers' regions
            n0 = time.perf_counter()
            time.sleep(delay_s)
            network_s += time.perf_counter() - n0
        useful_s += local_s  # the worker's own step (compute + its pool's emulated pace); waits are not useful
        done = step + 1
        if average is not None:
            w = average_weight(tokens_per_step, done * tokens_per_step, window)
            with torch.no_grad():
                for a, p in zip(average, params):
                    a.lerp_(p.detach(), w)
        train_loss = float(flat[numel])
        if rank == 0 and time.monotonic() >= next_eval and done < steps:
            evaluate(done, t0, train_loss)
            next_eval = time.monotonic() + interval
            if target_reached([e["eval_loss"] for e in evals], config["stop_at_eval_loss"]):
                stopped_by = "stop_at_eval_loss"  # the flag goes out with the next step's all-reduce
    wall_s = time.monotonic() - t0
    record = {"rank": rank, "island": slot.island, "pool": slot.pool, "region": slot.region,
              "node": ray.get_runtime_context().get_node_id(), "steps": done, "tokens": done * inner.batch_size * model_cfg.seq_len,
              "useful_s": useful_s, "network_s": network_s, "checksum": parameter_checksum(model),
              "device": describe_device(device), "precision": precision}
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank != 0:
        return None
    if not evals or evals[-1]["versions"] != [done]:  # a stop right after an evaluation has it already
        evaluate(done, t0, train_loss)
    raw_loss = None if average is None else evaluator.evaluate(dict(model.named_parameters()))[0]
    return {"world_size": world, "backend": dist.get_backend(), "steps": done, "tokens_per_step": tokens_per_step,
            "train_loss": train_loss, "raw_loss": raw_loss, "wall_s": wall_s, "eval_s": eval_s, "evals": evals, "stopped_by": stopped_by,
            "workers": sorted(records, key=lambda r: r["island"]),
            # The final model (every worker holds the same), saved by the driver: `diloco sample` / `export`.
            # As numpy arrays (bit for bit): Ray Train 2.60 refuses torch tensors in a return value.
            "params": {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()},
            "average": None if average is None else {n: a.cpu().numpy().copy() for n, a in served().items()}}


# ---------------------------------------------------------------------------- the driver side


def train_data_parallel(cfg: RunConfig, run_dir: str | Path, *, address: str | None = None,
                        progress: Callable[[dict], None] | None = None, wire: str = "bf16") -> dict:
    """Train `cfg` with synchronous data parallelism on Ray Train's TorchTrainer; write RUN_DIR; return the summary.

    `progress` gets a dict (wall_s, tokens_processed, eval_loss, eval_bits_per_byte, train_loss) at
    every evaluation. `wire` is the gradient's format on the EMULATED wire: 'bf16' (default) or 'fp32'.
    Joins the running Ray if there is one (never calls ray.init then), else starts one as
    `diloco train` does and shuts it down after.
    """
    import ray
    from ray.train import FailureConfig
    from ray.train import RunConfig as TrainRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Empty, Queue

    from orchestrator.run.driver import build_run_network, ensure_ray, load_corpus, measure_step_s, with_measured_step
    from orchestrator.settings import inner_settings
    from orchestrator.core.eventlog import EventLog

    if wire not in WIRE_BYTES:
        raise ConfigError(f"wire={wire!r}: use one of {', '.join(WIRE_BYTES)}")
    gpu = uses_gpus(cfg)
    run_dir = Path(run_dir).resolve()
    ckpt_uri = run_checkpoint_uri(cfg.checkpoint.uri, run_dir)
    if "://" in ckpt_uri or Path(ckpt_uri).is_dir():
        if CheckpointStore(ckpt_uri).list():  # its model would be saved over another run's, or refused at the end
            raise ConfigError(f"{ckpt_uri} already holds checkpoints of another run; pick a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    cfg = with_measured_step(cfg, address)
    started = ensure_ray(cfg, address)
    queue = None
    try:
        (run_dir / "config.yaml").write_text(yaml.safe_dump({**cfg.model_dump(mode="json"), "mode": MODE}, sort_keys=False))
        corpus = load_corpus(cfg)
        model_cfg = cfg.model.shape()
        n_params = sum(p.numel() for p in build_model(model_cfg, seed=cfg.run.seed).parameters())
        model_bytes = 4 * n_params  # float32: the network's scaling unit (policies.network)
        network, _ = build_run_network(cfg, model_bytes, lambda: measure_step_s(cfg, model_cfg, corpus.train))
        slots = worker_slots(cfg)
        regions = [s.region for s in slots]
        grad_bytes = WIRE_BYTES[wire] * n_params
        delay_s = network.allreduce_s(grad_bytes, regions) if network.emulated else 0.0
        per_worker_bytes = network.allreduce_bytes(grad_bytes, len(slots))
        steps = steps_for_budget(cfg.run.token_budget, workers=len(slots), batch_size=cfg.data.batch_size,
                                 seq_len=model_cfg.seq_len)
        log.info("data-parallel: %d workers, %d steps, %s; all-reduce of %d bytes (%s): %.3f s EMULATED per step",
                 len(slots), steps, network.describe(), grad_bytes, wire, delay_s)
        here = ray.get_runtime_context().get_node_id()
        queue = Queue(maxsize=1000, actor_options={"num_cpus": 0, "label_selector": {"ray.io/node-id": here}}) if progress else None
        loop_config = {
            "slots": slots, "model_config": model_cfg, "inner": inner_settings(cfg), "seed": cfg.run.seed,
            "train": [ray.put(corpus.train)], "heldout": [ray.put(corpus.heldout)],
            "eval_batches": cfg.eval.batches, "eval_batch_size": cfg.eval.batch_size, "eval_interval_s": cfg.eval.interval_s,
            "steps": steps, "max_wall_s": cfg.run.max_wall_s, "stop_at_eval_loss": cfg.run.stop_at_eval_loss,
            "allreduce_delay_s": delay_s, "wire": wire, "average_window": cfg.run.average_window,
            "torch_threads": cfg.inner.torch_threads, "progress": queue, "gpu": gpu,
        }
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
        summary = _summary(cfg, out, network=network, wire=wire, grad_bytes=grad_bytes, per_worker_bytes=per_worker_bytes,
                           delay_s=delay_s, fit_s=fit_s, unigram=unigram_bits_per_byte(
                               corpus.train, corpus.heldout, vocab_size=corpus.vocab_size),
                           corpus=corpus.source, result_path=result.path)
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
            {"mode": MODE, "steps": out["steps"], "tokens_processed": summary["tokens_processed"]})
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


def _summary(cfg: RunConfig, out: dict, *, network, wire: str, grad_bytes: int, per_worker_bytes: int, delay_s: float,
             fit_s: float, unigram: float, corpus: str, result_path: str | None) -> dict:
    final = out["evals"][-1]
    workers, steps, wall = out["workers"], out["steps"], out["wall_s"]
    useful = sum(w["useful_s"] for w in workers)
    allocated = len(workers) * wall
    tokens = steps * out["tokens_per_step"]
    emulation = [f"{p.name} x{p.emulated_slowdown:g}" + (f" ±{p.emulated_jitter:.0%}" if p.emulated_jitter else "")
                 for p in cfg.pools if p.emulated]
    return {
        "mode": MODE,
        "trainer": "ray.train.torch.TorchTrainer",
        "world_size": out["world_size"],
        "backend": out["backend"],
        "emulation": f"EMULATION: pool speeds emulated by throttling on one machine ({', '.join(emulation)})" if emulation else None,
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
        "bytes_per_worker_per_step": per_worker_bytes,
        "bytes_sent": steps * per_worker_bytes * len(workers),
        "gradient_wire": wire,
        "gradient_bytes": grad_bytes,
        "network": network.describe(),
        "network_emulated": network.emulated,
        "allreduce_emulated_s": delay_s,  # EMULATED seconds slept after every step's all-reduce
        "network_wait_s": sum(w["network_s"] for w in workers) / len(workers),
        "eval_s": out["eval_s"],
        "wall_s": wall,
        "stopped_by": out["stopped_by"],  # token_budget | max_wall_s | stop_at_eval_loss
        "startup_s": max(0.0, fit_s - wall),  # Ray Train controller, placement, worker start, imports, data
        "corpus": corpus,
        "ray_train_path": result_path,
        "parameter_checksums": [w["checksum"] for w in workers],
        "islands": [{"island": w["island"], "pool": w["pool"], "region": w["region"], "node": w["node"], "rank": w["rank"],
                     "incarnation": 1, "failures": 0, "restarts": 0, "state": "finished", "steps": w["steps"],
                     "tokens": w["tokens"], "device": w["device"], "precision": w["precision"]} for w in workers],
        "failures": 0,
        "restarts": 0,
        "evals": out["evals"],
    }


# ---------------------------------------------------------------------------- command line

EXAMPLES = """examples:
  diloco baseline-dp --run-dir runs/dp --set run.token_budget=1000000
  diloco baseline-dp --config configs/default.yaml --set network.scenario=wan-4-regions --set run.max_wall_s=120
  python -m orchestrator.baselines.data_parallel --set run.token_budget=200000 --wire fp32
"""


def _cmd(args: argparse.Namespace) -> int:
    import os

    try:
        cfg = load_config(args.config, args.set, also_mode=MODE)  # a DP run dir's own config.yaml too
    except ConfigError as err:
        print(f"diloco baseline-dp: {err}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or f"runs/dp-{time.strftime('%Y%m%d-%H%M%S')}")

    def show(p: dict) -> None:
        print(f"{p['wall_s']:6.0f}s  {p['tokens_processed'] / 1e6:6.2f}M tokens  held-out {p['eval_bits_per_byte']:.3f} bits/byte",
              file=sys.stderr)

    try:
        summary = train_data_parallel(cfg, run_dir, address=args.address or os.environ.get("RAY_ADDRESS"),
                                      progress=None if args.quiet else show, wire=args.wire)
    except ConfigError as err:
        print(f"diloco baseline-dp: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line for the user; the traceback is in driver.log
        log.debug("baseline-dp failed", exc_info=True)
        print(f"diloco baseline-dp: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    rows = [("mode", f"{summary['mode']} ({summary['trainer']}, {summary['world_size']} workers, {summary['backend']})"),
            ("held-out loss (nats/byte)", held_out_loss_cell(summary)),
            ("held-out bits/byte", f"{summary['eval_bits_per_byte']:.3f}"),
            ("unigram bits/byte (baseline)", f"{summary['unigram_bits_per_byte']:.3f}"),
            ("tokens processed", f"{summary['tokens_processed']:,} ({summary['steps']} steps)"),
            ("bytes sent (all workers)", f"{summary['bytes_sent'] / 1e6:,.1f} MB"),
            ("wall time", f"{summary['wall_s']:.0f} s (+{summary['startup_s']:.0f} s Ray Train start-up)"),
            ("network", summary["network"])]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if summary["emulation"]:
        print(summary["emulation"])
    print(f"run directory: {run_dir}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `diloco baseline-dp` (also `python -m orchestrator.baselines.data_parallel`)."""
    p.add_argument("--config", help="YAML run config (default: built-in defaults); pools, model, data, inner, eval, run and network apply")
    p.add_argument("--run-dir", help="where to write summary.json and the event log (default: runs/dp-<timestamp>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--wire", choices=sorted(WIRE_BYTES), default="bf16", help="gradient format on the EMULATED wire (default bf16)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local Ray)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd)


def register(subparsers) -> None:
    """Add `baseline-dp` to the `diloco` parser's subparsers."""
    p = subparsers.add_parser("baseline-dp", help="synchronous data-parallel baseline on Ray Train (TorchTrainer)",
                              description="Train the config's model with synchronous data parallelism on Ray Train's "
                                          "TorchTrainer: one worker per island slot, the same model, data, inner AdamW, "
                                          "token budget and EMULATED network as `diloco train`.",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.baselines.data_parallel ...`: the same as `diloco baseline-dp ...`."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m orchestrator.baselines.data_parallel", description=__doc__.splitlines()[0],
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
