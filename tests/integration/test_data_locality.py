"""Training data stays in its region: each pool's islands read that pool's own copy of the corpus, and no corpus
byte crosses between nodes through Ray's object store (docs/data.md). A unit that turns out unreadable only when
read (ids past the vocabulary) is skipped, and its tokens get their own fate in the summary and the final table.

One short run on the session cluster: a 64 MiB token-file corpus in two local directories (copy A for pool a, on
nodes a1/a2; copy B for pool b, on node b1), the nano model, a token budget that trains for about a second.

**The transfer statistic.** Each raylet counts the bytes ever created in its node's plasma store
(``ObjectStoreStats.cumulative_created_bytes`` of its ``GetNodeStats`` reply, read here through
``ray._private.internal_api.node_stats``; Ray 2.60 has no public API for it). An object that reaches a node from
another node's store is created in the receiving store, so the growth of a node's count during the run bounds from
above what the object store brought to that node (it also counts what was put there locally, so it overstates).
The test first checks the statistic on a known transfer: 2 MiB the driver puts on the head and a task on b1 fetches
must show up in b1's count. (By hand, Ray's Prometheus gauge ``ray_object_manager_bytes{Type="Received"}`` on b1's
metrics port read exactly that transfer, 2,097,406 bytes; it is not used here because raylets report it every 5-10 s.)
What the bound does not see: arguments and return values under Ray's 100 KiB inline limit travel inside task and
actor messages, outside the object store. The old design, in which the driver ``ray.put`` the whole token array and
every island fetched it, would have put the whole corpus on every island's node.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import ray
from ray._private.internal_api import node_stats
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from islands.stream import StreamSampler
from orchestrator.config import build_config
from orchestrator.core.eventlog import read_events
from orchestrator.run.driver import train
from orchestrator.run.streams import corpus_stream
from orchestrator.run.summary import format_summary

pytestmark = [pytest.mark.ray, pytest.mark.slow]

FILES, FILE_TOKENS = 16, 2 << 20  # 16 files of 2 Mi uint16 tokens: 64 MiB per copy, a unit per file
CORPUS_BYTES = FILES * FILE_TOKENS * 2
PROBE_BYTES = 2 << 20  # the known transfer the statistic must see


def created_bytes(nodes: dict) -> dict[str, int]:
    """Node name -> bytes ever created in its object store (the raylet's own count)."""
    return {name: node_stats(node.node_ip_address, node.node_manager_port, include_memory_info=False)
            .store_stats.cumulative_created_bytes for name, node in nodes.items()}


@ray.remote(num_cpus=0)
def size_of(array: np.ndarray) -> int:
    return int(array.nbytes)


def test_each_pool_reads_its_own_copy_and_no_corpus_byte_crosses_the_object_store(ray_cluster, tmp_path):
    cluster, workers = ray_cluster
    nodes = {"head": cluster.head_node, **workers}

    # The statistic sees a transfer: PROBE_BYTES put on the head, fetched by a task on b1.
    before = created_bytes(nodes)
    probe = ray.put(np.ones(PROBE_BYTES, dtype=np.uint8))
    on_b1 = NodeAffinitySchedulingStrategy(workers["b1"].node_id, soft=False)
    assert ray.get(size_of.options(scheduling_strategy=on_b1).remote(probe)) == PROBE_BYTES
    del probe
    probed = created_bytes(nodes)
    assert probed["b1"] - before["b1"] >= PROBE_BYTES, (before, probed)

    # Two copies of one corpus, the same files (copy B hard-links copy A's: the same bytes at another path, without
    # writing them twice).
    copy_a, copy_b = tmp_path / "copy-a", tmp_path / "copy-b"
    copy_a.mkdir()
    rng = np.random.default_rng(0)
    for k in range(FILES):
        rng.integers(0, 256, FILE_TOKENS, dtype=np.uint16).astype("<u2").tofile(copy_a / f"shard-{k:02d}.bin")
    shutil.copytree(copy_a, copy_b, copy_function=os.link)
    copies = {"a": str(copy_a), "b": str(copy_b)}
    cfg = build_config({
        "run": {"token_budget": 40_000, "seed": 0},  # training is ~1 s of this run: start-up is the rest
        "model": {"preset": "nano"},
        "data": {"source": "tokens", "path": str(copy_a), "vocab_size": 256, "unit_tokens": FILE_TOKENS,
                 "heldout_tokens": 20_000},
        "eval": {"interval_s": 5.0, "batches": 2},
        "health": {"warm_spares": 0},  # nothing fails here: a spare would only take CPU from the islands
        "pools": [{"name": p, "islands": 1, "labels": {"pool": p}, "cpus_per_island": 0.5, "data_path": copies[p]}
                  for p in ("a", "b")],
    })
    # The first unit island 0 will read (the plan is metadata only: it does not change) gets ids past the vocabulary,
    # in both copies (hard links): only reading it can tell.
    bad = StreamSampler(corpus_stream(cfg).stream, island=0, seq_len=8, batch_size=1, seed=0).unit_at(0)
    with open(copy_a / bad.path, "r+b") as f:
        f.write(np.full(64, 300, dtype="<u2").tobytes())
    run_dir = tmp_path / "run"
    summary = train(cfg, run_dir)
    after = created_bytes(nodes)
    assert summary["stopped_by"] == "token_budget"
    assert summary["units_unreadable"] == [f"{bad.name}/0"] and summary["tokens_unreadable"] == bad.tokens == FILE_TOKENS
    table = format_summary(summary)
    assert re.search(rf"^unreadable \(skipped units\) +{FILE_TOKENS:,} tokens, .*{re.escape(bad.name)}", table, re.M), table
    # The skipped unit's 2 Mi tokens are not among those processed (a 40k budget: about 0.1M were).
    assert summary["tokens_processed"] < bad.tokens, "skipped tokens are not processed ones"

    # Every island's last status names its own pool's copy, and it read from it.
    last: dict[int, dict] = {}
    for row in read_events(run_dir, "islands").to_pylist():
        if row["island"] not in last or (row["incarnation"], row["at"]) > (last[row["island"]]["incarnation"], last[row["island"]]["at"]):
            last[row["island"]] = row
    assert {row["pool"] for row in last.values()} == {"a", "b"}
    for row in last.values():
        assert row["data_root"] == copies[row["pool"]], row
        assert row["data_read_bytes"] > 0, row
    # ... on a node of that pool.
    labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n["Alive"]}
    assert all(labels[isl["node"]]["pool"] == isl["pool"] for isl in summary["islands"]), summary["islands"]

    # Each island read whole units (4 MiB each) from its copy, while no node's object store took in more than an eighth
    # of the corpus (8 MiB) during the run: what it did take in, under 1 MiB a node, is the model's traffic (fragments
    # up, published versions down: the summary's bytes_up and bytes_down).
    grew = {name: after[name] - probed[name] for name in nodes}
    print(f"object store bytes created per node during the run: {grew}; the islands read "
          f"{[(row['pool'], row['data_read_bytes']) for row in last.values()]} of a {CORPUS_BYTES:,}-byte corpus; "
          f"model traffic up {summary['bytes_up']:,}, down {summary['bytes_down']:,}")
    assert all(row["data_read_bytes"] >= FILE_TOKENS * 2 for row in last.values()), last
    assert all(b < CORPUS_BYTES // 8 for b in grew.values()), grew
