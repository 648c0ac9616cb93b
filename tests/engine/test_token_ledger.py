"""One ledger: every token count a run shows (summary.json, the final table, report.md, the islands' rows) comes
from the token ledger, and processed = merged + refused + in flight + lost + overwritten exactly, in every
fragment and in every table, at each moment a kill or an interruption can land (issue 60, item 1).

Pure functions over hand-built island statuses and outer-optimizer ledgers (orchestrator/core/accounting.py,
orchestrator/run/results.py, orchestrator/run/summary.py, orchestrator/run/report.py); no Ray. Two fragments,
512 tokens a step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from islands.spec import IslandStatus
from orchestrator.config import build_config
from orchestrator.core.accounting import (
    FATES,
    incarnation_tokens,
    no_tokens,
    resumed_ledger,
    session_received,
    shown_fates,
    token_fates,
)
from orchestrator.run.ledger import SessionLedger
from orchestrator.run.report import _summary_rows
from orchestrator.run.results import SessionRecord, run_summary
from orchestrator.run.summary import format_summary

P = 2


def status(island: int, incarnation: int, *, tokens: int, submitted: list[int], unsubmitted: list[int] | None = None,
           outbox: list[int] | None = None, discarded: list[int] | None = None, overwritten: list[int] | None = None,
           state: str = "stopped") -> IslandStatus:
    """An island's status; by its own books tokens = submitted + unsubmitted + discarded + overwritten per fragment."""
    unsubmitted, discarded, overwritten = unsubmitted or [0] * P, discarded or [0] * P, overwritten or [0] * P
    for p in range(P):
        assert tokens == submitted[p] + unsubmitted[p] + discarded[p] + overwritten[p], "a status that adds up"
    return IslandStatus(island=island, incarnation=incarnation, pool="fast", state=state, steps=tokens // 512,
                        tokens=tokens, train_loss=2.0, step_time_s=0.1, versions=[1] * P, unsubmitted_tokens=unsubmitted,
                        outbox_tokens=outbox or [0] * P, inflight=0, cursor=tokens // 512, submitted_tokens=submitted,
                        discarded_tokens=discarded, overwritten_tokens=overwritten)


def outer_ledger(merged: list[int], refused: list[int] | None = None, pending: list[int] | None = None,
                 late: list[int] | None = None) -> dict[str, list[int]]:
    return {"merged": merged, "refused": refused or [0] * P, "pending": pending or [0] * P, "late": late or [0] * P}


def assert_adds_up(ledger: dict[str, list[int]]) -> None:
    assert len(set(ledger["processed"])) == 1, f"one processed count in every fragment: {ledger['processed']}"
    for p in range(len(ledger["processed"])):
        assert ledger["processed"][p] == sum(ledger[f][p] for f in FATES), (p, ledger)
        assert all(ledger[f][p] >= 0 for f in FATES), (p, ledger)


# ----------------------------------------------------------------------------- the summary and the tables


def summarize(*, live: list[IslandStatus], dead: list[IslandStatus], ledger: dict, received: list,
              before: dict | None = None, first_inc: dict[int, int] | None = None) -> dict:
    """summary.json as Run._finish writes it, from these statuses and this stopped outer optimizer's ledger."""
    cfg = build_config({"outer": {"num_fragments": P}})
    first_inc = first_inc or {0: 1, 1: 1}
    got = session_received(received, first_inc)
    fates = token_fates(fragments=P, ledger=ledger, received=got, live=live, dead=dead, before=before)
    counted = incarnation_tokens(live, dead, got)
    slots = {i: {"island": i, "pool": "fast", "node": "n", "failures": 0, "restarts": 0, "state": "stopped",
                 "incarnation": max([s.incarnation for s in live + dead if s.island == i], default=first_inc[i]),
                 "status": next((s for s in live if s.island == i), None),
                 "finals": [s for s in dead if s.island == i]} for i in (0, 1)}
    traffic = {"rounds": 4, "refusals": 0, "versions": [2, 2], "bytes_up": 1, "bytes_down": 1, "bytes_by_link": {},
               "transfers_by_link": {}, "network_wait_s": {}}
    good = {"goodput": 0.8, "uptime": 0.9, "fill_s": 1.0, "time_by_state_s": {}, "useful_s": 8.0, "allocated_s": 10.0,
            "run_end": 10.0}
    record = SessionRecord(
        cfg=cfg, snapshot={"slots": slots, "timeline": [], "detect_s": [], "rejoin_s": []}, first_inc=first_inc,
        live=live, dead=dead, fates=fates, counted=counted, good=good, status=traffic,
        final_eval={"eval_loss": 2.0, "eval_bits_per_byte": 2.9}, wall=10.0, faults=[], eval_points=[], before=before,
        before_flush_loss=None, raw_loss=None, unigram_bpb=4.8, faults_planned=0, network="no network emulation",
        network_emulated=False, stopped_by="token_budget", run_start=0.0, resumed=before is not None, corpus="synthetic")
    return run_summary(record)


