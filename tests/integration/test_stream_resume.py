"""Exactly once, streamed: islands reading their own units resume at the first window after their last merged,
salvaged or refused submission, across kills, restarts and a resume of the whole run (docs/data.md).

The corpus is a token file whose every token is unique (ids 0..N-1), so a window's first token is its id. A
loss that logs those ids per training step is the ground truth; the islands' streams are replayed here from
the same data plan, which the driver built from metadata alone. Every island process must have trained a
contiguous run of its island's stream, starting exactly where what its slot handed over before ended; no
window reaches the global model twice, none is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from islands.stream import StreamSampler
from orchestrator import DilocoTrainer
from orchestrator.config import build_config
from orchestrator.core.eventlog import read_events
from orchestrator.run.streams import corpus_stream
from policies.chaos import Fault, FaultTape
from tests.engine.test_token_ledger import FATES, assert_shown_everywhere

# Extended: two runs, two cold restarts and a resume, 80-110 s of CI's serial Ray tests on a slow day. The default run
# keeps the parts: a stream's cursor replays exactly (tests/islands/test_stream.py), a resume's ledger
# (tests/engine/test_token_ledger.py), kills, salvage and resumes on the cluster (test_self_healing.py,
# test_recovery.py, test_interrupt.py); only this test checks every window of every incarnation end to end.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]

VOCAB = 1 << 14  # every token of the corpus is its own position: unique window ids
SEQ, BATCH, SEED = 8, 4, 3


def unique_ids_model() -> nn.Module:
    """A bigram model over the corpus's 16,384 ids: small (4 dimensions), so a step costs next to nothing."""
    return nn.Sequential(nn.Embedding(VOCAB, 4), nn.Linear(4, VOCAB))


class WindowLog:
    """Cross-entropy that also writes each training batch's window ids (their first tokens), one line per step,
    to DIR/ids-<pid>.log: every island process (every incarnation) writes its own file, in step order."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if model.training:
            with open(os.path.join(self.directory, f"ids-{os.getpid()}.log"), "a") as f:
                f.write(" ".join(str(int(t)) for t in x[:, 0]) + "\n")
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def config(corpus: Path, tape: Path | None, budget: int) -> dict:
    return {
        "run": {"token_budget": budget, "seed": SEED, "call_timeout_s": 20},
        "model": {"seq_len": SEQ},
        "data": {"source": "tokens", "path": str(corpus), "token_dtype": "uint16", "vocab_size": VOCAB,
                 "unit_tokens": 1024, "batch_size": BATCH, "block_batches": 4},
        "outer": {"sync_every_steps": 8, "num_fragments": 2},
        "eval": {"interval_s": 5.0, "batches": 2, "batch_size": 8},
        "checkpoint": {"every_s": 1.0},
        "health": {"warm_spares": 0, "salvage_every_steps": 3, "backoff_base_s": 0.2},
        "chaos": {"mode": "tape", "params": {"path": str(tape)}} if tape else {"mode": "none"},
        "pools": [  # EMULATION: throttled steps, island 1 the slower, so island 0's third incarnation trains too
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 20.0},
            {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "emulated_slowdown": 60.0},
        ],
    }


def replay(cfg, island: int, batches: int) -> list[list[int]]:
    """Island `island`'s first `batches` batches, as window ids, from the plan the run made (metadata only)."""
    sampler = StreamSampler(corpus_stream(cfg).stream, island=island, seq_len=SEQ, batch_size=BATCH, seed=SEED)
    return [sampler.next_batch()[0][:, 0].tolist() for _ in range(batches)]


