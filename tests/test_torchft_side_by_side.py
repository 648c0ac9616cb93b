"""benchmarks/torchft_side_by_side.py's plan and analysis without running anything, and (with torchft installed) the
equivalence of torchft's DiLoCo and our sync-diloco mode on two replica groups."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCH))  # the benchmarks import each other by file name, as when run as scripts
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sbs = load("torchft_side_by_side")


def summary(final: float, evals: list[tuple[float, float]], merged: int, processed: int, **extra) -> dict:
    last = evals[-1][0]
    return {"eval_loss": final, "tokens_processed": processed, "tokens_merged": merged, "wall_s": last,
            "evals": [{"wall_s": t, "eval_loss": loss, "tokens_processed": processed * t / last} for t, loss in evals], **extra}


def test_the_three_systems_share_model_pools_network_and_h_and_differ_where_they_should(tmp_path):
    args = sbs.parse_args(["--quick", "--out", str(tmp_path / "o"), "--local-step-s", "0.1"])
    cargs = sbs.compare_args(args)
    clean = sbs.configs(cargs, "clean", None)
    assert list(clean) == list(sbs.SYSTEMS)
    for key in ("pools", "network", "model", "run"):
        assert clean["decoupled"][key] == clean["sync-diloco"][key] == clean["torchft"][key]
    assert {c["outer"]["sync_every_steps"] for c in clean.values()} == {10}
    assert clean["sync-diloco"]["mode"] == "sync-diloco" and clean["torchft"]["outer"]["num_fragments"] == 1
    slow = sbs.configs(cargs, "slow", None)["torchft"]["pools"]
    assert [p.get("emulated_slowdown", 1.0) for p in slow] == [1.0, 1.0, 1.6, 1.0]  # us-west
    faulted = sbs.configs(cargs, "faults", tmp_path / "tape.yaml")
    assert faulted["decoupled"]["chaos"]["mode"] == "tape" and "chaos" not in faulted["torchft"]  # torchft gets the tape itself


def test_set_all_reaches_every_system_and_bad_overrides_are_refused_before_any_run(tmp_path, capsys):
    args = sbs.parse_args(["--quick", "--out", str(tmp_path / "o"), "--local-step-s", "0.1",
                           "--set-all", "inner.warmup_steps=5"])
    clean = sbs.configs(sbs.compare_args(args), "clean", None)
    assert {c["inner"]["warmup_steps"] for c in clean.values()} == {5}
    for bad, said in (("inner.warmup_stepz=5", "warmup_stepz"), ("pools.0.islands=2", "the scenarios'"),
                      ("health.warm_spares=2", "the scenarios'")):
        with pytest.raises(SystemExit) as exit_info:
            sbs.parse_args(["--quick", "--out", str(tmp_path / "bad"), "--set-all", bad])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_ratios_are_torchfts_time_to_the_worst_final_loss_over_decoupleds_and_kept_throughput_is_against_its_own_clean_run():
    clean = {"decoupled": summary(2.0, [(0, 5.0), (10, 2.0)], 100, 100),
             "sync-diloco": summary(2.1, [(0, 5.0), (40, 2.1)], 100, 100),
             "torchft": summary(2.1, [(0, 5.0), (40, 2.1)], 100, 100)}
    faults = {"decoupled": summary(2.0, [(0, 5.0), (10, 2.0)], 90, 100),
              "sync-diloco": summary(2.2, [(0, 5.0), (80, 2.2)], 60, 100),
              "torchft": summary(2.2, [(0, 5.0), (60, 2.2)], 50, 100)}
    res = sbs.analyse([{"clean": clean, "faults": faults}])
    assert res["clean"]["target_loss"] == 2.1 and res["faults"]["target_loss"] == 2.2
    # decoupled crosses 2.2 at 28/30 of 10 s (linear between 5.0 and 2.0), torchft at 60 s
    assert res["faults"]["torchft_over_decoupled"] == pytest.approx(60 / (10 * 2.8 / 3.0))
    tft = res["faults"]["median"]["torchft"]
    assert tft["kept_vs_clean"] == pytest.approx((50 / 60) / (100 / 40)) and tft["tokens_lost"] == 50
    assert res["faults"]["decoupled_loss_vs_torchft"] == pytest.approx(2.0 / 2.2 - 1)
    text = sbs.table(res, ["a note"])
    assert "PASS: faults" in text and "a note" in text


@pytest.mark.slow
def test_torchft_diloco_computes_what_our_sync_diloco_mode_computes(tmp_path):
    pytest.importorskip("torchft")
    equiv = load("torchft_equivalence")
    cfg = equiv.equivalence_config(islands=2, sync_every=5, outer_steps=2)
    a, pa = equiv.ours(cfg, 2)
    b, pb, summary_ = equiv.theirs(cfg, tmp_path / "torchft")
    assert summary_["participants_per_commit"] == [2, 2] and len(a[0]) == len(b[0]) == 10
    # Before AdamW's warmup ends (20 steps) the rounding differences stay at float32's level.
    assert max(equiv.step_differences(a, b, 5)) < 1e-5
    assert equiv.param_difference(pa, pb) < 1e-4
