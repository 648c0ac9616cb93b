"""The run driver: builds a run from a RunConfig, places islands on their pools, watches progress,
evaluates the global parameters, stops on the token budget and writes the run directory.

Run directory: `config.yaml` (resolved), `events/` (Parquet event log), `summary.json`, `driver.log`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
import yaml
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from islands.data import Corpus, load_parquet_corpus, load_stdlib_corpus, unigram_bits_per_byte
from islands.island import IslandSpec
from islands.model import build_model, model_config
from islands.trainer import InnerSettings
from orchestrator.actors import NAMESPACE, WORKER_ENV, IslandActor, OuterOptimizerActor, ignore_zero_copy_warnings
from orchestrator.config import RunConfig
from orchestrator.evaluation import Evaluator
from orchestrator.eventlog import EventLog
from orchestrator.outer_optimizer import OuterSettings
from orchestrator.placement import create_island_group, island_scheduling, release_group
from policies.fragments import plan_fragments

log = logging.getLogger(__name__)


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


@dataclass
class _Slot:
    island: int
    pool: Any
    incarnation: int
    handle: Any = None
    group: Any = None
    node: str | None = None
    status: Any = None


def load_corpus(cfg: RunConfig) -> Corpus:
    """The training corpus named by the config (the embedded stdlib corpus by default)."""
    d = cfg.data
    if d.source == "stdlib":
        return load_stdlib_corpus(heldout_fraction=d.heldout_fraction, max_bytes=d.max_bytes)
    return load_parquet_corpus(d.path, text_column=d.text_column, token_column=d.token_column,
                               heldout_fraction=d.heldout_fraction)


def outer_settings(cfg: RunConfig) -> OuterSettings:
    """Unpack the config's outer section into the plain values the outer optimizer takes."""
    o = cfg.outer
    return OuterSettings(
        min_quorum=cfg.min_quorum_count(), grace_gamma=o.grace_gamma, grace_cap_s=o.grace_cap_s,
        tau_steps=o.effective_tau_steps(), weighting=o.weighting, staleness_discount=o.staleness_discount,
        merge_rule=o.merge_rule, lr=o.lr, momentum=o.momentum, max_staleness=o.max_staleness,
        compression=o.compression,
    )


def emulation_note(cfg: RunConfig) -> str | None:
    """The line every report carries when pool speeds are emulated by throttling."""
    parts = [f"{p.name} x{p.emulated_slowdown:g}" + (f" ±{p.emulated_jitter:.0%}" if p.emulated_jitter else "")
             for p in cfg.pools if p.emulated]
    return f"EMULATION: pool speeds emulated by throttling on one machine ({', '.join(parts)})" if parts else None