def _table(summary: dict) -> dict[str, str]:
    """The final table's rows, field -> value (two or more spaces apart)."""
    return {m[1].strip(): m[2] for m in map(re.compile(r"^(\s*\S.*?)\s{2,}(\S.*)$").match,
                                             format_summary(summary).splitlines()) if m}


def _number(cell: str) -> int:
    return int(cell.split(" ")[0].rstrip(",").replace(",", ""))


def assert_shown_everywhere(summary: dict) -> None:
    """summary.json, the final table, report.md and the islands' rows all add up to tokens processed (the
    integration tests that kill and resume real runs check their summaries with it too)."""
    ledger = summary["token_ledger"]
    assert_adds_up(ledger)
    if summary["token_ledger_before"]:
        assert_adds_up(summary["token_ledger_before"])
    assert summary["tokens_processed"] == ledger["processed"][0], "one count: the table's is the ledger's"
    for f in FATES:
        assert summary[f"tokens_{f}"] == sum(ledger[f]) / len(ledger[f])
    # The final table: the fate rows under "tokens processed" add up to it.
    rows = _table(summary)
    names = {"merged": "merged", "lost": "lost", "refused": "refused", "in flight at stop": "in_flight",
             "overwritten": "overwritten"}
    shown = {fate: _number(rows[name]) for name, fate in names.items() if name in rows}
    assert _number(rows["tokens processed"]) == summary["tokens_processed"] == sum(shown.values()), rows
    assert all(shown_fates(ledger)[f] == 0 for f in FATES if f not in shown), "a fate without a row is 0"
    # report.md: the same numbers, in one row.
    report = dict(_summary_rows(summary)[0])
    parts = [int(x.replace(",", "")) for x in report["tokens merged / refused / lost / in flight / overwritten "
                                                    "(they add up to processed)"].split(" / ")]
    assert int(report["tokens processed"].replace(",", "")) == sum(parts) == summary["tokens_processed"]
    # The islands' rows: this session's part of processed, island by island.
    before = summary["token_ledger_before"]["processed"][0] if summary["token_ledger_before"] else 0
    assert sum(isl["tokens"] for isl in summary["islands"]) == summary["tokens_processed"] - before
    # The last evaluation (the evals events) was read from the final ledger.
    assert not summary["evals"] or summary["evals"][-1]["tokens_processed"] == summary["tokens_processed"]


def test_a_kill_during_a_submission_counts_what_the_outer_optimizer_received_in_every_fragment():
    """The issue's first bullet: island 1 was killed just after it cut fragment 0 (6 steps) and before its next
    heartbeat, which had said 4 steps. The outer optimizer received 3,072 tokens of fragment 0 from it. The old
    ledger counted processed [3072, 2048] while summary.json's tokens_processed said 2048 (the statuses' sum)."""
    dead = [status(1, 1, tokens=2048, submitted=[0, 0], unsubmitted=[2048, 2048], state="failed")]
    live = [status(0, 1, tokens=4096, submitted=[4096, 2048], unsubmitted=[0, 2048])]
    summary = summarize(live=live, dead=dead, ledger=outer_ledger(merged=[4096 + 3072, 2048]),
                        received=[[0, 1, [4096, 2048]], [1, 1, [3072, 0]]])
    assert summary["token_ledger"]["processed"] == [4096 + 3072] * P
    # Island 1's 3,072 tokens are in every fragment: merged in fragment 0, never received (lost) in fragment 1.
    assert summary["token_ledger"]["lost"] == [0, 3072] and summary["token_ledger"]["in_flight"] == [0, 2048]
    assert summary["islands"][1]["tokens"] == 3072, "its row counts what the ledger counts"
    assert_shown_everywhere(summary)


