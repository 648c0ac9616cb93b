"""benchmarks/sweep.py's grid, DP sharing and summary, without running anything (the runs are benchmarks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from orchestrator.config import load_config

_spec = importlib.util.spec_from_file_location("sweep_bench", Path(__file__).parents[1] / "benchmarks" / "sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_the_grid_is_the_cartesian_product_in_the_order_given():
    grid = sweep.parse_grid(["outer.lr=0.35,0.7", "outer.sync_every_steps=10,40"])
    assert sweep.grid_points(grid) == [
        ("outer.lr=0.35", "outer.sync_every_steps=10"), ("outer.lr=0.35", "outer.sync_every_steps=40"),
        ("outer.lr=0.7", "outer.sync_every_steps=10"), ("outer.lr=0.7", "outer.sync_every_steps=40")]
    assert sweep.grid_points([]) == [()]


@pytest.mark.parametrize("spec", ["inner.lr", "inner.lr=", "=1,2", "inner.lr=1,,2"])
def test_a_malformed_grid_is_a_one_line_error_that_shows_the_form(spec):
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        sweep.parse_grid([spec])


def test_a_key_given_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        sweep.parse_grid(["inner.lr=1", "inner.lr=2"])


def test_points_that_differ_only_outside_dps_sections_share_one_dp_run():
    a = ("inner.lr=0.002", "outer.lr=0.35")
    b = ("inner.lr=0.002", "outer.lr=0.7")
    c = ("inner.lr=0.003", "outer.lr=0.7")
    assert sweep.dp_view(a) == sweep.dp_view(b) == ("inner.lr=0.002",)
    assert sweep.dp_view(c) != sweep.dp_view(b)
    # DP emulates the network's all-reduce, so a network key is its own DP run.
    assert sweep.dp_view(("network.scenario=wan-4-regions", "outer.lr=0.7")) == ("network.scenario=wan-4-regions",)


def test_the_base_is_uniform_islands_in_one_pool_without_emulation_or_network():
    cfg = load_config(overrides=sweep.base_overrides(3))
    assert [(p.islands, p.emulated_slowdown, p.emulated_jitter) for p in cfg.pools] == [(3, 1.0, 0.0)]
    assert cfg.network.scenario == "none" and cfg.health.warm_spares == 0


def test_the_summary_takes_medians_and_measures_each_best_against_dps_best():
    p1, p2 = ("inner.lr=1",), ("inner.lr=2",)
    cells = {("decoupled", p1): [2.2, 2.0, 2.4], ("decoupled", p2): [2.1], ("dp", p1): [1.8], ("dp", p2): [1.6]}
    s = sweep.summarise(cells, ["decoupled", "dp"], [p1, p2])
    assert s["median"][("decoupled", p1)] == pytest.approx(2.2)
    assert s["best"]["decoupled"]["point"] == ["inner.lr=2"] and s["best"]["dp"]["loss"] == pytest.approx(1.6)
    assert s["best"]["decoupled"]["gap_to_dp_best"] == pytest.approx(2.1 / 1.6 - 1)
    text = sweep.table(s, cells, ["decoupled", "dp"], [p1, p2])
    assert "2.2000 (2.2000, 2.0000, 2.4000)" in text and "+31.2% vs dp's best" in text


def test_without_dp_there_is_no_gap():
    s = sweep.summarise({("sync-diloco", ()): [2.0]}, ["sync-diloco"], [()])
    assert s["best"]["sync-diloco"]["gap_to_dp_best"] is None


def test_an_out_directory_holding_runs_is_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the sweep started Ray before refusing --out"))
    (tmp_path / "r1").mkdir()
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(tmp_path)])
    assert "--out" in capsys.readouterr().err
