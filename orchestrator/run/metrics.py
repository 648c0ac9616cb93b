"""Prometheus metrics of a run (`ray.util.metrics`), emitted by the driver, and goodput so far.

Ray exports every metric on each node's `--metrics-export-port` at `/metrics` with a `ray_` prefix
(`diloco_rounds` is scraped as `ray_diloco_rounds_total`: counters get `_total`) and shows them in
the dashboard's Grafana panels. The driver records them (orchestrator/run/driver.py): round and refusal
events each time it drains them from the outer optimizer, versions, bytes, tokens and island states
every tick, goodput at each flush and at the end. Every metric is listed in docs/metrics.md.

Tag values are bounded: run id, fragment index, pool name, island index, island state, refusal kind
(a category, not the free-text reason), round phase and direction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from orchestrator.core.accounting import FATES, run_goodput, session_received, shown_fates, token_fates
from policies.island_states import IslandState

log = logging.getLogger(__name__)

# Staleness is an integer; bucket edges between integers make `le="0.5"` read "staleness 0".
STALENESS_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5]
WEIGHT_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]
SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
ISLAND_STATES = (IslandState.STARTING, IslandState.TRAINING, IslandState.BLOCKED, IslandState.DEAD, IslandState.RESTARTING,
                 IslandState.REINTEGRATING, IslandState.STOPPED)  # slot states a gauge is kept for, each tick


def refusal_kind(reason: str) -> str:
    """A bounded category for a refusal's free-text reason (a metric tag must not be free text)."""
    if "non-finite" in reason:
        return "non_finite"
    if "stale" in reason:
        return "stale"
    if "unknown or dead island" in reason:
        return "unknown_island"
    return "malformed"