def test_a_kill_during_an_adoption_keeps_its_overwritten_progress_overwritten():
    """Island 1 was killed right after an overwrite adoption replaced 1,024 tokens of fragment 1's progress: they
    stay overwritten; what it never sent is lost."""
    dead = [status(1, 1, tokens=4096, submitted=[2048, 1024], unsubmitted=[2048, 2048], overwritten=[0, 1024],
                   state="failed")]
    live = [status(0, 1, tokens=2048, submitted=[2048, 0], unsubmitted=[0, 1024], overwritten=[0, 1024])]
    summary = summarize(live=live, dead=dead, ledger=outer_ledger(merged=[4096, 1024]),
                        received=[[0, 1, [2048, 0]], [1, 1, [2048, 1024]]])
    led = summary["token_ledger"]
    assert led["overwritten"] == [0, 2048] and led["lost"] == [2048, 2048] and led["in_flight"] == [0, 1024]
    assert_shown_everywhere(summary)


def test_a_kill_during_the_final_flush_counts_its_last_cut_and_the_late_ones():
    """The final flush: island 0 stopped and cut everything (its last cut of fragment 1 was taken after stop
    began: late, in flight); island 1 was killed while its flush cuts were on their way: the one that arrived was
    merged by the final rounds, after its last status; one submission still waited in an open round."""
    live = [status(0, 1, tokens=3072, submitted=[3072, 3072])]
    dead = [status(1, 1, tokens=2048, submitted=[1024, 1024], unsubmitted=[1024, 1024], state="failed")]
    ledger = outer_ledger(merged=[3072 + 2560, 1024], pending=[0, 1024], late=[0, 2048])
    summary = summarize(live=live, dead=dead, ledger=ledger, received=[[0, 1, [3072, 3072]], [1, 1, [2560, 1024]]])
    led = summary["token_ledger"]
    assert led["processed"] == [3072 + 2560] * P  # island 1 processed at least the 2,560 tokens it sent
    assert led["in_flight"] == [0, 1024 + 2048] and led["lost"] == [0, 2560 - 1024]
    assert_shown_everywhere(summary)


def test_a_kill_of_the_outer_optimizer_during_a_checkpoint_write_loses_the_undone_merges():
    """The outer optimizer died while writing a checkpoint; the torn one was skipped and the one before it
    restored, so the 2,048 tokens merged since then were undone (received and merged counts restored with it).
    The islands resynced: their submissions since the checkpoint and their unsubmitted progress are lost."""
    live = [status(0, 1, tokens=4096, submitted=[3072, 2048], discarded=[1024, 2048]),
            status(1, 1, tokens=2048, submitted=[2048, 1024], unsubmitted=[0, 1024], state="training")]
    summary = summarize(live=live, dead=[], ledger=outer_ledger(merged=[2048 + 1024, 1024]),
                        received=[[0, 1, [2048, 1024]], [1, 1, [1024, 0]]])
    led = summary["token_ledger"]
    assert led["merged"] == [3072, 1024] and led["lost"] == [1024 + 1024 + 1024, 1024 + 2048 + 1024]
    assert led["in_flight"] == [0, 1024]
    assert_shown_everywhere(summary)


def test_a_salvage_of_an_incarnation_that_never_reported_is_still_counted():
    """An island salvaged before its first heartbeat: no status, but the outer optimizer merged its progress."""
    live = [status(0, 2, tokens=1024, submitted=[1024, 1024])]
    summary = summarize(live=live, dead=[], ledger=outer_ledger(merged=[1024 + 512, 1024 + 1024]),
                        received=[[0, 2, [1024, 1024]], [1, 1, [512, 1024]]], first_inc={0: 1, 1: 1})
    assert summary["token_ledger"]["processed"] == [2048] * P and summary["token_ledger"]["lost"] == [512, 0]
    assert_shown_everywhere(summary)


# ----------------------------------------------------------------------------- across a resume


def first_session() -> tuple[dict, dict]:
    """A finished first session (the final checkpoint's outer ledger and the extra its driver noted with it)."""
    live = [status(0, 1, tokens=4096, submitted=[4096, 3072], unsubmitted=[0, 1024]),
            status(1, 2, tokens=2048, submitted=[2048, 1024], overwritten=[0, 1024])]
    dead = [status(1, 1, tokens=1024, submitted=[0, 0], unsubmitted=[1024, 1024], state="failed")]
    ledger = outer_ledger(merged=[4096 + 1024, 3072], refused=[1024, 0], pending=[0, 1024])
    received = [[0, 1, [4096, 3072]], [1, 1, [0, 0]], [1, 2, [2048, 1024]]]
    fates = token_fates(fragments=P, ledger=ledger, received=session_received(received, {}), live=live, dead=dead)
    assert_adds_up(fates)
    extra = {"tokens_processed": fates["processed"][0], "token_ledger": fates, "token_ledger_before": None}
    return {"merged": ledger["merged"], "refused": ledger["refused"]}, {"extra": extra, "fates": fates}


