"""Every token has a fate, and goodput is useful time over allocated time (docs/architecture.md section 6).

The run's token ledger, per fragment p (each inner step's tokens count once for every fragment):

  processed_p = merged_p + refused_p + in_flight_p + lost_p + overwritten_p

exactly, and processed_p is one number for every p. Every count a user sees (the final table, summary.json,
the events, the metrics, report.md, `diloco status`) is read from it. From independent sources:

- merged, refused: the outer optimizer's ledger (the checkpoint's counts when a session resumed);
- processed: per incarnation, the larger of its last reported token count and the most the outer optimizer
  received from it in any one fragment (a step's tokens count in every fragment; work after the incarnation's
  last report is seen only through what it sent). That count is the incarnation's tokens in every fragment;
- in flight at stop: pending in the outer optimizer, taken after stop began, in live islands' outboxes, and
  not yet cut into a submission;
- overwritten: progress an `overwrite` adoption replaced before it was cut (the island's own or another
  island's round published fragment p over it), as the islands count it;
- lost: the rest of each incarnation's count in fragment p: submitted tokens the outer optimizer never
  received (dropped on the way, or received by an outer optimizer that then restored an older checkpoint),
  progress a resync threw away, and everything a dead incarnation never sent.

An island's claims (in flight, overwritten) are capped at what its count leaves after what was received, so a
status older than the ledger (a live read) never counts a token twice. A resumed run adds the earlier sessions'
ledger as of the checkpoint it restored (`resumed_ledger`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policies.goodput import goodput_report, merge_timeline, pipeline_full_at, uptime_window_from_rounds
from policies.island_states import IslandState

FATES = ("merged", "refused", "in_flight", "lost", "overwritten")  # every processed token has exactly one
LEDGER_KEYS = ("processed", *FATES)


def no_tokens(fragments: int) -> dict[str, list[int]]:
    """A ledger of nothing: every fate 0 in each of `fragments` fragments."""
    return {k: [0] * fragments for k in LEDGER_KEYS}


def add_ledgers(a: Mapping[str, Sequence[int]], b: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """Two ledgers' counts added, fate by fate and fragment by fragment."""
    return {k: [x + y for x, y in zip(a[k], b[k], strict=True)] for k in LEDGER_KEYS}


def session_received(rows: Iterable[Sequence[Any]], first_inc: Mapping[int, int]) -> dict[tuple[int, int], list[int]]:
    """The outer optimizer's received rows ([island, incarnation, per-fragment tokens]) of this driver session's
    incarnations: those at or above `first_inc[island]` (1 for a slot it lacks). An earlier session's are in the
    ledger it left (`resumed_ledger`)."""
    return {(int(i), int(inc)): list(toks) for i, inc, toks in rows if inc >= first_inc.get(int(i), 1)}


def incarnation_tokens(live: Iterable[Any], dead: Iterable[Any],
                       received: Mapping[tuple[int, int], Sequence[int]]) -> dict[tuple[int, int], int]:
    """Tokens each (island, incarnation) processed, as the ledger counts them: the larger of its last reported
    count and the most the outer optimizer received from it in one fragment. An incarnation the outer optimizer
    heard from but whose status never came (e.g. salvaged before its first report) counts what it sent."""
    out = {(st.island, st.incarnation): st.tokens for st in [*live, *dead]}
    for key, got in received.items():
        out[key] = max(out.get(key, 0), max(got, default=0))
    return out


