"""benchmarks/compare.py's run plan and analysis, without running anything (the runs are benchmarks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("compare_bench", Path(__file__).parents[1] / "benchmarks" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

BUDGET = 1000


def run(final: float, tokens: int, evals: list[tuple[float, float]], **extra) -> dict:
    """A summary.json with the fields the analysis reads; evals as (wall s, loss), tokens linear in time."""
    last = evals[-1][0]
    return {"eval_loss": final, "tokens_processed": tokens, "bytes_sent": 10 * tokens, "goodput": 0.5, "wall_s": last,
            "evals": [{"wall_s": t, "eval_loss": loss, "tokens_processed": tokens * t / last} for t, loss in evals], **extra}


def test_the_no_network_dp_runs_before_the_capped_one_and_sync_baselines_can_be_skipped():
    names = [n for n, _, _ in compare.methods(compare.parse_args([]))]
    assert names == ["decoupled", "sync-diloco", "streaming-diloco", "dp-no-network", "data-parallel"]
    names = [n for n, _, _ in compare.methods(compare.parse_args(["--skip-sync-baselines"]))]
    assert names == ["decoupled", "dp-no-network", "data-parallel"]
    assert compare.parse_args([]).dp_stop_at_target and not compare.parse_args(["--dp-run-out"]).dp_stop_at_target


def test_target_so_far_is_the_worst_final_loss_among_runs_that_finished_the_budget():
    rep = {"decoupled": run(2.2, BUDGET, [(0, 5.0), (10, 2.2)]),
           "capped": run(3.0, BUDGET // 2, [(0, 5.0), (10, 3.0)]),  # did not finish: does not set the target
           "dp-no-network": run(1.8, BUDGET, [(0, 5.0), (10, 1.8)])}
    assert compare.target_so_far(rep, BUDGET) == 2.2
    assert compare.target_so_far({"capped": rep["capped"]}, BUDGET) is None


def test_a_dp_run_stopped_at_the_target_gives_a_measured_speedup():
    dec = run(2.2, BUDGET, [(0, 5.0), (5, 3.0), (10, 2.2)], tokens_per_step=1)
    ref = run(1.8, BUDGET, [(0, 5.0), (2, 2.6), (4, 1.8)], tokens_per_step=10)
    # Stopped after two evaluations at or below 2.2: it crosses the target halfway between 200 s and 300 s.
    dp = run(2.0, BUDGET // 4, [(0, 5.0), (100, 3.0), (200, 2.4), (300, 2.0), (400, 1.9)], tokens_per_step=10,
             allreduce_emulated_s=1.0)
    res = compare.analyse_wan([{"decoupled": dec, "dp-no-network": ref, "data-parallel": dp}], cap_s=3600, budget=BUDGET)
    row = res["per_repeat"][0]
    assert row["target_loss"] == 2.2
    assert row["methods"]["data-parallel"]["time_to_target_s"] == pytest.approx(250.0)
    assert row["speedup"] == pytest.approx(25.0) and not row["speedup_is_lower_bound"]
    # Quality at equal tokens comes from the no-network run: the stopped run did not finish the budget.
    assert row["loss_gap"] == pytest.approx(2.2 / 1.8 - 1)


def test_a_dp_run_capped_before_the_target_leaves_the_speedup_undecided_unless_its_bound_passes():
    dec = run(2.2, BUDGET, [(0, 5.0), (5, 3.0), (10, 2.2)], tokens_per_step=1)
    ref = run(1.8, BUDGET, [(0, 5.0), (2, 2.6), (4, 1.8)], tokens_per_step=10)

    def capped(wall_s: float) -> dict:  # never below 2.2 within its cap
        return run(3.0, BUDGET // 100, [(0, 5.0), (wall_s, 3.0)], tokens_per_step=10, allreduce_emulated_s=1.0)

    res = compare.analyse_wan([{"decoupled": dec, "dp-no-network": ref, "data-parallel": capped(30.0)}], cap_s=30, budget=BUDGET)
    line = compare.checks_md(res)[0]
    assert line.startswith("- UNDECIDED: decoupled reaches the target loss >= 20x sooner than DP: measured at least 3x "
                           "(data parallel capped at 30 s before the target); --dp-cap-s 3600 times it; projected ")
    # A bound already past the target is a pass: data parallel took longer than that.
    res = compare.analyse_wan([{"decoupled": dec, "dp-no-network": ref, "data-parallel": capped(250.0)}], cap_s=250, budget=BUDGET)
    assert compare.checks_md(res)[0].startswith("- PASS: decoupled reaches the target loss >= 20x sooner than DP: measured at least 25x")


def test_the_loss_gap_uses_the_wide_final_evaluation_when_runs_have_one():
    dec = run(2.2, BUDGET, [(0, 5.0), (10, 2.2)], tokens_per_step=1, final_loss_wide=2.25)
    ref = run(2.0, BUDGET, [(0, 5.0), (4, 2.0)], tokens_per_step=10, final_loss_wide=2.2)
    dp = run(2.1, BUDGET // 4, [(0, 5.0), (300, 2.1)], tokens_per_step=10, allreduce_emulated_s=1.0,
             final_loss_wide=2.3)
    res = compare.analyse_wan([{"decoupled": dec, "dp-no-network": ref, "data-parallel": dp}], cap_s=3600, budget=BUDGET)
    row = res["per_repeat"][0]
    assert row["loss_gap"] == pytest.approx(2.25 / 2.2 - 1)  # +10% on the runs' own evaluations
    assert row["target_loss"] == 2.2, "the target and the times to it stay on the runs' own evaluations"
    assert row["methods"]["decoupled"]["final_loss_own_eval"] == 2.2
    het = compare.analyse_het([{"K=all": run(2.0, BUDGET, [(1.0, 3.0), (2.0, 2.0)], final_loss_wide=2.1),
                                "K=1 + grace": run(2.1, BUDGET, [(1.0, 3.0), (2.0, 2.1)], final_loss_wide=2.1)}])
    assert het["median"]["K=1 + grace"]["gap_to_kall"] == pytest.approx(0.0)


def test_score_final_scores_the_newest_checkpoint_on_that_many_held_out_batches(tmp_path):
    import torch
    import torch.nn.functional as F

    from islands.data import heldout_batches
    from islands.model import build_model, model_config
    from orchestrator.run.driver import load_corpus
    from orchestrator.run.trained import read_run_config
    from tests.engine.test_trained import write_run

    saved = write_run(tmp_path / "run")  # checkpoints 0 and 4 of a nano run, eval.batch_size 8
    got = compare.score_final(tmp_path / "run", 6)
    model = build_model(model_config("nano"), seed=0)
    with torch.no_grad():  # by hand: checkpoint 4's parameters (not 0's) over 6 batches of 8 x 32 bytes
        for n, p in model.named_parameters():
            p.copy_(saved[4][n])
        cfg, _ = read_run_config(tmp_path / "run")
        batches = heldout_batches(load_corpus(cfg).heldout, seq_len=32, batch_size=8, num_batches=6)
        want = sum(float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))) for x, y in batches) / 6
    assert got == {"final_loss_wide": pytest.approx(want, rel=1e-6), "final_eval_tokens": 6 * 8 * 32}
    assert compare.parse_args([]).final_eval_batches == 256 and compare.parse_args(["--quick"]).final_eval_batches == 16
    with pytest.raises(SystemExit):
        compare.parse_args(["--final-eval-batches", "-1"])


def test_set_reaches_the_decoupled_runs_only_and_a_bad_one_is_a_one_line_error(capsys):
    plan = {n: extra for n, _, extra in compare.methods(compare.parse_args(["--set", "outer.lr=0.35"]))}
    assert plan["decoupled"]["outer"]["lr"] == 0.35 and plan["decoupled"]["outer"]["compression"] == "int4"
    assert "lr" not in plan["sync-diloco"].get("outer", {})
    het = compare.methods(compare.parse_args(["--scenario", "heterogeneity", "--set", "outer.lr=0.35"]))
    assert [extra["outer"]["lr"] for _, _, extra in het] == [0.35, 0.35, 0.35]
    with pytest.raises(SystemExit):
        compare.parse_args(["--set", "outer.lr=-1"])
    assert "outer.lr" in capsys.readouterr().err


def test_set_all_reaches_every_run_and_set_still_wins_for_decoupled(capsys):
    args = compare.parse_args(["--model", "small", "--set-all", "model.seq_len=128", "--set-all", "inner.lr=0.0015",
                               "--set", "inner.lr=0.00075"])
    for name, _, extra in compare.methods(args):
        cfg = compare.build_config(compare.deep_merge(compare.base_config(args), extra))
        assert (cfg.model.preset, cfg.model.seq_len) == ("small", 128), name
        assert cfg.inner.lr == (0.00075 if name == "decoupled" else 0.0015), name
        assert [p.region for p in cfg.pools] == list(compare.REGIONS), "the scenario's pools stand"
    for bad, said in ((["--set-all", "inner.lr=-1"], "inner.lr"), (["--set-all", "pools.0.islands=2"], "--scenario"),
                      (["--set-all", "run.token_budget=5"], "--budget")):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
        assert said in capsys.readouterr().err


def test_every_run_shares_the_lr_schedule_cosine_unless_told_otherwise():
    def schedules(argv: list[str]) -> dict[str, str]:
        args = compare.parse_args(argv)
        return {name: compare.build_config(compare.deep_merge(compare.base_config(args), extra)).inner.lr_schedule
                for name, _, extra in compare.methods(args)}

    assert set(schedules([]).values()) == {"cosine"} and len(schedules([])) == 5
    assert set(schedules(["--lr-schedule", "constant"]).values()) == {"constant"}
    assert set(schedules(["--scenario", "heterogeneity", "--lr-schedule", "constant"]).values()) == {"constant"}
    # The older spelling, in dated commands of benchmarks/RESULTS.md, still sets every run.
    assert set(schedules(["--lr-schedule", "constant", "--set-all", "inner.lr_schedule=cosine"]).values()) == {"cosine"}
    with pytest.raises(SystemExit):
        compare.parse_args(["--lr-schedule", "linear"])


def test_set_tunes_k1_with_grace_but_cannot_change_what_names_a_heterogeneity_method(capsys):
    het = {n: extra["outer"] for n, _, extra in
           compare.methods(compare.parse_args(["--scenario", "heterogeneity", "--set", "outer.grace_gamma=1.0"]))}
    assert het["K=1 + grace"]["grace_gamma"] == 1.0
    assert het["K=1, no grace"]["grace_gamma"] == 0.0 and het["K=all"]["min_quorum"] == "all"
    with pytest.raises(SystemExit):
        compare.parse_args(["--scenario", "heterogeneity", "--set", "outer.min_quorum=2"])
    assert "outer.min_quorum" in capsys.readouterr().err


def test_an_out_directory_holding_runs_is_refused_before_anything_starts(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", str(tmp_path)])
    assert str(tmp_path) in capsys.readouterr().err
    assert compare.parse_args(["--out", str(tmp_path / "new")]).out == tmp_path / "new"


def test_the_heterogeneity_ab_can_skip_k1_without_grace_and_wan_refuses_the_flag(capsys):
    names = [n for n, _, _ in compare.methods(compare.parse_args(["--scenario", "heterogeneity", "--skip-no-grace"]))]
    assert names == ["K=all", "K=1 + grace"]
    names = [n for n, _, _ in compare.methods(compare.parse_args(["--scenario", "heterogeneity"]))]
    assert names == ["K=all", "K=1, no grace", "K=1 + grace"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--skip-no-grace"])
    assert "--skip-no-grace" in capsys.readouterr().err


def test_quorum_gives_the_heterogeneity_runs_another_k_and_the_targets_follow_it(capsys):
    runs = {n: extra["outer"] for n, _, extra in
            compare.methods(compare.parse_args(["--scenario", "heterogeneity", "--quorum", "2"]))}
    assert list(runs) == ["K=all", "K=2, no grace", "K=2 + grace"]
    assert runs["K=2 + grace"]["min_quorum"] == 2 and runs["K=2, no grace"]["min_quorum"] == 2
    assert runs["K=2, no grace"]["grace_gamma"] == 0.0 and runs["K=all"]["min_quorum"] == "all"
    # The default is the K = 1, set explicitly so that a changed engine default cannot move it.
    default = {n: extra["outer"] for n, _, extra in compare.methods(compare.parse_args(["--scenario", "heterogeneity"]))}
    assert default["K=1 + grace"]["min_quorum"] == 1
    res = compare.analyse_het([{"K=all": run(2.0, BUDGET, [(1.0, 3.0), (2.0, 2.0)]),
                                "K=2 + grace": run(2.1, BUDGET, [(1.0, 3.0), (2.0, 2.1)])}])
    assert compare.checks_md(res)[0] == "- MISS: K=2 + grace within 2% of K=all in quality: measured +5.00% vs K=all"
    for argv, needle in ((["--quorum", "2"], "heterogeneity only"), (["--scenario", "heterogeneity", "--quorum", "4"], "got 4"),
                         (["--scenario", "heterogeneity", "--quorum", "0"], "got 0")):
        with pytest.raises(SystemExit):
            compare.parse_args(argv)
        assert needle in capsys.readouterr().err


def test_progress_lines_read_either_runner_and_are_throttled(capsys, monkeypatch):
    from orchestrator.run.driver import Progress

    clock = iter([100.0, 130.0, 161.0])
    monkeypatch.setattr(compare.time, "monotonic", lambda: next(clock))
    show = compare.ProgressLine("decoupled", 30_000_000, every_s=60.0)
    show(Progress(tokens=12_000_000, budget=30_000_000, versions=[3], rounds=7, train_loss=None, eval_bpb=1.6234,
                  elapsed_s=780.4))
    show({"tokens_processed": 13_000_000, "wall_s": 800.0, "eval_bits_per_byte": 1.6})  # 30 s later: dropped
    show({"tokens_processed": 15_000_000, "wall_s": 841.0, "eval_bits_per_byte": None})
    assert capsys.readouterr().err.splitlines() == [
        "    decoupled: 12.00M of 30.00M tokens (40%), 780 s, held-out 1.623 bits/byte",
        "    decoupled: 15.00M of 30.00M tokens (50%), 841 s, held-out n/a bits/byte"]
    with pytest.raises(SystemExit):
        compare.parse_args(["--progress-s", "-1"])
    assert "--progress-s" in capsys.readouterr().err


def test_the_heterogeneity_table_gives_each_repeats_gap_beside_the_median():
    def het(kall: float, k1: float) -> dict[str, dict]:
        return {"K=all": run(kall, BUDGET, [(1.0, 3.0), (2.0, kall)]), "K=1 + grace": run(k1, BUDGET, [(1.0, 3.0), (2.0, k1)])}

    res = compare.analyse_het([het(2.0, 2.1), het(2.0, 2.02), het(2.0, 2.06)])
    g = res["median"]["K=1 + grace"]
    assert g["gaps_to_kall"] == pytest.approx([0.05, 0.01, 0.03])
    assert g["gap_to_kall"] == pytest.approx(0.03)
    table = compare.table_het(res, [])
    assert "| K=1 + grace | 2.0600 | +3.00% | +5.0%, +1.0%, +3.0% |" in table
    assert "- MISS: K=1 + grace within 2% of K=all in quality: measured +3.00% vs K=all" in table


def test_heterogeneity_gap_at_equal_tokens_merged_uses_evaluations_before_the_final_flush():
    def evals(points: list[tuple[float, float]]) -> list[dict]:
        return [{"wall_s": float(i), "tokens_merged": t, "tokens_processed": t, "eval_loss": loss}
                for i, (t, loss) in enumerate(points)]

    assert compare.loss_at_merged(evals([(0, 3.0), (600, 2.5), (800, 2.1)]), 700) == pytest.approx(2.3)
    assert compare.loss_at_merged(evals([(0, 3.0), (600, 2.5)]), 700) is None  # never merged that many
    # K = all lags: at 700 merged it reads 2.4, K = 1 + grace 2.448 (+2%); both end at 2.0 after the flush.
    kall = dict(run(2.0, BUDGET, [(1.0, 3.0), (2.0, 2.0)]), evals=evals([(0, 3.0), (600, 2.6), (800, 2.2), (1000, 2.0)]))
    k1 = dict(run(2.0, BUDGET, [(1.0, 3.0), (2.0, 2.0)]), evals=evals([(0, 3.0), (650, 2.5), (750, 2.396), (1000, 2.0)]))
    res = compare.analyse_het([{"K=all": kall, "K=1 + grace": k1}], budget=BUDGET)
    assert res["merged_checkpoint_tokens"] == pytest.approx(700)
    assert res["median"]["K=1 + grace"]["gap_to_kall_at_merged"] == pytest.approx(2.448 / 2.4 - 1)
    assert res["median"]["K=1 + grace"]["gap_to_kall"] == pytest.approx(0.0)
    # The point after the flush is never used: a run whose last evaluation before it merged less gets n/a.
    short = dict(run(2.0, BUDGET, [(1.0, 3.0), (2.0, 2.0)]), evals=evals([(0, 3.0), (600, 2.6), (1000, 2.0)]))
    res = compare.analyse_het([{"K=all": kall, "K=1 + grace": short}], budget=BUDGET)
    assert res["median"]["K=1 + grace"]["gap_to_kall_at_merged"] is None
    assert "| n/a |" in compare.table_het(res, [])
