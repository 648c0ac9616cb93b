"""A user's own non-language model and dataset through the public API, on two pools of a real local Ray cluster.

The model is a small CNN with BatchNorm and its own loss (tests/api/zoo.py); the data a map-style torch
Dataset whose examples carry ids. The run kills an island twice, and the ids prove that each new
incarnation resumes at the first example after its slot's last merged, salvaged or refused submission:
no example reaches the global model twice, none is skipped. Then the run resumes from its checkpoint
through the API, learns on, and its BatchNorm statistics are the merged ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from islands.stream import StreamSampler
from orchestrator import DilocoTrainer
from orchestrator.config import build_config
from orchestrator.core.eventlog import read_events
from orchestrator.run.streams import examples_stream
from policies.chaos import Fault, FaultTape
from tests.api import zoo

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]

BATCH = 16


def two_pools(**extra) -> dict:
    return {
        "run": {"token_budget": 12_000, "seed": 5, "call_timeout_s": 20},
        "data": {"batch_size": BATCH},
        "outer": {"sync_every_steps": 8, "num_fragments": 2, "lr": 0.5},
        "inner": {"lr": 1e-2, "warmup_steps": 2},
        "eval": {"interval_s": 2.0, "batches": 4, "batch_size": 32},
        "checkpoint": {"every_s": 2.0},
        "health": {"warm_spares": 0},
        "pools": [{"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "region": "us-east"},
                  {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "region": "eu-west"}],
        **extra,
    }


def _replay(cfg: dict, data, island: int, batches: int) -> list[list[int]]:
    """Island `island`'s first `batches` batches, as example ids, from the data plan the run makes of `data`."""
    stream = examples_stream(build_config(cfg), data, "")
    sampler = StreamSampler(stream, island=island, seq_len=1, batch_size=BATCH, seed=5)
    return [sampler.next_batch()["id"].tolist() for _ in range(batches)]


def test_a_cnn_resumes_exactly_across_kills_then_the_run_resumes_through_the_api(ray_cluster, tmp_path):
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    tape = FaultTape([Fault(island=0, kind="kill_island", at_s=2.5), Fault(island=0, kind="kill_island", at_s=7.0)])
    tape.to_yaml(tmp_path / "tape.yaml")
    cfg = two_pools(chaos={"mode": "tape", "params": {"path": str(tmp_path / "tape.yaml")}})
    cfg["run"]["token_budget"] = 12_000
    for pool in cfg["pools"]:
        pool["emulated_slowdown"] = 4.0  # EMULATION: steps long enough for both kills to land mid-run
    cfg["health"].update({"salvage_every_steps": 5, "backoff_base_s": 0.2})
    data = zoo.Shapes(8192)
    datasets = {"train": data, "validation": zoo.Shapes(64, seed=9)}
    result = DilocoTrainer(zoo.small_cnn, datasets=datasets, loss_fn=zoo.IdLog(str(ids_dir)), run_config=build_config(cfg),
                           run_dir=tmp_path / "run").fit()
    run_dir = Path(result.path)
    assert result.metrics["restarts"] >= 2, "both kills happened and were healed"

    # Every island process's training batches, from the ids the loss saw, as (island, start cursor, steps).
    streams = {i: _replay(cfg, data, i, 600) for i in range(2)}
    where: dict[tuple, tuple[int, int]] = {}
    for i, batches in streams.items():
        for k, ids in enumerate(batches):
            where.setdefault(tuple(ids), (i, k))
    runs = []
    for log in sorted(ids_dir.glob("ids-*.log")):
        if log.name == f"ids-{os.getpid()}.log":
            continue  # the driver's check of the loss on a held-out batch, before Ray (not training)
        batches = [[int(t) for t in line.split()] for line in log.read_text().splitlines()]
        shard, start = where[tuple(batches[0])]
        # Consecutive: step k of the process trained exactly batch start+k of its island's stream.
        assert batches == streams[shard][start:start + len(batches)], log.name
        runs.append((shard, start, len(batches)))

    # What reached the global model (merged, salvaged) or was taken and refused, per slot and incarnation.
    taken: dict[tuple[int, int], int] = {}
    merged_ranges: dict[tuple[int, int], list[int]] = {}
    for r in read_events(run_dir, "rounds").to_pylist():
        for island, inc, cursor in zip(r["participants"], r["incarnations"], r["cursors"]):
            taken[island, inc] = max(taken.get((island, inc), 0), cursor)
            merged_ranges.setdefault((island, r["fragment"]), []).append(cursor)
    for f in read_events(run_dir, "refusals").to_pylist():
        taken[f["island"], f["incarnation"]] = max(taken.get((f["island"], f["incarnation"]), 0), f["cursor"])
    starts = sorted(start for shard, start, _ in runs if shard == 0)
    assert len(starts) >= 3, runs  # incarnations 1, 2, 3 of slot 0 each trained
    for inc, start in enumerate(starts[1:], start=2):
        before = max(v for (island, i), v in taken.items() if island == 0 and i < inc)
        assert start == before, f"incarnation {inc} of island 0 started at batch {start}, its predecessors' last " \
                                f"merged/salvaged/refused submission ended at {before}"
    # No batch reaches the global model twice: per slot and fragment the merged cut cursors strictly increase.
    for key, cursors in merged_ranges.items():
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors), key
    json.dumps(runs)  # (kept readable in a failure's locals)

    # The same model, loss and dataset continue the run from its checkpoint (no more faults) to a larger budget.
    cfg.update(chaos={"mode": "none"})
    cfg["run"]["token_budget"] = 15_000
    again = DilocoTrainer(zoo.small_cnn, datasets=datasets, loss_fn=zoo.IdLog(str(ids_dir)), run_config=build_config(cfg),
                          run_dir=tmp_path / "run", resume=True).fit()
    assert again.metrics["resumed"] and again.checkpoint != result.checkpoint
    evals = [e["eval_loss"] for e in result.metrics["evals"] + again.metrics["evals"]]
    assert evals[-1] < evals[0] - 0.3, evals
    # The resumed session starts where the first ended (its first evaluation is of the restored model).
    assert abs(again.metrics["evals"][0]["eval_loss"] - result.metrics["eval_loss"]) < 0.05
    model = again.load_model()
    # BatchNorm statistics were trained and merged (the islands' mean), not left at their init of 0 and 1.
    assert float(model.bn.running_mean.abs().max()) > 1e-3 and float((model.bn.running_var - 1).abs().max()) > 1e-3
    held = zoo.Shapes(256, seed=9)
    images = torch.stack([held[i]["image"] for i in range(256)])
    labels = torch.stack([held[i]["label"] for i in range(256)])
    accuracy = float((model(images).argmax(-1) == labels).float().mean())
    assert accuracy > 0.5, accuracy  # chance is 0.25
