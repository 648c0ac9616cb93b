"""FSDP islands (islands/fsdp.py) without Ray: two real processes over gloo against one process.

An FSDP island of two workers and a one-worker island run the same script (`script`) from the same
global parameters: cuts every 2 steps, taken at once but one left waiting (the FSDP leader postpones
the next cut; the one-worker island does not), a new version of fragment 0 that merges the first cut
(rebase, so the cut's snapshot is the anchor), a version sent as a downlink difference, a resync to
a restarted outer optimizer's versions, and a stop with the final flush. Worker r of the FSDP island
trains on batch `2c + r` of the shard at island step c; the one-worker island trains on batches `2c`
and `2c + 1` concatenated, which is the same gradient (the mean loss over both). Parameters, every
outer gradient (where the postponed cut shifts them, their sums) and the bookkeeping must agree, and
each worker must hold half of each parameter. Both build their model, loss and optimizer from import
paths, as a user's factories come (islands/model_api.py).

Tolerance. The two differ only in float32 rounding: FSDP reduce-scatters two per-worker gradients of
B-sequence means, the one-worker island backpropagates one 2B-sequence mean, so gradients agree to a
few ulps of the terms summed. AdamW's update lr * m / (sqrt(v) + eps) is scale-free: it passes an
element's relative gradient error on to its update, and that error is largest where the gradient
is smallest, so a few elements differ by more than float32 rounding of the parameters would suggest.
Measured on 2026-11-27 the largest difference was 6e-6 after 3 steps, 1.1e-5 after 6 and 2.6e-5
after 11, growing with the steps (the resync resets it: 4e-6 after 14); outer gradients differ by
less. The tolerance ATOL = 1e-4 is 4x that and 1% of one step's size (lr = 1e-2): an error in the
sharding (a wrong batch, a missing average, a part in the wrong place, a wrong anchor) moves
parameters by whole steps. So that the check could fail, a one-worker island trained on the first
batch of each pair only must end at least 100 x ATOL away (it ends 0.17 away).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from islands.builtin import ByteTransformerFactory
from islands.fsdp import Layout, shard_units
from islands.messages import FragmentUpdate, SubmissionKey
from islands.model import build_model, model_config
from policies.downlink import decode_fragment
from policies.fragments import plan_fragments
from tests.from_config import inner_from_config, spec_from_config

SEED, ISLAND, ISLANDS, B = 7, 1, 3, 4
ATOL = 1e-4
CFG = model_config("nano")
INNER = inner_from_config(lr=1e-2, weight_decay=0.01, warmup_steps=0, grad_clip=1.0, batch_size=B)


def make_data() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.choice(256, size=30_000, p=np.r_[np.full(16, 0.05), np.full(240, 0.2 / 240)]).astype(np.uint8)


def initial() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in build_model(CFG, seed=SEED).named_parameters()}


def plan():
    return plan_fragments([(n, t.numel() * 4) for n, t in initial().items()], 2)


NANO = ByteTransformerFactory(CFG)
"""The model factory, named by import path below as a config's model.factory names one."""


def adamw(parameters) -> torch.optim.Optimizer:
    """The inner optimizer as a user's factory (model.optimizer): AdamW with the test's settings."""
    return torch.optim.AdamW(parameters, lr=INNER.lr, betas=(INNER.beta1, INNER.beta2), weight_decay=INNER.weight_decay)


def spec(**overrides: Any):
    s = spec_from_config(model_config=CFG, plan=plan(), island=ISLAND, incarnation=1, num_islands=ISLANDS,
                         inner=INNER, sync_every_steps=4, seed=SEED, adoption="rebase", **overrides)
    # Factory, loss and optimizer as a user names them (islands/model_api.py): each by import path.
    return replace(s, model=replace(s.model, model="tests.islands.test_fsdp:NANO", loss="islands.model_api:default_loss",
                                    optimizer="tests.islands.test_fsdp:adamw"))


def updates(version: int, tensors: dict[str, torch.Tensor], merged=()) -> list[FragmentUpdate]:
    return [FragmentUpdate(p, version, [[tensors[n] for n in frag]], merged=merged) for p, frag in enumerate(plan().fragments)]


