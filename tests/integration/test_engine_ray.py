"""The engine end to end on a real local Ray cluster with two labelled pools."""

from __future__ import annotations

import json

import pytest
import ray

from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.core.eventlog import read_events
from orchestrator.run.driver import train
from orchestrator.run.trained import evaluate_trained, load_trained

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def two_pool_config(outer: dict | None = None, islands: int = 2, **run) -> dict:
    return {
        "mode": run.pop("mode", "decoupled"),
        "outer": outer or {},
        "run": {"token_budget": 300_000, "seed": 1, **run},
        # nano: this checks the engine's wiring, accounting and placement, not the model; its steps take
        # milliseconds, so the run is start-up plus a few seconds (the default model's took ~20 s more).
        "model": {"preset": "nano"},
        "data": {"max_bytes": 3_000_000},
        "eval": {"interval_s": 4.0, "batches": 4},
        "health": {"warm_spares": 0},  # nothing here fails: a spare would only take CPU from the islands
        "pools": [
            {"name": "a", "islands": islands, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "region": "us-east"},
            {"name": "b", "islands": islands, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "region": "eu-west",
             "emulated_slowdown": 1.5, "precision": "bf16"},  # mixed arithmetic in one run (pool override)
        ],
    }


def node_labels() -> dict[str, dict]:
    return {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n["Alive"]}