def test_a_resume_keeps_the_earlier_sessions_fates_and_loses_what_was_in_flight():
    restored, first = first_session()
    before = resumed_ledger(fragments=P, restored=restored, extra=first["extra"])
    f = first["fates"]
    assert before["processed"] == f["processed"] and before["merged"] == f["merged"]
    assert before["refused"] == f["refused"] and before["overwritten"] == f["overwritten"]
    # What was in flight when it stopped is lost: the restore drops pending submissions, islands restart afresh.
    assert before["in_flight"] == [0] * P and before["lost"] == [f["lost"][p] + f["in_flight"][p] for p in range(P)]
    assert_adds_up(before)


@dataclass(frozen=True)
class _Spec:  # the part of an IslandSpec that SessionLedger.continue_incarnations reads and replaces
    island: int
    incarnation: int


def test_a_resumed_session_continues_each_islands_incarnations_above_the_checkpoints():
    """SessionLedger.resume (Run._restore): the earlier part of the ledger as of the checkpoint, and each island's
    incarnations above the last one the checkpoint's metadata or the outer optimizer's receipts know."""
    restored, first = first_session()
    extra = {**first["extra"], "incarnations": {"0": 1, "1": 1}}
    received = [[0, 1, [4096, 3072]], [1, 1, [0, 0]], [1, 2, [2048, 1024]]]
    book = SessionLedger(P)
    book.resume(restored=restored, extra=extra, acct={"useful_s": 7.5, "received": received})
    assert book.before == resumed_ledger(fragments=P, restored=restored, extra=extra) == book.current
    assert book.note() == {"tokens_processed": book.before["processed"][0], "token_ledger": book.before,
                           "token_ledger_before": book.before, "useful_s_before": 7.5}
    specs = book.continue_incarnations([_Spec(0, 1), _Spec(1, 1), _Spec(2, 1)])
    assert [(s.island, s.incarnation) for s in specs] == [(0, 2), (1, 3), (2, 1)]
    assert book.first_inc == {0: 2, 1: 3, 2: 1}
    # This session's receipts only: the earlier incarnations' are the checkpoint's, in `before`.
    assert book.received({"received": received + [[1, 3, [512, 0]]]}) == {(1, 3): [512, 0]}
    fresh = SessionLedger(P)
    assert fresh.continue_incarnations([_Spec(0, 1)]) == [_Spec(0, 1)] and fresh.before is None
    assert fresh.processed == 0 and fresh.first_inc == {0: 1}


def test_a_resumed_runs_table_adds_up_and_shows_the_interruptions_loss():
    """The issue's second bullet: after a resume the table said processed 3,012,608 of which merged 2,609,152,
    no lost row: the earlier session's fates had vanished while its processed count stayed."""
    restored, first = first_session()
    before = resumed_ledger(fragments=P, restored=restored, extra=first["extra"])
    # The second session: new incarnations above the first's; the outer optimizer's ledger counts the whole run.
    live = [status(0, 2, tokens=2048, submitted=[2048, 2048]), status(1, 3, tokens=1024, submitted=[1024, 0],
                                                                       unsubmitted=[0, 1024])]
    ledger = outer_ledger(merged=[restored["merged"][0] + 3072, restored["merged"][1] + 2048],
                          refused=restored["refused"])
    received = [[0, 1, [4096, 3072]], [1, 1, [0, 0]], [1, 2, [2048, 1024]], [0, 2, [2048, 2048]], [1, 3, [1024, 0]]]
    summary = summarize(live=live, dead=[], ledger=ledger, received=received, before=before, first_inc={0: 2, 1: 3})
    assert summary["tokens_processed"] == before["processed"][0] + 3072
    assert summary["token_ledger"]["lost"] == before["lost"], "what the interruption lost is shown as lost"
    rows = _table(summary)
    assert _number(rows["lost"]) == shown_fates(summary["token_ledger"])["lost"] > 0
    assert rows["of earlier sessions"].startswith(f"{before['processed'][0]:,} processed")
    assert_shown_everywhere(summary)


