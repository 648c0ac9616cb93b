"""Start-up says what it is doing, in order, through a real small run on the session's Ray cluster."""

from __future__ import annotations

import pytest

from orchestrator.config import build_config
from orchestrator.run.driver import train
from orchestrator.run.startup import STAGES, Stage

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_start_up_stages_are_reported_in_order_before_the_progress_they_lead_to(ray_cluster, tmp_path):
    events: list = []
    cfg = build_config({
        "run": {"token_budget": 60_000, "seed": 2},
        "model": {"preset": "nano"},
        "data": {"max_bytes": 2_000_000},
        "eval": {"interval_s": 1.0, "batches": 2},  # due before the first step: the starting point must still come first
        "health": {"warm_spares": 1},  # started only once every island trains
        "pools": [
            {"name": "a", "islands": 2, "labels": {"pool": "a"}, "cpus_per_island": 0.5},
            {"name": "b", "islands": 1, "labels": {"pool": "b"}, "cpus_per_island": 0.5},
        ],
    })
    summary = train(cfg, tmp_path / "run", progress=events.append, stages=events.append)

    stages = [e for e in events if isinstance(e, Stage)]
    names = [s.name for s in stages]
    # Ray (the fixture's, already running), placing, islands coming up one count at a time, and the first step
    # once, as soon as an island has stepped: after the first island is up, maybe before the last one.
    assert names[:2] == ["ray", "placing"] and names.count("first_step") == 1, names
    assert set(names[2:]) == {"islands", "first_step"} and names.index("islands") < names.index("first_step"), names
    assert all(n in STAGES for n in names)
    counts = [s.done for s in stages if s.name == "islands"]
    assert counts == sorted(set(counts)) and counts[-1] == 3 and {s.of for s in stages if s.name == "islands"} == {3}
    assert stages[0].text == "using the Ray this process already runs"
    assert stages[1].text == "placing 3 islands in 2 pools (a 2, b 1)"
    # Every stage up to the islands comes before the first progress line; the first step before any tokens show.
    first_progress = next(i for i, e in enumerate(events) if not isinstance(e, Stage))
    assert all(isinstance(e, Stage) for e in events[:first_progress]) and events[first_progress - 1].name != "placing"
    first_step = events.index(next(s for s in stages if s.name == "first_step"))
    assert all(e.tokens == 0 for e in events[first_progress:first_step] if not isinstance(e, Stage))

    # The starting point, scored after the first step, still comes first, at 0 s, before any tokens.
    start = summary["evals"][0]
    assert start["wall_s"] == 0.0 and start["tokens_processed"] == 0 and set(start["versions"]) == {0}
    assert [e["wall_s"] for e in summary["evals"]] == sorted(e["wall_s"] for e in summary["evals"])
    assert summary["unigram_bits_per_byte"] > 0
