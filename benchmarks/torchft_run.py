"""One run of torchft's DiLoCo on a RunConfig: its lighthouse, M replica groups, a fault tape, evaluations.

`train_torchft(cfg, run_dir)` is to torchft what `orchestrator.run.driver.train` is to the engine: the same
model recipe, data shards, inner AdamW (`benchmarks/torchft_replica.py`), token budget, held-out batches and
EMULATED network (the run's `network` section: the ring all-reduce time of the float32 pseudo-gradient among
the pools' regions, slept at torchft's all-reduce) and pool speeds (`emulated_slowdown`), with one replica
group per island slot of `cfg.pools`. It starts torchft's `LighthouseServer` in this process, each replica
group as its own Python process, and kills and restarts them (a fresh process, as a supervisor such as
torchelastic would) on the fault tape it is given. Writes RUN_DIR/summary.json with the engine's summary
fields where they apply; every output says EMULATED where something is.

Time zero is when every first replica group has built its model and manager (the engine also keeps
start-up out of `wall_s`). The run stops after round(budget / (M H B T)) committed torchft steps: the
budget at full participation, to the nearest whole sync (a replica group that is down processes nothing meanwhile, so a run under
faults processes fewer tokens; `tokens_processed` and `tokens_merged` say how many).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchft_replica import ReplicaSettings

from orchestrator.config import RunConfig
from orchestrator.core.evaluation import Evaluator
from orchestrator.run.driver import build_run_network, measure_step_s
from orchestrator.run.workload import prepare
from orchestrator.settings import inner_settings

log = logging.getLogger(__name__)

REPLICA = Path(__file__).with_name("torchft_replica.py")
_ROOT = Path(__file__).resolve().parents[1]


class TorchftRun:
    """The driver side of one torchft run: processes, tape, records, evaluations (see module doc)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, tape: list[tuple[float, int]], timeout_s: float = 60.0,
                 final_eval_batches: int = 0, progress: Any = None):
        from torchft._torchft import LighthouseServer

        self.cfg, self.run_dir, self.tape = cfg, run_dir, sorted(tape)
        self.final_eval_batches, self.progress = final_eval_batches, progress
        run_dir.mkdir(parents=True, exist_ok=False)
        prepared = prepare(cfg)
        self.recipe, self.data = prepared.recipe, prepared.data
        n_elems = sum(t.numel() for t in prepared.initial.values())
        self.model_bytes = 4 * n_elems
        self.network, regions = build_run_network(cfg, self.model_bytes,
                                                  lambda: measure_step_s(cfg, self.recipe, self.data.train))
        self.slots = [(pool.region, pool.emulated_slowdown) for pool in cfg.pools for _ in range(pool.islands)]
        m = len(self.slots)
        # n participants: the ring among the n slowest links (a conservative stand-in for whichever are live).
        slowest = sorted((r for r, _ in self.slots), key=lambda r: self.network.link(r).bandwidth_bps)
        self.allreduce_s = [self.network.allreduce_s(self.model_bytes, slowest[:n]) if self.network.emulated else 0.0
                            for n in range(1, m + 1)]
        self.tokens_per_step = cfg.data.batch_size * self.recipe.seq_len
        # Whole syncs only: the count nearest the budget (ceil overshot a 250k budget by 31%, one ~3-minute sync on the WAN).
        self.outer_steps = max(1, round(cfg.run.token_budget / (m * cfg.outer.sync_every_steps * self.tokens_per_step)))
        np.save(run_dir / "train.npy", np.asarray(self.data.train))
        # The torchft_lighthouse command's defaults, stated: the Python binding's own join timeout is 100 ms, which
        # on a loaded machine formed quorums without a replica group that was a few steps behind.
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=100,
                                           heartbeat_timeout_ms=5_000)
        inner = replace(inner_settings(cfg), emulated_slowdown=1.0, emulated_jitter=0.0)  # the replica paces itself
        self.settings = ReplicaSettings(
            run_dir=str(run_dir), lighthouse=self.lighthouse.address(), num_replicas=m, recipe=self.recipe, inner=inner,
            seed=cfg.run.seed, train_path=str(run_dir / "train.npy"), sync_every=cfg.outer.sync_every_steps,
            outer_lr=cfg.outer.lr, outer_momentum=cfg.outer.momentum, outer_steps=self.outer_steps,
            token_budget=cfg.run.token_budget, allreduce_s=self.allreduce_s, slowdown=[s for _, s in self.slots],
            timeout_s=timeout_s, quorum_timeout_s=600.0)
        (run_dir / "settings.pkl").write_bytes(pickle.dumps(self.settings))
        self.evaluator = Evaluator(self.recipe, self.data.heldout, batches=cfg.eval.batches,
                                   batch_size=cfg.eval.batch_size, threads=cfg.inner.torch_threads)
        self.procs: dict[int, subprocess.Popen] = {}
        self.incarnation = [0] * m
        self.logs: list[Any] = []
        self.faults: list[dict] = []
        self.records: dict[tuple[int, int], list[dict]] = {}
        self._offsets: dict[Path, int] = {}
        self.evals: list[dict] = []

    # ------------------------------------------------------------ processes

    def _start(self, slot: int) -> None:
        inc = self.incarnation[slot] = self.incarnation[slot] + 1
        logf = open(self.run_dir / f"replica-r{slot}-i{inc}.log", "w")
        self.logs.append(logf)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        self.procs[slot] = subprocess.Popen([sys.executable, str(REPLICA), str(self.run_dir / "settings.pkl"), str(slot), str(inc)],
                                            stdout=logf, stderr=subprocess.STDOUT, env=env)

    def _kill(self, slot: int) -> None:
        proc = self.procs.get(slot)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def _read_records(self) -> None:
        for path in sorted(self.run_dir.glob("records-r*-i*.jsonl")):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                text = f.read()
            lines = text.split("\n")
            complete, rest = lines[:-1], lines[-1]
            self._offsets[path] = self._offsets.get(path, 0) + len(text) - len(rest)
            for line in complete:
                if line.strip():
                    rec = json.loads(line)
                    self.records.setdefault((rec["slot"], rec["incarnation"]), []).append(rec)

    def tokens_processed(self) -> int:
        """Inner steps of every incarnation so far (a killed one's up to its kill), in tokens."""
        steps = 0
        for path in self.run_dir.glob("steps-r*-i*"):
            text = path.read_text().strip()
            steps += int(text) if text else 0
        return steps * self.tokens_per_step

    def tokens_merged(self) -> int:
        """Tokens of every committed torchft step: participants x H x B x T, counted once per step."""
        steps: dict[int, int] = {}
        for recs in self.records.values():
            for r in recs:
                if r.get("committed"):
                    steps[r["step"]] = max(steps.get(r["step"], 0), r["participants"])
        return sum(steps.values()) * self.cfg.outer.sync_every_steps * self.tokens_per_step

    def _newest_params(self) -> tuple[int, Path | None]:
        """The newest committed step and its parameters from the largest quorum that committed it."""
        files = []
        for p in self.run_dir.glob("params-s*-n*-r*.pt"):
            step, n, _ = (int(x[1:]) for x in p.stem.split("-")[1:])
            files.append((step, n, p))
        if not files:
            return 0, None
        step, _, path = max(files)
        return step, path

    def _evaluate(self, step: int, path: Path | None, t0: float, initial: dict | None = None) -> None:
        params = initial if path is None else torch.load(path)
        loss, bpb = self.evaluator.evaluate(params)
        at = t0 if path is None else path.stat().st_mtime  # when the committed parameters existed
        point = {"wall_s": at - t0, "at": at, "tokens_processed": self.tokens_processed(),
                 "tokens_merged": float(self.tokens_merged()), "versions": [step], "eval_loss": loss, "eval_bits_per_byte": bpb}
        self.evals.append(point)
        if self.progress is not None:
            self.progress(point)

    # ------------------------------------------------------------ the run

    def run(self) -> dict:
        cfg, m = self.cfg, len(self.slots)
        s0 = time.monotonic()
        for slot in range(m):
            self._start(slot)
        while len(list(self.run_dir.glob("ready-r*-i1"))) < m:  # every first incarnation built and heartbeating
            dead = [s for s, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"torchft replica group {dead[0]} exited during start-up; see {self.run_dir}/replica-r{dead[0]}-i1.log")
            time.sleep(0.1)
        startup_s = time.monotonic() - s0
        initial = {n: p.detach().clone() for n, p in self.evaluator.model.state_dict().items()}
        t0 = time.time()
        (self.run_dir / "go").touch()
        self._evaluate(0, None, t0, initial)
        tape, last_eval, evaluated, stopped_by = list(self.tape), time.monotonic(), 0, "token_budget"
        while True:
            time.sleep(0.1)
            now = time.time() - t0
            while tape and tape[0][0] <= now:
                at_s, slot = tape.pop(0)
                self._kill(slot)
                self.faults.append({"at_s": at_s, "fired_s": time.time() - t0, "island": slot, "kind": "kill_island",
                                    "incarnation": self.incarnation[slot]})
                self._start(slot)
                log.info("torchft: killed replica group %d at %.1f s and started incarnation %d", slot, now, self.incarnation[slot])
            self._read_records()
            step, path = self._newest_params()
            done = step >= self.outer_steps
            if step > evaluated and (done or time.monotonic() - last_eval >= cfg.eval.interval_s):
                self._evaluate(step, path, t0)
                evaluated, last_eval = step, time.monotonic()
            if done:
                break
            if cfg.run.max_wall_s is not None and now >= cfg.run.max_wall_s:
                stopped_by = "max_wall_s"
                break
            crashed = [s for s, p in self.procs.items() if p.poll() not in (None, 0)]
            if crashed and not tape:
                raise RuntimeError(f"torchft replica group {crashed[0]} crashed; see {self.run_dir}/replica-r{crashed[0]}-i{self.incarnation[crashed[0]]}.log")
        wall_s = time.time() - t0
        deadline = time.monotonic() + 60.0
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for slot in self.procs:
            self._kill(slot)
        self._read_records()
        step, path = self._newest_params()
        if step > evaluated:
            self._evaluate(step, path, t0)
        return self._summary(step, path, wall_s, startup_s, stopped_by)

    def close(self) -> None:
        for slot in self.procs:
            self._kill(slot)
        for f in self.logs:
            f.close()
        self.lighthouse.shutdown()

    def _summary(self, step: int, path: Path | None, wall_s: float, startup_s: float, stopped_by: str) -> dict:
        cfg, m = self.cfg, len(self.slots)
        final = self.evals[-1]
        wide: dict[str, Any] = {}
        if self.final_eval_batches and path is not None:
            scorer = Evaluator(self.recipe, self.data.heldout, batches=self.final_eval_batches,
                               batch_size=cfg.eval.batch_size, threads=cfg.inner.torch_threads)
            wide = {"final_loss_wide": scorer.evaluate(torch.load(path))[0],
                    "final_eval_tokens": len(scorer.batches) * cfg.eval.batch_size * self.recipe.seq_len}
        commits = {}
        for recs in self.records.values():
            for r in recs:
                if r.get("committed"):
                    commits[r["step"]] = max(commits.get(r["step"], 0), r["participants"])
        per_replica = self.network.allreduce_bytes(self.model_bytes, m)
        emulated = [f"{i}: x{s:g}" for i, (_, s) in enumerate(self.slots) if s > 1.0]
        return {
            "mode": "torchft-diloco", "torchft": _torchft_version(), "eval_loss": final["eval_loss"],
            "eval_bits_per_byte": final["eval_bits_per_byte"], "evals": self.evals, **wide,
            "tokens_processed": self.tokens_processed(), "tokens_merged": self.tokens_merged(),
            "tokens_lost": self.tokens_processed() - self.tokens_merged(),
            "token_budget": cfg.run.token_budget, "outer_steps_target": self.outer_steps, "outer_steps": step,
            "syncs": sum(1 for recs in self.records.values() for r in recs if "committed" in r), "commits": len(commits),
            "participants_per_commit": [commits[k] for k in sorted(commits)],
            "bytes_sent": sum(n * self.network.allreduce_bytes(self.model_bytes, n) for n in commits.values()),
            "bytes_per_replica_per_sync": per_replica, "network": self.network.describe(),
            "network_emulated": self.network.emulated, "allreduce_emulated_s": self.allreduce_s[-1],
            "emulation": f"EMULATION: pool speeds emulated by throttling on one machine (replica group {', '.join(emulated)})"
            if emulated else None,
            "faults": self.faults, "faults_injected": len(self.faults), "restarts": len(self.faults),
            "wall_s": wall_s, "startup_s": startup_s, "stopped_by": stopped_by, "goodput": None,
        }


def _torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


def train_torchft(cfg: RunConfig, run_dir: str | Path, *, tape: list[tuple[float, int]] | None = None,
                  final_eval_batches: int = 0, progress: Any = None) -> dict:
    """Run torchft's DiLoCo on `cfg` in `run_dir` (new); kill and restart replica group `slot` at each
    (seconds, slot) of `tape`; write and return summary.json."""
    run = TorchftRun(cfg, Path(run_dir), tape=tape or [], final_eval_batches=final_eval_batches, progress=progress)
    try:
        summary = run.run()
    finally:
        run.close()
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
