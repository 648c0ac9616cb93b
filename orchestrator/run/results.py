"""What a finished driver session writes: the summary dict (summary.json) and the stop-time event tables.

`Run._finish` (orchestrator/run/driver.py) gathers the outcome from the actors into a `SessionRecord`, then
calls these. The summary's keys and order are what `diloco train`, the benchmarks and the notebooks read
(docs/metrics.md names them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from islands.spec import IslandStatus
from orchestrator.config import RunConfig
from orchestrator.core.eventlog import EventLog

if TYPE_CHECKING:  # the metrics import Ray, which `diloco train` imports only after its checks (emulation_note)
    from orchestrator.run.callbacks import Callbacks
    from orchestrator.run.metrics import RunMetrics


@dataclass(frozen=True)
class SessionRecord:
    """The outcome of one finished driver session, as `Run._finish` gathered it: all that `run_summary` reads.

    snapshot: the health monitor's last snapshot (slots, timeline, detections, salvages). first_inc: island ->
    this session's first incarnation. live, dead: the islands' last statuses. fates: the token ledger
    (orchestrator/core/accounting.py token_fates, per fragment); counted: (island, incarnation) -> tokens
    processed as the ledger counts them; before: the earlier sessions' part of the ledger (None for a fresh
    run). good: goodput's outcome (accounting.run_goodput). status: the stopped outer optimizer's status.
    final_eval: the final evaluation point; eval_points: every one of the session. The losses: before the final
    flush (None without run.final_flush), the raw global model's (None without run.average_window), the
    corpus's unigram baseline (None without a token stream). network: the network model's description.
    """

    cfg: RunConfig
    snapshot: dict
    first_inc: Mapping[int, int]
    live: list[IslandStatus]
    dead: list[IslandStatus]
    fates: dict
    counted: Mapping[tuple[int, int], int]
    good: dict
    status: dict
    final_eval: dict
    wall: float
    faults: list
    eval_points: list[dict]
    before: dict | None
    before_flush_loss: float | None
    raw_loss: float | None
    unigram_bpb: float | None
    faults_planned: int
    network: str
    network_emulated: bool
    stopped_by: str
    run_start: float
    resumed: bool
    corpus: str


def emulation_note(cfg: RunConfig) -> str | None:
    """The line every report carries when pool speeds are emulated by throttling."""
    parts = [f"{p.name} x{p.emulated_slowdown:g}" + (f" ±{p.emulated_jitter:.0%}" if p.emulated_jitter else "")
             for p in cfg.pools if p.emulated]
    return f"EMULATION: pool speeds emulated by throttling on one machine ({', '.join(parts)})" if parts else None


def record_stop_events(events: EventLog, snapshot: dict, live: list[IslandStatus], dead: list[IslandStatus],
                       faults: list, counted: Mapping[tuple[int, int], int] | None = None) -> None:
    """Add the islands, timeline, faults, detections and salvages tables of a stopped run to `events`.

    `counted`: (island, incarnation) -> tokens processed as the ledger counts them (accounting.incarnation_tokens),
    each island row's `tokens_processed` (its status's `tokens` when not given)."""
    counted = counted or {}
    events.add("islands", [{**asdict(s), "cursor": list(s.cursor), "skipped_units": json.dumps(s.skipped_units),
                            "alive_at_stop": s in live, "tokens_processed": counted.get((s.island, s.incarnation), s.tokens)}
                           for s in live + dead])
    events.add("timeline", [{"at": t, "island": i, "incarnation": inc, "state": st}
                            for t, i, inc, st in snapshot["timeline"]])
    events.add("faults", faults)
    events.add("detections", snapshot.get("detections", []))
    events.add("salvages", [{"island": s["island"], "incarnation": s["incarnation"], "step": s.get("step"),
                             "tokens": list(s.get("tokens") or []), "seqs": list(s.get("seqs") or []),
                             "skipped": json.dumps(s.get("skipped") or {}), "keeper_error": s.get("keeper_error")}
                            for s in snapshot.get("salvages", [])])


def publish_outcome(r: SessionRecord, new_rounds: int, *, metrics: RunMetrics, callbacks: Callbacks,
                    events: EventLog) -> None:
    """Hand a finished session's outcome to the run's `metrics` and `callbacks` (`new_rounds`: the rounds drained
    last), and add its stop-time tables to `events`."""
    metrics.record_status(r.status, r.snapshot, ledger=r.fates)
    metrics.record_goodput(r.good["goodput"], r.good["uptime"])
    callbacks.island_events(r.snapshot, r.fates["processed"][0])  # those of the stop itself
    callbacks.round(ledger=r.fates, status=r.status, statuses=r.live, new_rounds=new_rounds, wall_s=r.wall,
                    goodput=r.good["goodput"], uptime=r.good["uptime"])
    record_stop_events(events, r.snapshot, r.live, r.dead, r.faults, r.counted)
    events.flush()


def run_summary(r: SessionRecord) -> dict:
    """The summary of a finished session: losses, token fates, goodput, recovery, traffic, islands.

    Every token count is read from the ledger `r.fates`: tokens_processed is its processed (one number in every
    fragment) and the tokens_* fates its fragment means, which add up to it; the islands' rows count `r.counted`."""
    fates = r.fates
    P = len(fates["processed"])
    mean = lambda xs: sum(xs) / P  # noqa: E731 - tokens count once per fragment; report the fragment mean
    assert len(set(fates["processed"])) == 1, f"processed differs between fragments: {fates['processed']}"
    good = r.good
    return {
        "mode": r.cfg.mode,
        "emulation": emulation_note(r.cfg),
        "eval_loss": r.final_eval["eval_loss"],
        "eval_loss_before_flush": r.before_flush_loss,  # None without run.final_flush
        "eval_loss_raw": r.raw_loss,  # the raw global model's; None without run.average_window
        "eval_bits_per_byte": r.final_eval["eval_bits_per_byte"],
        "unigram_bits_per_byte": r.unigram_bpb,
        "tokens_processed": fates["processed"][0],
        "tokens_merged": mean(fates["merged"]),
        "tokens_refused": mean(fates["refused"]),
        "tokens_lost": mean(fates["lost"]),
        "tokens_in_flight": mean(fates["in_flight"]),
        "tokens_overwritten": mean(fates["overwritten"]),  # replaced by an overwrite adoption before a cut
        "token_ledger": fates,  # per fragment; processed = merged + refused + in_flight + lost + overwritten in each
        # A resumed run: the earlier driver sessions' part of token_ledger, as of the checkpoint it resumed from
        # (docs/architecture.md section 6); None for a run of one session.
        "token_ledger_before": r.before,
        **_unreadable(r.live + r.dead),
        "goodput": good["goodput"],
        "uptime": good["uptime"],  # from the first advance after every island was merged (policies/goodput.py)
        "fill_s": good["fill_s"],  # run start to that advance: the pipeline fill
        "time_by_state_s": good["time_by_state_s"],
        "useful_s": good["useful_s"],
        "allocated_s": good["allocated_s"],
        **_recovery(r.snapshot, r.live + r.dead, r.faults, mean),
        "faults_planned": r.faults_planned,  # faults on this session's chaos tape; a run may end before all fire
        **_traffic(r.status, r.network, r.network_emulated),
        "wall_s": r.wall,
        "stopped_by": r.stopped_by,  # token_budget | max_wall_s | stop_at_eval_loss | stop request | interrupted | tune
        "run_start": r.run_start,  # wall clock (time.time) that goodput, chaos tapes and `at` fields count from
        "run_end": good["run_end"],  # wall clock when the islands had stopped: goodput's allocation ends here
        "resumed": r.resumed,
        "corpus": r.corpus,
        "islands": _island_rows(r.cfg, r.snapshot["slots"], r.first_inc, r.counted),
        "evals": r.eval_points,
    }


