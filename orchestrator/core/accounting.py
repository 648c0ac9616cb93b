"""Every token has a fate, and goodput is useful time over allocated time (docs/architecture.md section 6).

Per fragment p (each inner step's tokens count once for every fragment), from independent sources:

  processed_p = merged_p + refused_p + in_flight_p + lost_p + overwritten_p

- merged, refused: the outer optimizer's ledger (since this driver session began);
- in flight at stop: pending in the outer optimizer, taken after stop began, in live islands' outboxes,
  and not yet cut into a submission;
- lost: for a live incarnation, submitted tokens the outer optimizer never received (dropped on the
  way, or received by an outer optimizer that then restored an older checkpoint) plus unsubmitted
  progress thrown away by a resync; for a dead incarnation, everything it processed that the outer
  optimizer never received;
- overwritten: progress an `overwrite` adoption replaced before it was cut (the island's own or another
  island's round published fragment p over it), as the islands count it;
- processed: live incarnations' token counts, and for dead ones the larger of their last reported
  count and what the outer optimizer received from them (work after the last heartbeat is unseen).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policies.goodput import goodput_report, merge_timeline, pipeline_full_at, uptime_window_from_rounds


def token_fates(
    *,
    fragments: int,
    ledger: dict[str, list[int]],
    baseline: dict[str, list[int]] | None,
    received: dict[tuple[int, int], list[int]],
    live: Iterable[Any],
    dead: Iterable[Any],
) -> dict[str, list[int]]:
    """Per-fragment processed / merged / refused / in_flight / lost / overwritten token counts.

    `live` and `dead` are island statuses (islands.island.IslandStatus) of live and dead incarnations;
    `received` maps (island, incarnation) to per-fragment tokens the outer optimizer received;
    `baseline` is the ledger at the start of this driver session (after a resume), subtracted.
    """
    P = fragments
    base = baseline or {"merged": [0] * P, "refused": [0] * P}
    merged = [ledger["merged"][p] - base["merged"][p] for p in range(P)]
    refused = [ledger["refused"][p] - base["refused"][p] for p in range(P)]
    in_flight = [ledger["pending"][p] + ledger["late"][p] for p in range(P)]
    lost = [0] * P
    overwritten = [0] * P
    processed = [0] * P
    zero = [0] * P
    for st in live:
        got = received.get((st.island, st.incarnation), zero)
        for p in range(P):
            # The status is older than the ledger: what the outer optimizer already received cannot still
            # be in the outbox (seen with fast steps: a stale outbox figure counted 128 tokens twice).
            outbox = min(st.outbox_tokens[p], max(0, st.submitted_tokens[p] - got[p]))
            in_flight[p] += outbox + st.unsubmitted_tokens[p]
            lost[p] += st.submitted_tokens[p] - outbox - got[p] + st.discarded_tokens[p]
            overwritten[p] += _at(st.overwritten_tokens, p)
            processed[p] += st.tokens
    for st in dead:
        got = received.get((st.island, st.incarnation), zero)
        for p in range(P):
            seen = max(st.tokens, got[p])
            processed[p] += seen
            # What it overwrote by its last report was never going to be received; the rest is lost.
            gone = min(_at(st.overwritten_tokens, p), seen - got[p])
            overwritten[p] += gone
            lost[p] += seen - got[p] - gone
    return {"processed": processed, "merged": merged, "refused": refused, "in_flight": in_flight, "lost": lost,
            "overwritten": overwritten}


def _at(counts: Sequence[int], p: int) -> int:
    # Statuses from before a field existed (a resumed run's parked finals) have an empty list.
    return counts[p] if p < len(counts) else 0


def first_placement(timeline: Sequence[tuple[float, int, int, str]], islands: int) -> list[int]:
    """The slots placed at the run's start: all but those of elastic pools that went vacant before they trained
    (they join later, if ever, and the pipeline fill does not wait for them)."""
    out = []
    for island in range(islands):
        states = [state for _, i, _, state in sorted(timeline, key=lambda e: e[0]) if i == island]
        vacant = states.index("vacant") if "vacant" in states else len(states)
        if not any(state in ("training", "dead") for state in states[:vacant]) and vacant < len(states):
            continue
        out.append(island)
    return out


def capacity_s(timeline: Sequence[tuple[float, int, int, str]], *, islands: int, run_start: float, run_end: float) -> float:
    """Island seconds the run had: every slot over the run, less the time elastic slots were vacant."""
    intervals = merge_timeline([e for e in timeline if e[0] <= run_end and e[3] != "stopped"], end=run_end)
    vacant = sum(max(0.0, min(iv.end, run_end) - max(iv.start, run_start)) for iv in intervals if iv.state == "vacant")
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
        if state == "dead":
            failed[island] = min(at, failed.get(island, at))
    full = None if first_merged is None else pipeline_full_at(first_placement(timeline, islands), first_merged, failed)
    start = run_start if full is None else min(max(run_start, full), until)
    inside = [t for t in advances if start <= t <= until]
    window = uptime_window_from_rounds(inside)
    report = goodput_report(
        intervals=merge_timeline([e for e in timeline if e[0] <= run_end and e[3] != "stopped"], end=run_end),
        useful_s=min(useful_s, capacity_s(timeline, islands=islands, run_start=run_start, run_end=run_end)),
        run_start=run_start, run_end=run_end, islands=islands, version_advances=inside, uptime_window_s=window,
        tokens_merged=mean(fates["merged"]), tokens_lost=mean(fates["lost"]), tokens_refused=mean(fates["refused"]),
        tokens_in_flight=mean(fates["in_flight"]), tokens_overwritten=mean(fates["overwritten"]),
        uptime_until=until, fill_until=start,
    )
    return {"goodput": report.goodput, "uptime": report.uptime, "uptime_window_s": window, "fill_s": report.fill_s,
            "allocated_s": report.allocated_s, "useful_s": report.useful_s, "time_by_state_s": report.by_state_s,
            "run_end": run_end}