def ensure_ray(cfg: RunConfig, address: str | None) -> bool:
    """Connect to `address` or start a local Ray; returns True when this call started it."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV})
        return True
    # Logical CPUs may exceed physical cores: islands are throttled or small; Ray only counts.
    needed = math.ceil(sum(p.cpus_per_island * p.islands for p in cfg.pools))
    ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False,
             runtime_env={"env_vars": WORKER_ENV}, logging_level=logging.WARNING)
    return True


class Run:
    """One training run, from placement to summary. `train()` is the usual entry point."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, progress: Callable[[Progress], None] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.run_id = f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self.events = EventLog(self.run_dir)
        self.slots: list[_Slot] = []
        self.outer = None
        self.eval_points: list[dict] = []

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        cfg = self.cfg
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        self.corpus = load_corpus(cfg)
        self.model_cfg = model_config(cfg.model.preset, **cfg.model.overrides())
        model = build_model(self.model_cfg, seed=cfg.run.seed)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in initial.items()], cfg.outer.num_fragments)
        self.unigram_bpb = unigram_bits_per_byte(self.corpus.train, self.corpus.heldout, vocab_size=self.corpus.vocab_size)
        self.evaluator = Evaluator(self.model_cfg, self.corpus.heldout, batches=cfg.eval.batches, batch_size=cfg.eval.batch_size)
        log.info("corpus: %s; model %s (%d params); %d fragments; unigram %.3f bits/byte", self.corpus.source,
                 cfg.model.preset, sum(t.numel() for t in initial.values()), self.plan.num_fragments, self.unigram_bpb)
        self.outer = OuterOptimizerActor.options(
            name=f"outer-{self.run_id}", namespace=NAMESPACE, num_cpus=0,
        ).remote(initial, self.plan, outer_settings(cfg), model.embedding_parameter_names())
        self.data_ref = ray.put(self.corpus.train)
        island = 0
        for pool in cfg.pools:
            for _ in range(pool.islands):
                self.slots.append(_Slot(island, pool, 1))
                island += 1
        for slot in self.slots:
            self._start_island(slot)
        for slot in self.slots:
            self._await_island(slot)

    def _spec(self, slot: _Slot) -> IslandSpec:
        cfg, pool = self.cfg, slot.pool
        inner = InnerSettings(
            lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay, beta1=cfg.inner.beta1, beta2=cfg.inner.beta2,
            warmup_steps=cfg.inner.warmup_steps, grad_clip=cfg.inner.grad_clip, torch_threads=cfg.inner.torch_threads,
            batch_size=cfg.data.batch_size, emulated_slowdown=pool.emulated_slowdown, emulated_jitter=pool.emulated_jitter,
        )
        return IslandSpec(
            island=slot.island, incarnation=slot.incarnation, pool=pool.name, num_islands=len(self.slots),
            model_config=self.model_cfg, plan=self.plan, inner=inner, sync_every_steps=cfg.outer.sync_every_steps,
            adoption=cfg.outer.adoption, compression=cfg.outer.compression,
            compression_block_size=cfg.outer.compression_block_size, wait_for_round=cfg.outer.wait_for_round,
            seed=cfg.run.seed,
        )

    def _start_island(self, slot: _Slot, cursor: int = 0) -> None:
        name = f"{self.run_id}-island{slot.island}-inc{slot.incarnation}"
        slot.group = create_island_group(slot.pool, name=name, timeout_s=self.cfg.run.placement_timeout_s)
        initial = ray.get(self.outer.latest.remote(), timeout=self.cfg.run.call_timeout_s)
        slot.handle = IslandActor.options(
            name=name, namespace=NAMESPACE, num_cpus=slot.pool.cpus_per_island, resources=dict(slot.pool.resources),
            scheduling_strategy=island_scheduling(slot.group),
        ).remote(self._spec(slot), [self.data_ref], initial, cursor)

    def _await_island(self, slot: _Slot) -> None:
        try:
            slot.node = ray.get(slot.handle.node_id.remote(), timeout=self.cfg.run.placement_timeout_s)
        except (RayActorError, RayTaskError) as err:
            cause = str(err).strip().splitlines()[-1]
            raise RuntimeError(f"island {slot.island} (pool {slot.pool.name}) failed to start: {cause}") from None
        ray.get(self.outer.register.remote(slot.island, slot.incarnation, slot.handle), timeout=self.cfg.run.call_timeout_s)

    # ------------------------------------------------------------------ loop

    def _poll_islands(self) -> None:
        refs = {s.island: s.handle.status.remote() for s in self.slots if s.handle is not None}
        for slot in self.slots:
            if slot.island not in refs:
                continue
            try:
                slot.status = ray.get(refs[slot.island], timeout=self.cfg.run.call_timeout_s)
            except (RayActorError, GetTimeoutError) as err:
                log.warning("island %d unreachable: %s", slot.island, str(err).splitlines()[0])
                slot.handle = None  # the outer optimizer has unregistered it through its poller

    def _tokens(self) -> int:
        return sum(s.status.tokens for s in self.slots if s.status is not None)

    def _evaluate(self, t0: float) -> dict:
        params = ray.get(self.outer.global_parameters.remote(), timeout=self.cfg.run.call_timeout_s)
        loss, bpb = self.evaluator.evaluate(params)
        status = ray.get(self.outer.status.remote(), timeout=self.cfg.run.call_timeout_s)
        merged = sum(status["ledger"]["merged"]) / len(status["ledger"]["merged"])
        point = {"wall_s": time.monotonic() - t0, "tokens_processed": self._tokens(), "tokens_merged": merged,
                 "versions": list(status["versions"]), "eval_loss": loss, "eval_bits_per_byte": bpb}
        self.eval_points.append(point)
        self.events.add("evals", [point])
        log.info("eval at %.0fs: loss %.4f, %.3f bits/byte (%d tokens processed)", point["wall_s"], loss, bpb, point["tokens_processed"])
        return point

    def _drain_events(self) -> None:
        got = ray.get(self.outer.drain_events.remote(), timeout=self.cfg.run.call_timeout_s)
        self.events.add("rounds", got["rounds"])
        self.events.add("refusals", got["refusals"])

    def _report(self, t0: float, versions: list[int], rounds: int) -> None:
        if self.progress is None:
            return
        losses = [s.status.train_loss for s in self.slots if s.status is not None and s.status.train_loss is not None]
        self.progress(Progress(
            tokens=self._tokens(), budget=self.cfg.run.token_budget, versions=versions, rounds=rounds,
            train_loss=sum(losses) / len(losses) if losses else None,
            eval_bpb=self.eval_points[-1]["eval_bits_per_byte"] if self.eval_points else None,
            elapsed_s=time.monotonic() - t0,
            islands={f"{s.pool.name}/{s.island}": (s.status.state if s.status else "starting") for s in self.slots},
        ))

    def train(self) -> dict:
        """Run to the token budget (or max_wall_s) and return the summary (also written to summary.json)."""
        self._setup()
        t0 = time.monotonic()
        self._evaluate(t0)  # the starting point, so every run shows how far the loss fell
        next_eval = t0 + self.cfg.eval.interval_s
        next_flush = t0 + 5.0
        try:
            while True:
                self._poll_islands()
                status = ray.get(self.outer.status.remote(), timeout=self.cfg.run.call_timeout_s)
                self._report(t0, status["versions"], status["rounds"])
                now = time.monotonic()
                if self._tokens() >= self.cfg.run.token_budget:
                    break
                if self.cfg.run.max_wall_s is not None and now - t0 >= self.cfg.run.max_wall_s:
                    log.warning("stopping on max_wall_s=%s before the token budget", self.cfg.run.max_wall_s)
                    break
                if all(s.handle is None for s in self.slots):
                    raise RuntimeError("every island has died; see driver.log and the islands' logs")
                if now >= next_eval:
                    self._evaluate(t0)
                    next_eval = now + self.cfg.eval.interval_s
                if now >= next_flush:
                    self._drain_events()
                    self.events.flush()
                    next_flush = now + 5.0
                time.sleep(0.5)
            return self._finish(t0)
        finally:
            self._teardown()

    def _finish(self, t0: float) -> dict:
        finals = ray.get([s.handle.stop.remote() for s in self.slots if s.handle is not None], timeout=self.cfg.run.call_timeout_s)
        wall = time.monotonic() - t0
        for st in finals:
            self.slots[st.island].status = st
        ledger = ray.get(self.outer.stop.remote(), timeout=self.cfg.run.call_timeout_s + 30)
        status = ray.get(self.outer.status.remote(), timeout=self.cfg.run.call_timeout_s)
        self._drain_events()
        final_eval = self._evaluate(t0)
        self._report(t0, status["versions"], status["rounds"])
        self.events.add("islands", [{**asdict(s.status), "node": s.node} for s in self.slots if s.status is not None])
        self.events.flush()
        summary = self._summary(ledger, status, final_eval, wall)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _summary(self, ledger: dict, status: dict, final_eval: dict, wall: float) -> dict:
        P = self.plan.num_fragments
        processed = self._tokens()
        in_flight = [ledger["pending"][p] + ledger["late"][p]
                     + sum(s.status.outbox_tokens[p] + s.status.unsubmitted_tokens[p] for s in self.slots if s.status)
                     for p in range(P)]
        mean = lambda xs: sum(xs) / P  # noqa: E731 - tokens count once per fragment; report the fragment mean
        return {
            "mode": self.cfg.mode,
            "emulation": emulation_note(self.cfg),
            "eval_loss": final_eval["eval_loss"],
            "eval_bits_per_byte": final_eval["eval_bits_per_byte"],
            "unigram_bits_per_byte": self.unigram_bpb,
            "tokens_processed": processed,
            "tokens_merged": mean(ledger["merged"]),
            "tokens_refused": mean(ledger["refused"]),
            "tokens_in_flight": mean(in_flight),
            "token_ledger": {"processed": processed, "merged": ledger["merged"], "refused": ledger["refused"],
                             "in_flight": in_flight},
            "rounds": status["rounds"],
            "refusals": status["refusals"],
            "versions": status["versions"],
            "bytes_up": status["bytes_up"],
            "bytes_down": status["bytes_down"],
            "bytes_sent": status["bytes_up"] + status["bytes_down"],
            "wall_s": wall,
            "corpus": self.corpus.source,
            "islands": [{"island": s.island, "pool": s.pool.name, "node": s.node, "incarnation": s.incarnation,
                         "steps": s.status.steps if s.status else 0, "tokens": s.status.tokens if s.status else 0,
                         "state": s.status.state if s.status else "unknown"} for s in self.slots],
            "evals": self.eval_points,
        }

    def _teardown(self) -> None:
        for slot in self.slots:
            if slot.handle is not None:
                ray.kill(slot.handle, no_restart=True)
            if slot.group is not None:
                release_group(slot.group)
        if self.outer is not None:
            ray.kill(self.outer, no_restart=True)


def train(cfg: RunConfig, run_dir: str | Path, *, address: str | None = None,
          progress: Callable[[Progress], None] | None = None) -> dict:
    """Run one training job: start or join Ray, train to the token budget, write RUN_DIR, return the summary."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(handler)
    started = ensure_ray(cfg, address)
    ignore_zero_copy_warnings()
    try:
        return Run(cfg, run_dir, progress=progress).train()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        if started:
            ray.shutdown()
