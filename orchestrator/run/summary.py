"""The tables printed after a run: the engine's final summary, and the held-out loss cell every summary
table shares (`diloco train` and `diloco baseline-dp`). Plain dicts in, text out; no Ray."""

from __future__ import annotations

from orchestrator.core.accounting import shown_fates


def held_out_loss_cell(summary: dict) -> str:
    """The final held-out loss as the summary tables print it: under run.average_window it is the served
    moving average's, and the raw global model's follows it."""
    raw = summary.get("eval_loss_raw")
    return f"{summary['eval_loss']:.4f}" + ("" if raw is None else f" (moving average; raw global model {raw:.4f})")


# Why a run ended, as the faults line says it when faults were left on the tape (summary["stopped_by"]).
_ENDED_BY = {"token_budget": "the token budget ran out first", "max_wall_s": "run.max_wall_s ran out first",
             "stop_at_eval_loss": "the held-out loss target was reached first", "stop request": "the run was stopped first",
             "interrupted": "the run was interrupted first", "tune": "Ray Tune stopped the trial first"}


def _token_rows(summary: dict) -> list[tuple[str, str]]:
    """Tokens processed and, below it, where they went: merged always, every other fate only when it is not 0,
    so that "processed" against "merged" is explained where they differ. The rows add up to processed exactly
    (fragment means of the ledger, rounded together: accounting.shown_fates)."""
    s = summary.get
    shown = shown_fates(s("token_ledger")) if s("token_ledger") else {
        "merged": s("tokens_merged"), "lost": s("tokens_lost"), "refused": s("tokens_refused"),
        "in_flight": s("tokens_in_flight"), "overwritten": s("tokens_overwritten")}  # a summary from before the ledger
    fates = [("merged", shown["merged"], ""),
             ("lost", shown["lost"], " (never received: failed islands' unsent progress, resyncs, a resume)"),
             ("refused", shown["refused"], " (stale, malformed or poisoned submissions)"),
             ("in flight at stop", shown["in_flight"], ""),
             ("overwritten", shown["overwritten"], " (replaced by an adopted version before they were sent)")]
    rows = [("tokens processed", f"{summary['tokens_processed']:,}, of which")]
    rows += [(f"  {name}", f"{n or 0:,.0f}{why}") for name, n, why in fates if name == "merged" or n]
    before = s("token_ledger_before")
    if before:  # a resumed run: how much of the above its earlier driver sessions processed
        rows.append(("  of earlier sessions", f"{before['processed'][0]:,} processed, to the checkpoint this session "
                                              f"resumed from (their fates are counted above)"))
    if s("tokens_unreadable"):  # never read, so not processed: a row of its own below the fates
        units = s("units_unreadable") or []
        rows.append(("unreadable (skipped units)", f"{s('tokens_unreadable'):,} tokens, estimated from metadata, in "
                                                   f"{len(units)} unit(s): {', '.join(units[:3])}{' ...' if len(units) > 3 else ''}"))
    if s("salvaged_tokens"):
        rows.append(("  salvaged from failed islands",
                     f"{s('salvaged_tokens'):,.0f} (sent by progress keepers instead of lost; counted above)"))
    return rows


def _recovery_rows(summary: dict) -> list[tuple[str, str]]:
    """Goodput and uptime when known; failures, restarts and the chaos tape when there were any."""
    s = summary.get
    rows = []
    if s("goodput") is not None:
        uptime = f", uptime {s('uptime'):.3f} (from the first version advance after every island was merged)" if s("uptime") is not None else ""
        rows.append(("goodput", f"{s('goodput'):.3f}{uptime}"))
    if s("failures") or s("restarts"):
        times = [f"{what} {v:.1f} s" for what, v in (("detected in", s("mean_time_to_detect_s")),
                                                      ("rejoined in", s("mean_time_to_rejoin_s"))) if v is not None]
        rows.append(("failures / restarts", f"{s('failures') or 0} / {s('restarts') or 0}"
                     + (f" ({', '.join(times)} on average)" if times else "")))
    if s("joins") or s("leaves"):
        unmerged = (s("leaves") or 0) - (s("leaves_merged") or 0)
        rows.append(("joins / leaves", f"{s('joins') or 0} / {s('leaves') or 0} (elastic pools: islands placed as "
                     f"nodes joined; islands that left drained nodes, "
                     + (f"{unmerged} before all their progress merged)" if unmerged else "all their progress merged)")))
    faults = faults_cell(summary)
    if faults is not None:
        rows.append(("faults fired", faults))
    return rows


def faults_cell(summary: dict) -> str | None:
    """How many of the chaos tape's faults fired, and why not all when some did not (e.g. "5 of 8 planned
    (the token budget ran out first)"); None for a run without a chaos tape (or from before faults_planned)."""
    s = summary.get
    planned = s("faults_planned")
    if not planned:
        return None
    fired, skipped = s("faults_injected") or 0, s("faults_skipped") or 0
    left = planned - fired - skipped
    ended = _ENDED_BY.get(s("stopped_by"), "the run ended first")
    why = ([f"{skipped} skipped"] if skipped else []) + ([f"{left} left: {ended}" if skipped else ended] if left > 0 else [])
    return f"{fired} of {planned} planned" + (f" ({'; '.join(why)})" if why else "")


def _island_line(isl: dict) -> str:
    """One island's cell: steps and tokens over all its incarnations, its state, and where it trained."""
    # Where and in what arithmetic, when not the plain CPU fp32 of most runs (GPU pools, per-pool precision).
    device, precision = isl.get("device"), isl.get("precision")
    where = f", {device or 'cpu'} {precision or 'fp32'}" if device not in (None, "cpu") or precision not in (None, "fp32") else ""
    n = isl.get("incarnations") or 1
    over = f"{n} incarnations, " if n > 1 else ""
    return f"{over}{isl['steps']:,} steps, {isl['tokens']:,} tokens, {isl['state']}{where}"


def format_summary(summary: dict) -> str:
    """The short final table printed after `diloco train`: losses, where the tokens went, goodput, failures and
    faults when there were any, rounds, traffic and one line per island (over all its incarnations)."""
    rows = [
        ("mode", summary["mode"]),
        ("held-out loss (nats/byte)", held_out_loss_cell(summary)),
        ("held-out bits/byte", f"{summary['eval_bits_per_byte']:.3f}"),
        ("unigram bits/byte (baseline)", f"{summary['unigram_bits_per_byte']:.3f}"),
        *_token_rows(summary),
        *_recovery_rows(summary),
        ("rounds (refusals)", f"{summary['rounds']} ({summary['refusals']})"),
        ("bytes sent (up + down)", f"{summary['bytes_sent'] / 1e6:,.1f} MB"),
        ("wall time", f"{summary['wall_s']:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for isl in summary["islands"]:
        lines.append(f"{'  island ' + str(isl['island']) + ' (' + isl['pool'] + ')':<{width}}  {_island_line(isl)}")
    if summary.get("emulation"):
        lines.append(summary["emulation"])
    if summary.get("network_emulated"):
        lines.append(summary["network"])  # starts with "EMULATED network"
    return "\n".join(lines)