def token_fates(
    *,
    fragments: int,
    ledger: dict[str, list[int]],
    received: dict[tuple[int, int], list[int]],
    live: Iterable[Any],
    dead: Iterable[Any],
    before: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, list[int]]:
    """The run's ledger: per-fragment processed / merged / refused / in_flight / lost / overwritten token counts.

    `ledger`: the outer optimizer's (merged, refused, pending, late per fragment; merged and refused count the
    whole run, a resumed one's included); `live` and `dead`: island statuses (islands.spec.IslandStatus) of this
    session's live and dead incarnations; `received`: (island, incarnation) -> per-fragment tokens the outer
    optimizer received from this session's incarnations (`session_received`); `before`: the earlier sessions'
    ledger (`resumed_ledger`), None for a fresh run. processed = the sum of the fates, exactly, in every fragment.
    """
    P = fragments
    prior = before or no_tokens(P)
    merged = [ledger["merged"][p] - prior["merged"][p] for p in range(P)]
    refused = [ledger["refused"][p] - prior["refused"][p] for p in range(P)]
    in_flight = [ledger["pending"][p] + ledger["late"][p] for p in range(P)]
    lost, overwritten, processed = [0] * P, [0] * P, [0] * P
    live, dead = list(live), list(dead)
    statuses = {(st.island, st.incarnation): (st, True) for st in live}
    statuses.update({(st.island, st.incarnation): (st, False) for st in dead})  # a dead status is the later one
    zero = [0] * P
    for key, seen in incarnation_tokens(live, dead, received).items():
        st, alive = statuses.get(key, (None, False))
        got = received.get(key, zero)
        for p in range(P):
            processed[p] += seen
            room = seen - got[p]  # what it processed that the outer optimizer did not receive
            waiting = 0
            if alive:
                # What the outer optimizer already received cannot still be in the outbox (a status older than
                # the ledger: seen with fast steps, a stale outbox figure counted 128 tokens twice).
                outbox = min(_at(st.outbox_tokens, p), max(0, _at(st.submitted_tokens, p) - got[p]))
                waiting = min(outbox + _at(st.unsubmitted_tokens, p), room)
            gone = min(_at(st.overwritten_tokens, p) if st is not None else 0, room - waiting)
            in_flight[p] += waiting
            overwritten[p] += gone
            lost[p] += room - waiting - gone
    session = {"processed": processed, "merged": merged, "refused": refused, "in_flight": in_flight, "lost": lost,
               "overwritten": overwritten}
    return add_ledgers(prior, session)


def kept_accounting(seen: Mapping[str, Any] | None, read: Mapping[str, Any]) -> dict:
    """The outer optimizer's accounting() `read` now, with the version advances and each island's first merge that
    the earlier reads (`seen`, this function's last result; None at the first) held added.

    A restarted outer optimizer restores its checkpoint, which holds neither: the driver keeps them across restarts,
    or uptime would count only from the last restart (found by benchmarks/soak.py: a fill of 454 s in a 600 s run,
    the outer optimizer killed at 442 s). The advances it made after its checkpoint and before the kill stay counted:
    versions did advance then, in wall time, as far as every island could see."""
    if seen is None:
        return dict(read)
    first = dict(seen["first_merged"])
    for island, at in read["first_merged"].items():
        first[island] = min(at, first.get(island, at))
    return {**read, "advances": sorted(set(seen["advances"]) | set(read["advances"])), "first_merged": first}


def resumed_ledger(*, fragments: int, restored: Mapping[str, Sequence[int]], extra: Mapping[str, Any]) -> dict[str, list[int]]:
    """The ledger of a run's earlier driver sessions, as of the checkpoint a resume restored (docs/architecture.md
    section 6, "Across a resume").

    `restored`: the restored outer optimizer's ledger (merged and refused per fragment, the checkpoint's);
    `extra`: the driver metadata saved with that checkpoint (its `token_ledger` and `token_ledger_before`, as the
    session that wrote it noted them). That session's tokens keep the fates they had at the checkpoint: merged
    and refused as the checkpoint counts them, overwritten as its driver last noted; it processed what its driver
    last noted (or more: at least what the checkpoint merged and refused plus what was overwritten, in every
    fragment), and everything else it processed is lost to the interruption: what was in flight, since the
    restore discards pending submissions and the islands restart from the checkpoint's versions. Work after the
    checkpoint is not counted: the run goes on from the checkpoint. A checkpoint from before these records (only
    `tokens_processed`) counts the whole run before it as one session.
    """
    P = fragments
    before = extra.get("token_ledger_before") or no_tokens(P)
    noted = extra.get("token_ledger")
    if noted is None or any(restored[k][p] < before[k][p] for k in ("merged", "refused") for p in range(P)):
        before, processed, overwritten = no_tokens(P), int(extra.get("tokens_processed", 0)), [0] * P
    else:
        processed = noted["processed"][0] - before["processed"][0]
        overwritten = [max(0, noted["overwritten"][p] - before["overwritten"][p]) for p in range(P)]
    merged = [restored["merged"][p] - before["merged"][p] for p in range(P)]
    refused = [restored["refused"][p] - before["refused"][p] for p in range(P)]
    processed = max([processed] + [merged[p] + refused[p] + overwritten[p] for p in range(P)])
    session = {"processed": [processed] * P, "merged": merged, "refused": refused, "in_flight": [0] * P,
               "lost": [processed - merged[p] - refused[p] - overwritten[p] for p in range(P)],
               "overwritten": overwritten}
    return add_ledgers(before, session)