def test_a_checkpoint_written_after_the_drivers_last_note_still_adds_up():
    """The driver notes its ledger every tick; the checkpoint that a resume restores can hold a round merged
    after the note (more merged than the note's processed covers). The earlier session processed at least what
    the checkpoint merged and refused plus what was overwritten, in every fragment."""
    noted = {**no_tokens(P), "processed": [3072] * P, "merged": [2048, 1024], "lost": [1024, 2048]}
    extra = {"tokens_processed": 3072, "token_ledger": noted, "token_ledger_before": None}
    before = resumed_ledger(fragments=P, restored={"merged": [4096, 1024], "refused": [0, 0]}, extra=extra)
    assert before["processed"] == [4096] * P and before["lost"] == [0, 3072]
    assert_adds_up(before)


def test_a_checkpoint_of_an_older_driver_counts_the_whole_run_before_it_as_one_session():
    extra = {"tokens_processed": 1_531_904}  # what older drivers noted
    before = resumed_ledger(fragments=P, restored={"merged": [1_480_704, 1_470_000], "refused": [0, 2048]}, extra=extra)
    assert before["processed"] == [1_531_904] * P and before["lost"] == [51_200, 1_531_904 - 1_472_048]
    assert_adds_up(before)


def test_a_second_resume_adds_the_second_sessions_part_to_the_first():
    restored, first = first_session()
    before = resumed_ledger(fragments=P, restored=restored, extra=first["extra"])
    # The second session was interrupted with 2,048 more merged in each fragment and 3,072 tokens noted.
    noted = {k: [before[k][p] + extra for p in range(P)]
             for k, extra in (("processed", 3072), ("merged", 2048), ("refused", 0), ("in_flight", 1024),
                              ("lost", 0), ("overwritten", 0))}
    extra = {"tokens_processed": noted["processed"][0], "token_ledger": noted, "token_ledger_before": before}
    again = resumed_ledger(fragments=P, restored={"merged": [m + 2048 for m in before["merged"]],
                                                  "refused": before["refused"]}, extra=extra)
    assert again["processed"] == [before["processed"][0] + 3072] * P
    assert again["lost"] == [before["lost"][p] + 1024 for p in range(P)]
    assert_adds_up(again)


# ----------------------------------------------------------------------------- rounding and the live view


def test_the_tables_round_fragment_means_so_that_the_rows_add_up():
    """Three fragments: means in thirds of a token. Rounded one by one, merged 1,707 + lost 683 + in flight 171 would
    be 2,561; the largest remainders (here all equal: the fates' order breaks the tie) take the rounding up."""
    ledger = {"processed": [2560] * 3, "merged": [2048, 1536, 1536], "refused": [0] * 3, "in_flight": [512, 0, 0],
              "lost": [0, 1024, 1024], "overwritten": [0] * 3}
    shown = shown_fates(ledger)
    assert shown["processed"] == 2560 == sum(shown[f] for f in FATES)
    assert (shown["merged"], shown["in_flight"], shown["lost"]) == (1707, 171, 682)


def test_a_status_older_than_the_ledger_never_counts_a_token_twice():
    """A live read: island 0's status shows fragment 1's progress unsubmitted, but the outer optimizer already
    holds that cut (pending). The in-flight claim is capped at what the island's count leaves."""
    live = [status(0, 1, tokens=2048, submitted=[2048, 0], unsubmitted=[0, 2048], state="training")]
    fates = token_fates(fragments=P, ledger=outer_ledger(merged=[2048, 0], pending=[0, 2048]),
                        received={(0, 1): [2048, 2048]}, live=live, dead=[])
    assert fates["in_flight"] == [0, 2048] and fates["lost"] == [0, 0]
    assert_adds_up(fates)


@pytest.mark.parametrize("before", [None, "resumed"])
def test_a_fresh_or_resumed_session_with_nothing_trained_yet_is_its_earlier_part(before):
    restored, first = first_session()
    prior = resumed_ledger(fragments=P, restored=restored, extra=first["extra"]) if before else None
    ledger = outer_ledger(merged=list(restored["merged"]), refused=list(restored["refused"])) if before else outer_ledger([0, 0])
    fates = token_fates(fragments=P, ledger=ledger, received={}, live=[], dead=[], before=prior)
    assert fates == (prior or no_tokens(P))