def new_version() -> FragmentUpdate:
    """Version 1 of fragment 0, merging the island's first cut: an arbitrary change every island adopts alike."""
    init = initial()
    frag = plan().fragments[0]
    return FragmentUpdate(0, 1, [[init[n] * 0.9 + 0.01 for n in frag]], merged=(SubmissionKey(ISLAND, 1, 0),))


def delta_version() -> FragmentUpdate:
    """Version 2 of fragment 0 as a downlink difference from version 1 (outer.downlink_delta), merging nothing."""
    init = initial()
    return FragmentUpdate(0, 2, [[init[n] * 0.05 for n in plan().fragments[0]]], delta_from=1)


def resync_versions() -> list[FragmentUpdate]:
    """What a restarted outer optimizer's latest() would give: version 5 of every fragment."""
    return updates(5, {n: t * 1.1 for n, t in initial().items()})


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    # Plain arrays through the queue: tensors would travel as shared memory that dies with the child.
    return {n: t.detach().cpu().numpy().copy() for n, t in tensors.items()}


def _submissions(island) -> list[tuple[int, int, int, list[np.ndarray]]]:
    subs = []
    while (sub := island.next_submission(0.0)) is not None:
        subs.append((sub.fragment, sub.tokens, sub.inner_steps, [t.numpy().copy() for t in decode_fragment(sub.payload)]))
    return subs


def script(island, report) -> None:
    """What every island (and the FSDP island's leader) does; `report(key, value)` sends results home.

    Cuts come every 2 steps (H = 4, P = 2), fragment 0 first, and are taken at once as the outer
    optimizer would, except the one after step 8: it waits until step 10, where the next cut falls
    due. The one-worker island cuts anyway; the FSDP leader postpones it to step 11, and its later
    cuts come one step after the other's. Version 1 of fragment 0 (merging the first cut) arrives after
    step 4, version 2 as a downlink difference after step 7, and a resync to version 5 of both
    fragments after step 12; the stop after step 14 flushes.
    """
    subs: list = []

    def step(take: bool = True) -> None:
        island.step()
        if take:
            subs.extend(_submissions(island))

    for _ in range(3):
        step()
    report("params3", _numpy(island.parameters()))
    step()
    island.adopt(new_version())
    for _ in range(2):  # the first boundary adopts the new version
        step()
    report("params6", _numpy(island.parameters()))
    report("bookkeeping", (island.status().versions, sorted(k.seq for k in island.outbox.inflight)))
    step()
    island.adopt(delta_version())
    for _ in range(3):
        step(take=False)
    report("params10", _numpy(island.parameters()))
    subs.extend(_submissions(island))
    step()
    report("params11", _numpy(island.parameters()))
    step()
    island.resync(resync_versions())
    for _ in range(2):
        step()
    report("params14", _numpy(island.parameters()))
    report("bookkeeping14", (island.status().versions, sorted(k.seq for k in island.outbox.inflight)))
    report("subs", subs)
    report("flush", stop_and_take(island))


def stop_and_take(island) -> list:
    """stop(flush=True) while taking what it cuts, as the outer optimizer's poller does: an FSDP leader cuts
    the final flush one fragment at a time, each once the previous one has been taken."""
    stopping = threading.Thread(target=island.stop, kwargs={"flush": True})
    stopping.start()
    subs = []
    while stopping.is_alive():
        subs.extend(_submissions(island))
        time.sleep(0.01)
    return subs + _submissions(island)


def _worker(rank: int, ports, out) -> None:
    torch.set_num_threads(1)
    from islands.distributed import WorkerGroup
    from islands.sharded_island import ShardedIsland

    if rank == 0:
        group = WorkerGroup(rank=0, world_size=2, addr="127.0.0.1", timeout_s=120)
        ports.put(group.port)
    else:
        group = WorkerGroup(rank=1, world_size=2, addr="127.0.0.1", port=ports.get(timeout=120), timeout_s=120)
    s = spec(workers=2, shard="fsdp")
    island = ShardedIsland(s, make_data(), updates(0, initial()) if rank == 0 else [], group=group)
    island.build_shards()
    if rank == 0:
        script(island, lambda key, value: out.put((rank, key, value)))
        return
    # Rank 1 takes the same steps: the leader's messages pace it, and its stop ends it.
    for _ in range(3):
        island.step()
    out.put((rank, "params3", _numpy(island.parameters())))
    for _ in range(3):
        island.step()
    out.put((rank, "params6", _numpy(island.parameters())))
    out.put((rank, "bookkeeping", (island.status().versions, sorted(k.seq for k in island.outbox.inflight))))
    for _ in range(4):
        island.step()
    out.put((rank, "params10", _numpy(island.parameters())))
    island.step()
    out.put((rank, "params11", _numpy(island.parameters())))
    for _ in range(3):
        island.step()
    out.put((rank, "params14", _numpy(island.parameters())))
    out.put((rank, "bookkeeping14", (island.status().versions, sorted(k.seq for k in island.outbox.inflight))))
    boundaries = 0  # the final flush's, one per cut, then the stop
    while island.status().state != "stopped":
        assert island.step() is False, "no step after the leader began to stop"
        boundaries += 1
    out.put((rank, "stopped", boundaries))