def _unreadable(statuses: list[IslandStatus]) -> dict:
    """Units the islands skipped because they could not be read (islands/stream.py), each counted once per epoch
    whichever incarnation skipped it: their tokens, estimated from metadata, never trained, so not processed."""
    skipped: dict[str, int] = {}
    for st in statuses:
        skipped.update(st.skipped_units or {})
    return {"tokens_unreadable": sum(skipped.values()), "units_unreadable": sorted(skipped)}


def _recovery(snapshot: dict, statuses: list[IslandStatus], faults: list,
              mean: Callable[[list[int]], float]) -> dict:
    """Failures, restarts, detection and rejoin times, and what salvage kept (`statuses`: live and dead)."""
    slots = snapshot["slots"].values()
    detect, rejoin = snapshot["detect_s"], snapshot["rejoin_s"]
    salvages = snapshot.get("salvages", [])
    return {
        "failures": sum(s["failures"] for s in slots),
        "restarts": sum(s["restarts"] for s in slots),
        "faults_injected": sum(1 for f in faults if f["outcome"] == "fired"),
        "faults_skipped": sum(1 for f in faults if f["outcome"].startswith("skipped")),  # e.g. the driver's node
        "mean_time_to_detect_s": sum(detect) / len(detect) if detect else None,
        "mean_time_to_rejoin_s": sum(rejoin) / len(rejoin) if rejoin else None,
        # Progress of dead incarnations merged instead of lost (health.salvage_every_steps), and what the
        # islands' snapshots for it cost: inner-loop seconds and in-pool bytes (never over the WAN).
        "salvaged_tokens": sum(mean(s["tokens"]) for s in salvages if s.get("tokens")),
        "salvages": sum(1 for s in salvages if any(s.get("tokens") or [])),
        "salvage_snapshot_s": sum(st.shelve_s for st in statuses),
        "salvage_snapshot_bytes": sum(st.shelved_bytes for st in statuses),
        "keeper_restarts": sum(snapshot.get("keeper_restarts", {}).values()),  # keepers that died, replaced
        # Elastic pools: islands placed in slots that had been vacant, and islands that left with a drained node
        # (each with whether its last submissions merged before it went).
        "joins": len(snapshot.get("joins", [])),
        "leaves": len(snapshot.get("leaves", [])),
        "leaves_merged": sum(1 for leave in snapshot.get("leaves", []) if leave.get("merged")),
        # Tokens the leaving islands processed that never reached the outer optimizer (0 when every leave finished).
        "drained_tokens_lost": sum(max(0, leave.get("tokens", 0) - leave.get("received", 0))
                                   for leave in snapshot.get("leaves", [])),
    }