def test_streamed_islands_resume_exactly_across_kills_and_a_resumed_run(ray_cluster, tmp_path):
    corpus = tmp_path / "corpus.bin"
    np.arange(VOCAB, dtype="<u2").tofile(corpus)
    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    tape = tmp_path / "tape.yaml"
    # Incarnations 1 and 2 of island 0 are each killed at their 12th step: a submission cut, some progress shelved.
    FaultTape([Fault(island=0, kind="kill_island", at_step=12, incarnation=1),
               Fault(island=0, kind="kill_island", at_step=12, incarnation=2)]).to_yaml(tape)
    cfg = build_config(config(corpus, tape, budget=3_200))
    run_dir = tmp_path / "run"
    first = DilocoTrainer(unique_ids_model, loss_fn=WindowLog(str(ids_dir)), run_config=cfg, run_dir=run_dir).fit()
    assert first.metrics["restarts"] >= 2, "both kills happened and were healed"
    assert_shown_everywhere(first.metrics)  # two kills: their tokens counted once, in every fragment
    logs_first = set(ids_dir.glob("ids-*.log"))
    rounds = read_events(run_dir, "rounds").to_pylist()  # the first session's: the resume's start is checked against them
    refusals = read_events(run_dir, "refusals").to_pylist()
    again = DilocoTrainer(unique_ids_model, loss_fn=WindowLog(str(ids_dir)), run_dir=run_dir, resume=True,
                          run_config=build_config(config(corpus, None, budget=4_800))).fit()
    assert again.metrics["resumed"]
    # One ledger across the resume: the first session's tokens keep their fates as of its final checkpoint (the
    # one resumed from), and what was in flight when it stopped is lost; the whole run adds up.
    assert_shown_everywhere(again.metrics)
    before, ended = again.metrics["token_ledger_before"], first.metrics["token_ledger"]
    assert {k: before[k] for k in ("processed", "merged", "refused", "overwritten")} == {
        k: ended[k] for k in ("processed", "merged", "refused", "overwritten")}, (before, ended)
    assert before["lost"] == [ended["lost"][p] + ended["in_flight"][p] for p in range(2)] and not any(before["in_flight"])
    assert again.metrics["evals"][0]["tokens_processed"] == first.metrics["tokens_processed"]
    assert all(again.metrics["token_ledger"][f][p] >= before[f][p] for f in FATES for p in range(2))

    streams = {i: replay(cfg, i, 400) for i in range(2)}
    where: dict[tuple, tuple[int, int]] = {}
    for i, batches in streams.items():
        for k, b in enumerate(batches):
            where.setdefault(tuple(b), (i, k))  # a later epoch repeats windows: the first reading is the one
    runs: list[tuple[int, int, int, bool]] = []  # (island, first batch, steps, of the resumed session)
    for log in sorted(ids_dir.glob("ids-*.log")):
        batches = [[int(t) for t in line.split()] for line in log.read_text().splitlines()]
        if tuple(batches[0]) not in where:
            continue  # the driver's check of the loss before Ray starts (a held-out batch, not training)
        island, start = where[tuple(batches[0])]
        # Consecutive: step k of the process trained exactly batch start+k of its island's stream.
        assert batches == streams[island][start:start + len(batches)], log.name
        runs.append((island, start, len(batches), log not in logs_first))

    # Every window id is unique in the corpus: what the islands read in all never holds a window twice (the runs
    # stayed inside one epoch), and the two islands never share one.
    read = {i: max(start + steps for island, start, steps, _ in runs if island == i) for i in range(2)}
    ids = [t for i in range(2) for b in streams[i][:read[i]] for t in b]
    assert len(set(ids)) == len(ids), read

    # What reached the global model (merged, salvaged) or was taken and refused, per slot and incarnation.
    taken: dict[tuple[int, int], int] = {}
    merged: dict[tuple[int, int], list[int]] = {}
    for r in rounds:
        for island, inc, cursor in zip(r["participants"], r["incarnations"], r["cursors"]):
            taken[island, inc] = max(taken.get((island, inc), 0), cursor)
            merged.setdefault((island, r["fragment"]), []).append(cursor)
    for f in refusals:
        taken[f["island"], f["incarnation"]] = max(taken.get((f["island"], f["incarnation"]), 0), f["cursor"])
    first_session = sorted((start, island) for island, start, _, resumed in runs if not resumed)
    starts0 = [start for start, island in first_session if island == 0]
    assert len(starts0) >= 3, runs  # incarnations 1, 2 and 3 of slot 0 each trained
    for inc, start in enumerate(starts0[1:], start=2):
        before = max((v for (island, i), v in taken.items() if island == 0 and i < inc), default=0)
        assert start == before, f"incarnation {inc} of island 0 started at batch {start}; its predecessors' last " \
                                f"merged, salvaged or refused submission ended at {before}"
    # No window reaches the global model twice: per slot and fragment the merged cursors strictly increase.
    for key, cursors in merged.items():
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors), key
    # The resumed run's islands start where the first session's merged work of their slot ended (its checkpoint's
    # cursors: what was refused at the very end is read again, never merged twice).
    for island in range(2):
        resumed = [start for i, start, _, r in runs if r and i == island]
        ended = max(c for (i, _), cursors in merged.items() if i == island for c in cursors)
        assert resumed and min(resumed) == ended, (island, resumed, ended)