def one_worker(pairs: bool) -> dict[str, Any]:
    """The one-worker island on batches 2c and 2c+1 together (`pairs`), or on batch 2c alone (the wrong split)."""
    from islands.island import LearnerIsland

    island = LearnerIsland(spec(workers=1, shard="none"), make_data(), updates(0, initial()))
    trainer, sampler = island.trainer, island.trainer.sampler

    def next_batch():
        c = sampler.cursor
        (x0, y0), (x1, y1) = sampler.batch_at(2 * c), sampler.batch_at(2 * c + 1)
        sampler.load_state_dict({**sampler.state_dict(), "cursor": c + 1})
        return (torch.cat([x0, x1]), torch.cat([y0, y1])) if pairs else (x0, y0)

    trainer.next_batch = next_batch
    got: dict[str, Any] = {}
    script(island, lambda key, value: got.__setitem__(key, value))
    return got


def _whole(parts0: dict[str, np.ndarray], parts1: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: np.concatenate([parts0[n], parts1[n]]) for n in parts0}


def _close(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Two cuts' outer gradients agree within ATOL, tensor by tensor."""
    return len(a) == len(b) and all(x.shape == y.shape and float(np.abs(x - y).max()) < ATOL for x, y in zip(a, b))


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[n] - b[n]).max()) for n in a)


