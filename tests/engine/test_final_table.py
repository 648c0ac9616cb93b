"""What `diloco train` prints: the progress line before the first loss, and the final table of a run with
failures and a chaos tape that did not all fire (pure functions over a summary dict; no Ray)."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

from islands.spec import IslandStatus
from orchestrator.cli.train import ProgressBar
from orchestrator.config import build_config
from orchestrator.run.results import _island_rows
from orchestrator.run.summary import faults_cell, format_summary

# A chaos run as the issue saw it: 5 of 8 kills fired before the token budget ran out.
CHAOS = {"mode": "decoupled", "eval_loss": 2.0, "eval_bits_per_byte": 2.9, "unigram_bits_per_byte": 4.8,
         "tokens_processed": 1_521_664, "tokens_merged": 1_507_328.0, "tokens_refused": 0.0, "tokens_lost": 14_336.0,
         "tokens_in_flight": 0.0, "tokens_overwritten": 0.0, "salvaged_tokens": 8_192.0,
         "goodput": 0.885, "uptime": 0.97, "failures": 5, "restarts": 5, "mean_time_to_detect_s": 0.4,
         "mean_time_to_rejoin_s": 9.1, "faults_planned": 8, "faults_injected": 5, "faults_skipped": 0,
         "stopped_by": "token_budget", "rounds": 30, "refusals": 0, "bytes_sent": 2e6, "wall_s": 60.0,
         "emulation": None, "network_emulated": False,
         "islands": [{"island": 1, "pool": "fast", "incarnations": 3, "steps": 180, "tokens": 481_280, "state": "stopped"},
                     {"island": 2, "pool": "fast", "incarnations": 1, "steps": 64, "tokens": 131_072, "state": "stopped"}]}


def _rows(summary: dict) -> dict[str, str]:
    """The table's rows, field -> value (a field and its value are two or more spaces apart)."""
    return {m[1].strip(): m[2] for m in map(re.compile(r"^(\s*\S.*?)\s{2,}(\S.*)$").match,
                                             format_summary(summary).splitlines()) if m}


def test_a_chaos_run_shows_failures_goodput_and_where_its_tokens_went():
    rows = _rows(CHAOS)
    assert rows["failures / restarts"] == "5 / 5 (detected in 0.4 s, rejoined in 9.1 s on average)"
    assert rows["goodput"] == "0.885, uptime 0.970 (from the first version advance after every island was merged)"
    assert rows["faults fired"] == "5 of 8 planned (the token budget ran out first)"
    # processed against merged is explained: the difference is the lost row.
    assert rows["tokens processed"] == "1,521,664, of which"
    assert rows["merged"] == "1,507,328" and rows["lost"].startswith("14,336 (never received")
    assert rows["salvaged from failed islands"].startswith("8,192 (sent by progress keepers")
    assert "refused" not in rows and "overwritten" not in rows, "fates that are 0 add no row"


def test_each_island_counts_steps_and_tokens_over_all_its_incarnations():
    rows = _rows(CHAOS)
    assert rows["island 1 (fast)"] == "3 incarnations, 180 steps, 481,280 tokens, stopped"
    assert rows["island 2 (fast)"] == "64 steps, 131,072 tokens, stopped"


def test_a_run_without_failures_or_chaos_has_no_failure_or_fault_rows():
    quiet = {**CHAOS, "failures": 0, "restarts": 0, "tokens_lost": 0.0, "salvaged_tokens": 0.0, "faults_planned": 0,
             "faults_injected": 0, "mean_time_to_detect_s": None, "mean_time_to_rejoin_s": None}
    rows = _rows(quiet)
    assert not {"failures / restarts", "faults fired", "lost", "salvaged from failed islands"} & set(rows)
    assert rows["goodput"].startswith("0.885")


def test_the_faults_cell_says_how_many_fired_and_why_not_all():
    assert faults_cell({**CHAOS, "faults_injected": 8}) == "8 of 8 planned"
    assert faults_cell({**CHAOS, "faults_skipped": 2}) == "5 of 8 planned (2 skipped; 1 left: the token budget ran out first)"
    assert faults_cell({**CHAOS, "faults_skipped": 3}) == "5 of 8 planned (3 skipped)"
    assert faults_cell({**CHAOS, "stopped_by": "max_wall_s"}) == "5 of 8 planned (run.max_wall_s ran out first)"
    assert faults_cell({"faults_injected": 0}) is None, "a summary from before faults_planned: no row"


def _island_status(incarnation: int, steps: int) -> IslandStatus:
    return IslandStatus(island=1, incarnation=incarnation, pool="fast", state="training", steps=steps,
                        tokens=steps * 512, train_loss=2.0, step_time_s=0.1, versions=[0], unsubmitted_tokens=[0],
                        outbox_tokens=[0], inflight=0, cursor=steps)


def test_the_summary_rows_of_an_island_sum_its_dead_incarnations():
    """Island 1 died twice (after 50 and 66 steps) and its third incarnation took 64: 180 steps, not 64."""
    slot = {"island": 1, "pool": "fast", "node": "n", "incarnation": 3, "failures": 2, "restarts": 2, "state": "stopped",
            "status": _island_status(3, 64), "finals": [_island_status(1, 50), _island_status(2, 66)]}
    cfg = build_config({})
    (row,) = _island_rows(cfg, {1: slot}, first_inc={1: 1})
    assert (row["incarnations"], row["incarnation"], row["steps"], row["tokens"]) == (3, 3, 180, 180 * 512)
    # a resumed session that started at incarnation 3 counts its own
    assert _island_rows(cfg, {1: slot}, first_inc={1: 3})[0]["incarnations"] == 1


def _progress(**kw) -> SimpleNamespace:
    p = dict(tokens=0, budget=1_000_000, versions=[0], rounds=0, train_loss=None, eval_bpb=None, elapsed_s=3.0,
             islands={"fast/0": "starting", "fast/1": "starting", "slow/2": "training"}, unit="byte")
    return SimpleNamespace(**{**p, **kw})


def test_the_progress_line_shows_a_dash_not_nan_before_the_first_loss():
    out = io.StringIO()
    bar = ProgressBar(out, emulation=None)
    bar(_progress())
    line = out.getvalue().strip()
    assert "nan" not in line
    assert "| bits/byte: train -, held-out - |" in line
    assert line.endswith("islands 2 starting, 1 training")
    out2 = io.StringIO()
    ProgressBar(out2, emulation=None)(_progress(tokens=1_000_000, train_loss=2.5, eval_bpb=0.0))
    assert "| bits/byte: train 3.607, held-out 0.000 |" in out2.getvalue()  # 2.5 nats = 3.607 bits


def test_the_progress_line_carries_one_unit_and_no_escape_codes_off_a_terminal():
    # The islands' train loss is in nats, the evaluation in bits: shown side by side they read as one scale.
    out = io.StringIO()
    ProgressBar(out, emulation=None)(_progress(tokens=1_000_000, train_loss=2.0, eval_bpb=3.0, unit="token"))
    line = out.getvalue().strip()
    assert "nats" not in line and line.count("bits/") == 1 and "bits/token: train 2.885, held-out 3.000" in line
    assert "\x1b" not in line