def test_decoupled_run_learns_accounts_every_token_and_respects_pools(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    # Serving a moving average. A wide window: in a run this short the final flush (4 islands' last H/P steps,
    # ~15% of the tokens) moves an average over 10% of the tokens all the way to the global model.
    summary = train(build_config(two_pool_config(average_window=0.5)), run_dir)

    # Held-out loss falls from the starting point.
    first, last = summary["evals"][0], summary["evals"][-1]
    assert first["tokens_processed"] == 0 and set(first["versions"]) == {0}
    # The log is in time order and the starting point comes first, however long scoring it took.
    times = [e["wall_s"] for e in summary["evals"]]
    assert times == sorted(times) and times[0] < 0.5, times
    assert last["eval_loss"] < first["eval_loss"] - 0.5
    assert summary["eval_bits_per_byte"] < summary["unigram_bits_per_byte"] + 1.5  # well on its way down

    # Every token has a fate, per fragment: processed = merged + refused + in flight at stop.
    ledger = summary["token_ledger"]
    assert summary["tokens_processed"] >= 300_000
    for p in range(len(ledger["merged"])):
        assert ledger["processed"][p] == summary["tokens_processed"]
        assert ledger["processed"][p] == (ledger["merged"][p] + ledger["refused"][p] + ledger["in_flight"][p]
                                          + ledger["overwritten"][p])
        assert ledger["lost"][p] == 0, "no failure, no loss"
    assert summary["failures"] == 0 and 0.0 < summary["goodput"] <= 1.0 and summary["uptime"] > 0.0
    assert summary["stopped_by"] == "token_budget"
    # Scored on the same held-out batches just before the final flush: a real, different number (the flush merged).
    assert 0 < summary["eval_loss_before_flush"] < 6 and summary["eval_loss_before_flush"] != summary["eval_loss"]
    assert summary["tokens_merged"] > 0 and summary["rounds"] > 0

    # Islands land on nodes whose labels their pool selects.
    labels = node_labels()
    for isl in summary["islands"]:
        assert labels[isl["node"]]["pool"] == isl["pool"], isl
    assert {isl["pool"] for isl in summary["islands"]} == {"a", "b"}
    assert {isl["device"] for isl in summary["islands"]} == {"cpu"}, "CPU pools: every island reports it trained on the CPU"
    assert {(isl["pool"], isl["precision"]) for isl in summary["islands"]} == {("a", "fp32"), ("b", "bf16")}

    # The run directory holds the event log and the summary.
    rounds = read_events(run_dir, "rounds")
    assert rounds.num_rows == summary["rounds"]
    assert set(rounds.column_names) >= {"fragment", "version", "participants", "weights", "staleness", "tokens",
                                        "bytes", "quorum_s", "grace_s", "merge_s"}
    assert sum(rounds.column("tokens").to_pylist()) == sum(ledger["merged"])
    assert read_events(run_dir, "evals").num_rows == len(summary["evals"])
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_loss", "eval_bits_per_byte", "tokens_merged", "tokens_refused", "rounds", "bytes_sent", "wall_s", "mode"):
        assert key in on_disk
    assert "EMULATION" in on_disk["emulation"]
    # The trained model, as `diloco sample` / `diloco export` load it, is the one the final evaluation scored.
    trained = load_trained(run_dir)
    assert evaluate_trained(trained)["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-6) and trained.averaged
    # The raw global model, kept beside the average, is the one summary.json's eval_loss_raw scored.
    raw = evaluate_trained(load_trained(run_dir, raw=True))["eval_loss"]
    assert raw == pytest.approx(summary["eval_loss_raw"], rel=1e-6) and raw != pytest.approx(summary["eval_loss"], rel=1e-5)
    assert trained.versions == summary["evals"][-1]["versions"] and trained.mode == "decoupled"
    assert trained.tokens_processed == summary["tokens_processed"]
    # Nothing of the run is left behind on the cluster.
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if run_dir.name in a["name"]]


def test_run_stops_once_the_held_out_loss_is_at_the_target(ray_cluster, tmp_path):
    # A target every finite loss meets: the run stops at its second evaluation, long before the budget
    # (policies/test_stopping.py covers the rule itself; this is the driver's wiring).
    cfg = two_pool_config(islands=1, token_budget=100_000_000, max_wall_s=120, stop_at_eval_loss=100.0)
    cfg["eval"]["interval_s"] = 1.0
    summary = train(build_config(cfg), tmp_path / "target")
    assert summary["stopped_by"] == "stop_at_eval_loss"
    assert summary["tokens_processed"] < 100_000_000 and summary["wall_s"] < 60
    assert [e["eval_loss"] <= 100.0 for e in summary["evals"][:2]] == [True, True]
    assert json.loads((tmp_path / "target" / "summary.json").read_text())["stopped_by"] == "stop_at_eval_loss"


def test_sync_diloco_rounds_take_every_island(ray_cluster, tmp_path):
    # With a torch optimizer as the outer step (outer.optimizer, by import path in the actor's process): its state
    # is in the outer optimizer's checkpoints (tests/engine/test_outer_plugin.py checks the rest without Ray).
    cfg = two_pool_config({"sync_every_steps": 8, "optimizer": "torch.optim:Adam"}, islands=1, mode="sync-diloco",
                          token_budget=80_000)
    summary = train(build_config(cfg), tmp_path / "sync")
    final = CheckpointStore(str(tmp_path / "sync" / "checkpoints")).load_latest()
    assert final is not None and any(k.startswith("outer_state/0/") for k in final.tensors)
    assert final.meta["outer"]["outer_state"][0]["kind"] == "Adam"
    rounds = read_events(tmp_path / "sync", "rounds").to_pylist()
    assert len(rounds) >= 2, "synchronous rounds happened"
    seen = [(x["participants"], x["reason"]) for x in rounds]
    # Every round the quorum closed took both islands. The run's final flush merges whatever progress is
    # left, whatever the quorum says (docs: "final flush"): if the stop came just after a round, one island
    # may have nothing left to add, so that last round alone may have one participant.
    *synced, last = rounds
    assert synced and all(sorted(r["participants"]) == [0, 1] for r in synced), seen
    assert all(r["weights"] == pytest.approx([0.5, 0.5]) for r in synced), seen
    assert sorted(last["participants"]) == [0, 1] or last["reason"] == "final flush", seen
    assert all(r["fragment"] == 0 for r in rounds)
    assert summary["versions"] == [len(rounds)]


def test_topk_both_ways_trains_merges_and_sends_exactly_its_wire_bytes(ray_cluster, tmp_path):
    # Top-k with error feedback end to end: real island actors owe what their cuts leave out, the outer optimizer
    # merges the sparse submissions, and every downlink send after registration is a top-k difference (the
    # islands registered holding version 0, so none goes whole).
    from islands.model import build_model, model_config
    from policies.compression import topk_keep
    from policies.fragments import plan_fragments

    outer = {"compression": "topk", "downlink_delta": "topk", "downlink": "int8", "topk_density": 0.05,
             "momentum": 0.0, "partial_momentum": 0.0, "lr": 1.0}
    summary = train(build_config(two_pool_config(outer, islands=1, token_budget=150_000)), tmp_path / "topk")
    assert summary["evals"][-1]["eval_loss"] < summary["evals"][0]["eval_loss"] - 0.3
    ledger = summary["token_ledger"]
    assert summary["tokens_refused"] == 0 and sum(ledger["merged"]) > 0
    assert all(ledger["lost"][p] == 0 for p in range(len(ledger["merged"])))
    # Every merged submission of fragment p costs exactly its top-k payload: two bytes an entry, four per chunk.
    init = {n: t.detach() for n, t in build_model(model_config("nano"), seed=1).named_parameters()}
    plan = plan_fragments([(n, t.numel() * t.element_size()) for n, t in init.items()], 2)  # as the driver plans

    def topk_bytes(names) -> int:
        total = 0
        for name in names:
            chunk, keep = topk_keep(init[name].numel(), 0.05)
            total += (-(-init[name].numel() // chunk)) * (2 * keep + 4)
        return total

    expected = [topk_bytes(names) for names in plan.fragments]
    rounds = read_events(tmp_path / "topk", "rounds").to_pylist()
    assert rounds and all(r["bytes"] == expected[r["fragment"]] * len(r["participants"]) for r in rounds), \
        ([(r["fragment"], r["bytes"], len(r["participants"])) for r in rounds], expected)
    # The downlink carries top-k differences only, each exactly its fragment's top-k bytes (or nothing, when an
    # island already holds the version): the bytes are a sum of at most `sends` of them. One whole int8 fragment
    # (about a byte per parameter) in the mix would leave a remainder no such sum has.
    down = sum(v["down"] for v in summary["bytes_by_link"].values())
    sends = sum(v["down"] for v in summary["transfers_by_link"].values())
    assert sends > 0 and down > 0
    assert any(a * expected[0] + b * expected[1] == down for a in range(sends + 1) for b in range(sends + 1 - a)), \
        (down, sends, expected)