class RunMetrics:
    """The run's metrics, created once per driver session (Ray registers a metric when it is built).

    One `record_*` method per event kind; each takes what the driver already has in hand, so emitting
    costs no extra remote call. Counters get deltas, gauges the latest value.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._last_set: float | None = None  # monotonic time goodput was last set (wait_exported)
        run, frag, pool_tags = ("run_id",), ("run_id", "fragment"), ("run_id", "pool")
        self.rounds = Counter("diloco_rounds", description="Rounds merged by the outer optimizer.", tag_keys=frag)
        self.version = Gauge("diloco_fragment_version", description="Current global version of each fragment.",
                             tag_keys=frag)
        self.tokens_merged = Counter("diloco_tokens_merged", description="Tokens whose submissions were merged.",
                                     tag_keys=frag)
        self.refusals = Counter("diloco_refusals", description="Submissions refused by the outer optimizer.",
                                tag_keys=frag + ("kind",))
        self.tokens_refused = Counter("diloco_tokens_refused", description="Tokens of refused submissions.",
                                      tag_keys=frag)
        self.staleness = Histogram("diloco_staleness", description="Staleness (versions behind) of each merged submission.",
                                   boundaries=STALENESS_BUCKETS, tag_keys=frag)
        self.weights = Histogram("diloco_merge_weight", description="Normalized merge weight of each merged submission.",
                                 boundaries=WEIGHT_BUCKETS, tag_keys=frag + ("pool",))
        self.participants = Histogram("diloco_round_participants", description="Submissions merged per round.",
                                      boundaries=[1.5, 2.5, 3.5, 4.5, 8.5, 16.5, 32.5], tag_keys=frag)
        self.round_s = Histogram("diloco_round_seconds", description="Round timing by phase: quorum (open to quorum), "
                                 "grace (window granted), wait (open to close), merge (decode, merge, outer step).",
                                 boundaries=SECONDS_BUCKETS, tag_keys=frag + ("phase",))
        self.islands = Gauge("diloco_islands", description="Island slots per pool in each state.",
                             tag_keys=pool_tags + ("state",))
        self.failures = Gauge("diloco_island_failures", description="Failures of an island slot so far.",
                              tag_keys=pool_tags + ("island",))
        self.restarts = Gauge("diloco_island_restarts", description="Restarts of an island slot so far.",
                              tag_keys=pool_tags + ("island",))
        self.tokens_processed = Gauge("diloco_tokens_processed", description="Tokens processed by all islands so far "
                                      "(the token ledger's).", tag_keys=run)
        self.tokens = Gauge("diloco_tokens", description="The run's token ledger so far: tokens of each fate (fragment "
                            "mean); the fates add up to diloco_tokens_processed.", tag_keys=run + ("fate",))
        self.bytes = Counter("diloco_bytes", description="Bytes of submissions received (up) and versions sent to "
                             "islands (down).", tag_keys=run + ("direction",))
        self.goodput = Gauge("diloco_goodput", description="Useful island time over allocated island time so far.",
                             tag_keys=run)
        self.uptime = Gauge("diloco_uptime", description="Fraction of wall time, from the first version advance after "
                            "every island was merged, in which global versions advanced.", tag_keys=run)
        self._bytes_seen = {"up": 0, "down": 0}

    def _tags(self, **more: Any) -> dict[str, str]:
        return {"run_id": self.run_id, **{k: str(v) for k, v in more.items()}}

    def record_events(self, rounds: Iterable[Any], refusals: Iterable[Any], snapshot: dict) -> None:
        """Rounds (orchestrator.core.outer_optimizer.RoundRecord) and refusals (Refusal) drained from the outer optimizer."""
        pools = {int(i): s["pool"] for i, s in snapshot.get("slots", {}).items()}
        for r in rounds:
            tags = self._tags(fragment=r.fragment)
            self.rounds.inc(1.0, tags=tags)
            self.tokens_merged.inc(float(r.tokens), tags=tags)
            self.participants.observe(float(len(r.participants)), tags=tags)
            for island, weight, stale in zip(r.participants, r.weights, r.staleness):
                self.staleness.observe(float(stale), tags=tags)
                self.weights.observe(float(weight), tags={**tags, "pool": pools.get(island, "unknown")})
            for phase, seconds in (("quorum", r.quorum_s), ("grace", r.grace_s), ("wait", r.wait_s), ("merge", r.merge_s)):
                self.round_s.observe(max(float(seconds), 1e-9), tags={**tags, "phase": phase})
        for f in refusals:
            tags = self._tags(fragment=f.fragment)
            self.refusals.inc(1.0, tags={**tags, "kind": refusal_kind(f.reason)})
            self.tokens_refused.inc(float(f.tokens), tags=tags)

    def record_status(self, status: dict, snapshot: dict, *, ledger: dict[str, list[int]]) -> None:
        """One driver tick: the outer optimizer's status(), the health monitor's snapshot() and the run's token
        ledger computed from them (orchestrator/core/accounting.py token_fates)."""
        for p, v in enumerate(status.get("versions", [])):
            self.version.set(float(v), tags=self._tags(fragment=p))
        for direction, total in (("up", status.get("bytes_up", 0)), ("down", status.get("bytes_down", 0))):
            # Totals restart from 0 when the outer optimizer restarts: count the new total from there.
            seen = self._bytes_seen[direction]
            delta = total - seen if total >= seen else total
            if delta > 0:
                self.bytes.inc(float(delta), tags=self._tags(direction=direction))
            self._bytes_seen[direction] = total
        shown = shown_fates(ledger)  # whole tokens that add up, as the final table shows them
        self.tokens_processed.set(float(shown["processed"]), tags=self._tags())
        for fate in FATES:
            self.tokens.set(float(shown[fate]), tags=self._tags(fate=fate))
        counts: dict[tuple[str, str], int] = {}
        for island, slot in snapshot.get("slots", {}).items():
            counts[(slot["pool"], slot["state"])] = counts.get((slot["pool"], slot["state"]), 0) + 1
            self.failures.set(float(slot["failures"]), tags=self._tags(pool=slot["pool"], island=island))
            self.restarts.set(float(slot["restarts"]), tags=self._tags(pool=slot["pool"], island=island))
        # Every known state is set each tick (to 0 when empty) so a state an island left does not linger.
        for pool in {p for p, _ in counts}:
            for state in sorted(set(ISLAND_STATES) | {s for p, s in counts if p == pool}):
                self.islands.set(float(counts.get((pool, state), 0)), tags=self._tags(pool=pool, state=state))

    def record_goodput_so_far(self, accounting: Callable[[], dict], *, ledger: dict[str, list[int]], snapshot: dict,
                              run_start: float | None, useful_before: float = 0.0) -> dict | None:
        """Goodput so far, at a driver flush. `accounting` fetches the outer optimizer's accounting(); `ledger` is
        the run's token ledger (the driver's); `useful_before`: useful seconds of earlier sessions (a resume's).
        Returns what `goodput_so_far` computed (the run's callbacks get the same numbers), None when it failed.

        A failed read (an actor restarting) is logged and skipped: a metric never stops a run.
        """
        try:
            so_far = goodput_so_far(ledger=ledger, accounting=accounting(), snapshot=snapshot, run_start=run_start,
                                    useful_before=useful_before)
        except Exception as err:  # noqa: BLE001 - any failure here is the metric's, not the run's
            reason = str(err).strip().splitlines()[-1][:200] if str(err).strip() else type(err).__name__
            log.warning("goodput metric skipped this flush: %s", reason)
            return None
        self.record_goodput(so_far["goodput"], so_far["uptime"])
        return so_far

    def record_goodput(self, goodput: float | None, uptime: float | None) -> None:
        """Goodput and uptime so far (docs/architecture.md section 6); None (not known yet) records nothing."""
        if goodput is not None:
            self.goodput.set(float(goodput), tags=self._tags())
        if uptime is not None:
            self.uptime.set(float(uptime), tags=self._tags())
        self._last_set = time.monotonic()

    def wait_exported(self) -> None:
        """Block until Ray's metrics reporter has pushed the values set last (the run's final ones) to the node's
        export port: it pushes every `metrics_report_interval_ms` (10 s unless the cluster was started with another),
        and what a driver sets less than that before it exits never reaches a scrape (seen: a job's final goodput
        missing from its cluster's export). Only worth it on a Ray that outlives this process."""
        if self._last_set is None:
            return
        import ray._raylet

        interval_s = ray._raylet.Config.metrics_report_interval_ms() / 1000
        wait = self._last_set + 1.5 * interval_s + 0.5 - time.monotonic()  # one push and the agent's turn after it
        if wait > 0:
            log.info("waiting %.1fs for Ray's metrics reporter to export the run's final values", wait)
            time.sleep(wait)


def estimated_run_start(timeline: list) -> float | None:
    """When every island slot had first trained (the driver starts goodput's clock about then).

    For a client (`diloco status`) that cannot ask the driver; None until every slot has trained.
    """
    first: dict[int, float] = {}
    slots = set()
    for at, island, _inc, state in timeline:
        slots.add(island)
        if state == IslandState.TRAINING and island not in first:
            first[island] = at
    return max(first.values()) if first and len(first) == len(slots) else None


def live_ledger(*, status: dict, snapshot: dict) -> dict[str, list[int]]:
    """The token ledger of a live run computed from its actors alone, for a client that has no driver's ledger
    (`diloco status` of a run whose driver predates the ledger it notes). It counts every incarnation the outer
    optimizer knows, so a resumed run's earlier sessions are not told apart."""
    live, dead = [], []
    for slot in snapshot.get("slots", {}).values():
        if slot["status"] is not None:
            live.append(slot["status"])
        dead.extend(slot["finals"])
    return token_fates(fragments=len(status["versions"]), ledger=status["ledger"], live=live, dead=dead,
                       received=session_received(status.get("received", []), {}))


def goodput_so_far(*, ledger: dict[str, list[int]], accounting: dict, snapshot: dict, run_start: float | None,
                   now: float | None = None, useful_before: float = 0.0) -> dict:
    """Goodput and uptime of a live run, by the same formulas as the final summary, with its token ledger.

    `ledger`: the run's token ledger (the driver's, orchestrator/core/accounting.py token_fates); `accounting`
    comes from the outer optimizer, `snapshot` from the health monitor; `run_start` is the wall-clock start of
    goodput's clock (the driver's, or `estimated_run_start`); `useful_before`: the useful seconds an earlier
    session left in the checkpoint a resume restored (goodput is this session's). Returns {"goodput", "uptime",
    "fates", "tokens_processed"}; goodput and uptime are None before the run started training.
    """
    out = {"goodput": None, "uptime": None, "fates": ledger, "tokens_processed": ledger["processed"][0]}
    now = time.time() if now is None else now
    if run_start is None or now <= run_start or not snapshot.get("slots"):
        return out
    good = run_goodput(timeline=snapshot["timeline"], useful_s=max(0.0, accounting["useful_s"] - useful_before),
                       run_start=run_start, run_end=now, islands=len(snapshot["slots"]), advances=accounting["advances"],
                       fates=ledger, first_merged=accounting.get("first_merged"))
    out.update(goodput=good["goodput"], uptime=good["uptime"])
    return out