def _traffic(status: dict, network: str, emulated: bool) -> dict:
    """Rounds, versions and the bytes each direction and link carried, with the network that carried them."""
    return {
        "rounds": status["rounds"],
        "refusals": status["refusals"],
        "versions": status["versions"],
        "bytes_up": status["bytes_up"],
        "bytes_down": status["bytes_down"],
        "bytes_sent": status["bytes_up"] + status["bytes_down"],
        "bytes_by_link": status["bytes_by_link"],  # {region: {up, down}} bytes on each region's link to the hub
        "transfers_by_link": status["transfers_by_link"],  # {region: {up, down}} transfers, as docs/network.md says
        "network": network,
        "network_emulated": emulated,
        "network_wait_s": status["network_wait_s"],  # delivery delay the emulated links added, per direction
    }


def _island_rows(cfg: RunConfig, slots: Mapping, first_inc: Mapping[int, int],
                 counted: Mapping[tuple[int, int], int] | None = None) -> list[dict]:
    """One row per island slot of a monitor snapshot's `slots`: where and how it trained, its failures, and its
    steps and tokens over every incarnation of this session (`first_inc`: island -> its first incarnation).
    `counted`: tokens per (island, incarnation) of this session as the ledger counts them
    (accounting.incarnation_tokens: the rows add up to the session's processed); without it, the statuses'."""
    precision = {p.name: cfg.precision_of(p) for p in cfg.pools}

    def tokens(s: dict) -> int:
        if counted is not None:
            return sum(n for (island, _), n in counted.items() if island == s["island"])
        return (s["status"].tokens if s["status"] else 0) + sum(f.tokens for f in s["finals"])

    return [{"island": s["island"], "pool": s["pool"], "node": s["node"], "incarnation": s["incarnation"],
             # incarnations started this session, failed starts included (each one is a new process)
             "incarnations": s["incarnation"] - first_inc.get(s["island"], 1) + 1,
             "failures": s["failures"], "restarts": s["restarts"], "state": s["state"],
             "joins": s.get("joins", 0), "leaves": s.get("leaves", 0),
             "device": s["status"].device if s["status"] else None,  # where it trained: cpu, cuda:0 (card)
             "precision": precision[s["pool"]],  # its inner steps' arithmetic (pool's, else inner.precision)
             "steps": (s["status"].steps if s["status"] else 0) + sum(f.steps for f in s["finals"]),
             "tokens": tokens(s)}
            for s in slots.values()]