@pytest.fixture(scope="module")
def fsdp_run() -> dict[tuple[int, str], Any]:
    ctx = mp.get_context("spawn")  # not fork: the test process may hold Ray's threads
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ports, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(9 + 8):
        rank, key, value = out.get(timeout=240)
        got[rank, key] = value
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def test_fsdp_island_of_two_matches_one_worker_on_both_batches(fsdp_run):
    ref = one_worker(pairs=True)
    init = {n: t.numpy() for n, t in initial().items()}

    # Each worker holds half of every parameter (FSDP's dim-0 shards), the two halves the whole.
    for n, t in init.items():
        assert fsdp_run[0, "params3"][n].shape[0] == fsdp_run[1, "params3"][n].shape[0] == t.shape[0] // 2, n

    params3 = _whole(fsdp_run[0, "params3"], fsdp_run[1, "params3"])
    assert _worst(params3, ref["params3"]) < ATOL
    assert min(float(np.abs(params3[n] - init[n]).max()) for n in init) > 10 * ATOL, "every parameter moved"

    # After the round (a new version of fragment 0 merging the first cut, rebased on its snapshot) and two steps.
    params6 = _whole(fsdp_run[0, "params6"], fsdp_run[1, "params6"])
    assert _worst(params6, ref["params6"]) < ATOL
    frag0 = plan().fragments[0]
    assert min(float(np.abs(params6[n] - params3[n]).max()) for n in frag0) > 0.005, "the adoption moved fragment 0"
    # Every worker's bookkeeping agrees with the leader's and with the one-worker island's: fragment 0 at
    # version 1, cuts 1 (fragment 1) and 2 (fragment 0, after step 6) in flight.
    assert fsdp_run[0, "bookkeeping"] == fsdp_run[1, "bookkeeping"] == ref["bookkeeping"] == ([1, 0], [1, 2])
    params = {k: _whole(fsdp_run[0, k], fsdp_run[1, k]) for k in ("params10", "params11", "params14")}
    for k, v in params.items():  # after a downlink difference (step 8), a postponed cut (11), a resync (13)
        assert _worst(v, ref[k]) < ATOL, k
    assert min(float(np.abs(params["params14"][n] - params["params11"][n]).max()) for n in init) > 0.01, "the resync"
    versions, inflight = fsdp_run[0, "bookkeeping14"]
    assert fsdp_run[1, "bookkeeping14"] == (versions, inflight) and versions == ref["bookkeeping14"][0] == [5, 5]
    assert inflight == [5] and ref["bookkeeping14"][1] == [6], "only the cut since the resync is in flight"

    # The cuts, as (fragment, tokens, steps): the same outer gradients, put together by the leader from
    # both workers' parts, until the postponed one.
    step = 2 * B * CFG.seq_len  # both workers' batches
    subs, ref_subs = fsdp_run[0, "subs"], ref["subs"]
    first = [(0, 2 * step, 2), (1, 4 * step, 4), (0, 4 * step, 4), (1, 4 * step, 4)]
    assert [s[:3] for s in ref_subs] == first + [(0, 4 * step, 4), (1, 4 * step, 4), (0, 2 * step, 2)]
    assert [s[:3] for s in subs] == first + [(0, 5 * step, 5), (1, step, 1)]
    for (_, _, _, mine), (_, _, _, theirs) in zip(subs[:4], ref_subs[:4]):
        assert _close(mine, theirs)
    # The postponed cut (steps 7-11) is the other's (7-10) and fragment 0's step 11, from the same anchor.
    frag0 = plan().fragments[0]
    step11 = [ref["params10"][n] - ref["params11"][n] for n in frag0]
    assert _close(subs[4][3], [a + b for a, b in zip(ref_subs[4][3], step11)])

    # Since the resync (steps 13-14) the FSDP island cut fragment 1 after step 13 and flushes fragment 0's
    # two steps and fragment 1's last one, one cut at a time; the other cut fragment 0 after step 14 and
    # flushes fragment 1's two steps.
    flush, ref_flush = fsdp_run[0, "flush"], ref["flush"]
    assert [s[:3] for s in ref_flush] == [(1, 2 * step, 2)]
    assert [s[:3] for s in flush] == [(0, 2 * step, 2), (1, step, 1)]
    assert _close(flush[0][3], ref_subs[6][3])
    assert _close([a + b for a, b in zip(subs[5][3], flush[1][3])], ref_flush[0][3])
    assert fsdp_run[1, "stopped"] == 3, "one boundary for each of the flush's two cuts, one for the stop"

    # The check could fail: the island trained on half of each step's batches ends far outside the tolerance.
    wrong = one_worker(pairs=False)
    assert _worst(params["params11"], wrong["params11"]) > 100 * ATOL


def test_fsdp_islands_say_what_is_wrong():
    from islands.distributed import WorkerGroup
    from islands.island_kinds import island_for

    with pytest.raises(ValueError, match="no worker group"):
        island_for(spec(workers=1, shard="fsdp"), make_data(), updates(0, initial()))
    group = WorkerGroup(rank=0, world_size=2, addr="127.0.0.1")
    with pytest.raises(ValueError, match="salvage_every_steps: 0"):
        island_for(spec(workers=2, shard="fsdp"), make_data(), updates(0, initial()), group=group,
                      shelve=lambda step, blob: True)


def test_fsdp_units_are_list_elements_deepest_first_and_leave_tied_ones_to_their_parent():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(2, 2)
            self.head.weight = self.blocks[1].parts[0].weight  # tied: FSDP shards it once, in the root's unit

    net = Net()
    names = {id(m): n for n, m in net.named_modules()}
    assert [names[id(u)] for u in shard_units(net)] == ["blocks.1.parts.1", "blocks.0.parts.1", "blocks.0.parts.0",
                                                          "blocks.0"]


@pytest.mark.parametrize("rows", [1, 5, 32, 33])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_layout_parts_are_torch_chunk_parts(rows, world):
    """Rank r holds the r-th of torch.chunk(t, W) along dim 0, as FSDP2 shards it (checked on real DTensors by
    test_fsdp_island_of_two_matches_one_worker_on_both_batches), and nothing past the last chunk."""
    chunks = [c.tolist() for c in torch.arange(rows).chunk(world)]
    lay = Layout((rows, 3), sharded=True)
    got = [list(range(*lay.rows(r, world))) for r in range(world)]
    assert got == chunks + [[]] * (world - len(chunks))
