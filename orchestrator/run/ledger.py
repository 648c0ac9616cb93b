"""The driver's view of a run's token ledger (orchestrator/core/accounting.py), kept across one session.

`SessionLedger` holds what `Run` (orchestrator/run/driver.py) knows of the ledger: the earlier sessions' part
as of the checkpoint a resume restored, the run's ledger as of the last tick (every count shown is read from
it), the useful island seconds the restored checkpoint holds, and the outer optimizer's accounting as this
driver has read it across the outer optimizer's restarts. Plain values in and out: the driver makes the
actor calls and hands their answers here. No Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from islands.spec import IslandSpec
from orchestrator.core.accounting import (
    incarnation_tokens,
    kept_accounting,
    no_tokens,
    resumed_ledger,
    run_goodput,
    session_received,
    token_fates,
)

log = logging.getLogger(__name__)


def island_statuses(snapshot: Mapping[str, Any]) -> tuple[list, list]:
    """The islands' last statuses in a health monitor's `snapshot`: (live incarnations', dead incarnations')."""
    live, dead = [], []
    for slot in snapshot["slots"].values():
        if slot["status"] is not None:
            live.append(slot["status"])
        dead.extend(slot["finals"])
    return live, dead


class SessionLedger:
    """The token ledger of one driver session of a run of `fragments` fragments.

    before: the earlier sessions' part (None for a fresh run); current: the run's ledger as of the last
    `account` (the earlier part while nothing was counted yet); useful_before: the useful island seconds the
    restored checkpoint holds; first_inc: island -> this session's first incarnation (set once the islands'
    specs are known), which separates this session's receipts from the earlier ones'.
    """

    def __init__(self, fragments: int) -> None:
        self.fragments = fragments
        self.before: dict[str, list[int]] | None = None
        self.current: dict[str, list[int]] = no_tokens(fragments)
        self.useful_before = 0.0
        self.first_inc: dict[int, int] = {}
        self._acct_seen: dict | None = None
        self._last_inc: dict[int, int] = {}  # island -> its last incarnation before this session (a resume's)

    def resume(self, *, restored: Mapping[str, Any], extra: Mapping[str, Any], acct: Mapping[str, Any]) -> None:
        """Take a resumed run's starting point from the restored outer optimizer: its ledger (`restored`: the
        checkpoint's merged and refused), its metadata (`extra`) and its accounting (`acct`), and each island's
        last incarnation, which this session's incarnations continue above (`continue_incarnations`)."""
        P = self.fragments
        self.before = resumed_ledger(fragments=P, restored=restored, extra=extra)
        self.current = self.before
        self.useful_before = acct["useful_s"]
        last_inc = self._last_inc = {int(i): inc for i, inc in extra.get("incarnations", {}).items()}
        for island, inc, _ in acct["received"]:
            last_inc[island] = max(last_inc.get(island, 0), inc)
        log.info("resumed: %d tokens processed before, as of the checkpoint (of them %d merged, %d lost)",
                 self.before["processed"][0], sum(self.before["merged"]) // P, sum(self.before["lost"]) // P)

    def continue_incarnations(self, specs: list[IslandSpec]) -> list[IslandSpec]:
        """The islands' `specs` for this session: a resumed island's incarnations continue above its last one.
        Their incarnations are this session's first (`first_inc`)."""
        last = self._last_inc
        specs = [s if s.island not in last else replace(s, incarnation=last[s.island] + 1) for s in specs]
        self.first_inc = {s.island: s.incarnation for s in specs}
        return specs

    def account(self, status: Mapping[str, Any], snapshot: Mapping[str, Any]) -> dict[str, list[int]]:
        """The run's token ledger now, from the outer optimizer's `status` (its ledger and tokens received, of one
        moment) and the islands' statuses in the monitor's last `snapshot`; kept as `current`."""
        live, dead = island_statuses(snapshot)
        self.current = token_fates(fragments=self.fragments, ledger=status["ledger"], before=self.before,
                                   received=self.received(status), live=live, dead=dead)
        return self.current

    def received(self, status: Mapping[str, Any]) -> dict[tuple[int, int], list[int]]:
        """This session's incarnations' tokens the outer optimizer received, from its `status`."""
        return session_received(status["received"], self.first_inc)

    def counted(self, status: Mapping[str, Any], live: list, dead: list) -> dict[tuple[int, int], int]:
        """(island, incarnation) -> tokens processed as the ledger counts them (accounting.incarnation_tokens)."""
        return incarnation_tokens(live, dead, self.received(status))

    @property
    def processed(self) -> int:
        """Tokens processed so far, the ledger's (the same in every fragment)."""
        return self.current["processed"][0]

    def note(self) -> dict:
        """The ledger as the outer optimizer keeps it with its next checkpoint (what a resume from it reads)."""
        return {"tokens_processed": self.processed, "token_ledger": self.current,
                "token_ledger_before": self.before, "useful_s_before": self.useful_before}

    def keep_accounting(self, read: Mapping[str, Any]) -> dict:
        """The outer optimizer's accounting() just `read`, with the version advances and first merges earlier
        reads saw: a restarted outer optimizer's checkpoint holds neither, so uptime had counted only from its
        last restart."""
        self._acct_seen = kept_accounting(self._acct_seen, read)
        return self._acct_seen

    def goodput(self, acct: Mapping[str, Any], *, fates: dict, timeline: list, run_start: float, run_end: float,
                islands: int, stop_began: float) -> dict:
        """The finished session's goodput (accounting.run_goodput) from the stopped outer optimizer's accounting
        `acct` (as `keep_accounting` kept it) and its final ledger `fates`. It is this session's: the useful
        time the restored checkpoint held was an earlier session's."""
        return run_goodput(timeline=timeline, useful_s=max(0.0, acct["useful_s"] - self.useful_before),
                           run_start=run_start, run_end=run_end, islands=islands, advances=acct["advances"],
                           fates=fates, stop_began=stop_began, first_merged=acct["first_merged"])
