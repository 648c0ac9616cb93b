"""Ray Tune: docs/tune.md's `search` as written, three nano trials under ASHA on the session cluster, two at a time.

The third trial's outer lr (0.01) keeps its global model near its starting point, and it starts once one of the two
good trials has finished and recorded every rung, so ASHA stops it at its first rung: a trial stopped early, below its
token budget, by the stop that ends the experiment (Tune then kills trial actors 10 s after their stop was asked). The
stopped run finished cleanly (summary.json's stopped_by "tune", its final checkpoint holding its whole ledger), every
trial is TERMINATED, and nothing of any trial is left: no actor of theirs alive, no placement group but removed ones
(the session cluster's `no_leftovers` fixture checks every CPU free and no group too).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import ray

from orchestrator.config import build_config
from orchestrator.core.checkpoint import CheckpointStore
from orchestrator.tune import TUNE_STOPPED
from tests.api.test_readme_example import first_python_block, section

# Extended (left out of CI's default run): three trials are three run start-ups (the trial actor, the outer optimizer,
# the monitor, two islands and two keepers: seven processes that import torch), 15-20 s each on a loaded 2-core
# machine; the test took 53 s at a load average of ~6 and 73-103 s at 10-30 (the session cluster's start not
# counted): about or over the ~60 s CI can spare.
# tests/api/test_tune_config.py (Ray-free) runs in the default run.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.extended]

DOC = Path(__file__).resolve().parents[2] / "docs" / "tune.md"
BUDGET = 120_000  # tokens: ~10 s of two throttled nano islands; a trial's stop comes ~30k tokens after its rung
GRACE = 10_000  # ASHA's first rung (tokens); then 20k, 40k, 80k


def doc_example() -> types.ModuleType:
    """docs/tune.md's example as a module (its `__main__` part not run)."""
    code = first_python_block(section(DOC.read_text(encoding="utf-8"), "## Search outer lr, H and K under ASHA") or "")
    assert code, "docs/tune.md has no example"
    module = types.ModuleType("tune_example")
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


def base_config():
    return build_config({
        "run": {"token_budget": BUDGET, "seed": 3},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 1_000_000},
        "eval": {"interval_s": 1.0, "batches": 2},
        "outer": {"sync_every_steps": 10},
        "health": {"warm_spares": 0},
        "pools": [
            # Throttled (EMULATION): unthrottled, two nano islands process ~40k tokens/s here, ~100k in the seconds
            # between a rung's report and the stop; and the cores go to the other trial's start-up.
            {"name": "a", "islands": 1, "labels": {"pool": "a"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
            {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5, "emulated_slowdown": 3.0},
        ],
    })


def test_three_trials_under_asha_one_stopped_early_cleanly_nothing_left(ray_cluster, tmp_path, capsys):
    from ray import tune

    example = doc_example()
    actors_before = set(ray._private.state.actors())  # the GCS's actor table (the session cluster has no state API)
    # lr, H and K per trial, in this order, two at a time (the session cluster holds two runs' islands): two good
    # ones, then a hopeless lr, which starts once a good one has finished and recorded every rung.
    space = {"outer": tune.grid_search([
        {"lr": 0.7, "sync_every_steps": 10, "min_quorum": 1},
        {"lr": 0.5, "sync_every_steps": 20, "min_quorum": 2},
        {"lr": 0.01, "sync_every_steps": 10, "min_quorum": 1},
    ])}
    results = example.search(base_config(), space, num_samples=1, grace_tokens=GRACE, run_root=tmp_path / "runs",
                             storage_path=str(tmp_path / "tune"), max_concurrent_trials=2)

    assert len(results) == 3 and results.num_terminated == 3 and results.num_errors == 0, [r.error for r in results]
    assert "released" not in capsys.readouterr().out, "a trial was killed before its run stopped"
    trials = {r.config["outer"]["lr"]: r for r in results}
    summaries = {lr: json.loads((Path(r.metrics["run_dir"]) / "summary.json").read_text()) for lr, r in trials.items()}

    # The first trial ran to its budget; the hopeless one was stopped at its first rung, below the budget.
    assert summaries[0.7]["stopped_by"] == "token_budget" and summaries[0.7]["tokens_processed"] >= BUDGET
    for lr, r in trials.items():  # how long the stops took: from the last result Tune took to summary.json
        print(lr, summaries[lr]["stopped_by"], summaries[lr]["tokens_processed"],
              f"{(Path(r.metrics['run_dir']) / 'summary.json').stat().st_mtime - r.metrics['timestamp']:.1f} s")
    stopped = summaries[0.01]
    assert stopped["stopped_by"] == TUNE_STOPPED and GRACE <= stopped["tokens_processed"] < BUDGET, stopped
    assert trials[0.01].metrics["tokens"] < BUDGET
    for lr, summary in summaries.items():  # a clean stop: the final flush merged what the islands held
        assert summary["stopped_by"] in ("token_budget", TUNE_STOPPED), (lr, summary["stopped_by"])
        ledger = summary["token_ledger"]
        assert sum(ledger["in_flight"]) == 0, (lr, ledger)
        # Tokens are lost only to an island failure (a loaded machine's missed heartbeats), never to the stop.
        assert summary["tokens_lost"] == 0 or summary["failures"] > 0, (lr, ledger)
        # Its final checkpoint: the run's last state, with its whole ledger.
        store = CheckpointStore(str(Path(trials[lr].metrics["run_dir"]) / "checkpoints"))
        final = store.load(store.list()[-1]).meta
        assert final["extra"]["tokens_processed"] == summary["tokens_processed"], (lr, final["extra"])

    # Every trial TERMINATED (an ERROR would be in results.errors); nothing of theirs is alive.
    run_ids = [r.metrics["run_id"] for r in trials.values()]
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in named if any(run_id in n for run_id in run_ids)], named
    alive = [a["ActorClassName"] for i, a in ray._private.state.actors().items()
             if i not in actors_before and a["State"] == "ALIVE"]
    assert not alive, alive  # the trials' drivers, outer optimizers, monitors, islands and keepers are all gone
    groups = {i["name"]: i["state"] for i in ray.util.placement_group_table().values() if i["state"] != "REMOVED"}
    assert not groups, groups