def shown_fates(ledger: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """The ledger as one row per fate, as the tables print it: each fate's fragment mean, rounded so that the
    rows add up to processed exactly (largest remainders get the rounding up), and processed itself."""
    P = len(ledger["processed"])
    processed = round(sum(ledger["processed"]) / P)
    totals = {k: sum(ledger.get(k) or []) for k in FATES}  # a summary from before a fate existed lacks it
    if sum(totals.values()) != P * processed:  # a ledger that does not add up (an old summary.json): plain means
        return {"processed": processed, **{k: round(t / P) for k, t in totals.items()}}
    shown = {k: t // P for k, t in totals.items()}
    for k in sorted(FATES, key=lambda k: -(totals[k] % P))[:processed - sum(shown.values())]:
        shown[k] += 1
    return {"processed": processed, **shown}


def _at(counts: Sequence[int], p: int) -> int:
    # Statuses from before a field existed (a resumed run's parked finals) have an empty list.
    return counts[p] if p < len(counts) else 0


def first_placement(timeline: Sequence[tuple[float, int, int, str]], islands: int) -> list[int]:
    """The slots placed at the run's start: all but those of elastic pools that went vacant before they trained
    (they join later, if ever, and the pipeline fill does not wait for them)."""
    out = []
    for island in range(islands):
        states = [state for _, i, _, state in sorted(timeline, key=lambda e: e[0]) if i == island]
        vacant = states.index(IslandState.VACANT) if IslandState.VACANT in states else len(states)
        if not any(state in (IslandState.TRAINING, IslandState.DEAD) for state in states[:vacant]) and vacant < len(states):
            continue
        out.append(island)
    return out


def capacity_s(timeline: Sequence[tuple[float, int, int, str]], *, islands: int, run_start: float, run_end: float) -> float:
    """Island seconds the run had: every slot over the run, less the time elastic slots were vacant."""
    intervals = merge_timeline([e for e in timeline if e[0] <= run_end and e[3] != IslandState.STOPPED], end=run_end)
    vacant = sum(max(0.0, min(iv.end, run_end) - max(iv.start, run_start)) for iv in intervals if iv.state == IslandState.VACANT)
    return max(islands * (run_end - run_start) - vacant, 0.0)


def run_goodput(
    *,
    timeline: Sequence[tuple[float, int, int, str]],
    useful_s: float,
    run_start: float,
    run_end: float,
    islands: int,
    advances: Sequence[float],
    fates: dict[str, list[int]],
    stop_began: float | None = None,
    first_merged: Mapping[int, float] | None = None,
) -> dict:
    """Goodput, uptime and time per island state for the run, from the health monitor's timeline.

    `stop_began` (wall clock) ends uptime's clock; None: `run_end` (a live run). `first_merged`: island ->
    wall time of its first merged round (the outer optimizer's accounting); uptime's clock starts at the first
    advance once every island was merged or failed (policies.goodput.pipeline_full_at), or at the first
    advance when not given.
    """
    P = len(fates["merged"])
    mean = lambda xs: round(sum(xs) / P)  # noqa: E731 - token counts are per fragment; report the mean
    until = run_end if stop_began is None else min(max(stop_began, run_start), run_end)
    failed: dict[int, float] = {}
    for at, island, _, state in timeline:
        if state == IslandState.DEAD:
            failed[island] = min(at, failed.get(island, at))
    full = None if first_merged is None else pipeline_full_at(first_placement(timeline, islands), first_merged, failed)
    start = run_start if full is None else min(max(run_start, full), until)
    inside = [t for t in advances if start <= t <= until]
    window = uptime_window_from_rounds(inside)
    report = goodput_report(
        intervals=merge_timeline([e for e in timeline if e[0] <= run_end and e[3] != IslandState.STOPPED], end=run_end),
        useful_s=min(useful_s, capacity_s(timeline, islands=islands, run_start=run_start, run_end=run_end)),
        run_start=run_start, run_end=run_end, islands=islands, version_advances=inside, uptime_window_s=window,
        tokens_merged=mean(fates["merged"]), tokens_lost=mean(fates["lost"]), tokens_refused=mean(fates["refused"]),
        tokens_in_flight=mean(fates["in_flight"]), tokens_overwritten=mean(fates["overwritten"]),
        uptime_until=until, fill_until=start,
    )
    return {"goodput": report.goodput, "uptime": report.uptime, "uptime_window_s": window, "fill_s": report.fill_s,
            "allocated_s": report.allocated_s, "useful_s": report.useful_s, "time_by_state_s": report.by_state_s,
            "run_end": run_end}
