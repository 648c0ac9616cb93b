"""OuterOptimizer: the single source of truth for the global parameters (docs/architecture.md section 3).

A plain class, stepped with submissions and the current time. Per fragment p it keeps the global
tensors, an outer optimizer, the version and the pending submissions (its resident memory, as
a formula: docs/outer.md). A round closes on quorum + grace (policies.quorum), merges with token
weights (policies.weighting) and the run's merge rule (RDA by default; a plug-in, policies.merge_rules),
applies the outer step and yields a `RoundResult` for the shell to publish. Bad submissions are refused,
counted and logged; they never touch state.

Its pieces live beside it in orchestrator/core/: the checks a submission passes (submission_check.py),
the poison guard's judgments (poison_checks.py), each fragment's merge state and the merge and outer step of
one round (round_merge.py), the served moving average (served_average.py), each fragment's open round and
the round records (rounds.py), and what its checkpoint holds (outer_checkpoint.py). The Ray shell that
polls islands and publishes lives in orchestrator/actors/outer.py.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from islands.cursor import DataCursor
from islands.messages import Submission
from orchestrator.core.outer_checkpoint import checkpoint_of, restore_checkpoint
from orchestrator.core.poison_checks import (
    base_digests_for,
    judge_arrival,
    judge_opening_round,
    note_version,
    stale_base,
)
from orchestrator.core.round_merge import FragmentMerges
from orchestrator.core.rounds import OpenRound, Pending, Refusal, RoundRecord, RoundResult
from orchestrator.core.served_average import ServedAverage
from orchestrator.core.settings import OuterSettings  # re-exported: the outer optimizer's settings
from orchestrator.core.submission_check import check_submission
from policies.fragments import FragmentPlan
from policies.poison_guard import (
    FAR_OUT,
    POISONED,
    PoisonGuard,
    RefusalStreaks,
    first_round_quorum,
)
from policies.quorum import MovingAverage, decide_round, grace_window_s, membership_quorum
from policies.sync_schedule import sync_every_at

__all__ = ["OuterOptimizer", "OuterSettings", "Refusal", "RoundRecord", "RoundResult"]

log = logging.getLogger(__name__)

class OuterOptimizer:
    """Global parameters, outer momentum, versions, pending rounds and token ledger."""

    def __init__(
        self,
        initial: dict[str, torch.Tensor],
        plan: FragmentPlan,
        *,
        settings: OuterSettings,
        embedding_names: frozenset[str] | set[str] = frozenset(),
        buffer_names: frozenset[str] | set[str] = frozenset(),
        now: float = 0.0,
        copy_results: bool = True,
    ) -> None:
        """`embedding_names`: merged by the plain mean under RDA. `buffer_names`: trained buffers (BatchNorm
        statistics, islands.model_api.buffer_names), set to the islands' weighted mean with no outer lr or
        momentum (core/round_merge.py). `copy_results`: each RoundResult carries a private copy of the new
        version; False hands out the live global tensors instead, valid only until this object's next call
        (the actor shell puts them in the object store at once, on the same thread, and saves the copy)."""
        self.plan = plan
        self.settings = settings
        self.progress: float | None = None  # tokens processed / budget, as the driver last said (tau_schedule)
        P = plan.num_fragments
        self.params = [[initial[n].detach().to(torch.float32).clone() for n in frag] for frag in plan.fragments]
        self._shapes = [[tuple(t.shape) for t in frag] for frag in self.params]
        # Each fragment's masks, outer optimizer and RDA window, the run's merge rule and compressor (core/round_merge.py).
        self.merges = FragmentMerges(self.params, plan.fragments, settings, embedding_names=embedding_names,
                                     buffer_names=buffer_names)
        self._opts, self._rda_windows = self.merges.opts, self.merges.windows
        # The served model (run.average_window): a moving average of each fragment's global tensors, or None.
        self.average = None if settings.average_window is None else ServedAverage(self.params, settings.average_window)
        self.versions = [0] * P
        # No copy of older versions is kept: an island's outer gradient is measured from the version it holds,
        # so a stale submission needs only its base version's number to be accepted or refused.
        self.copy_results = copy_results
        self._open = [OpenRound(opened_at=now) for _ in range(P)]  # per fragment: its round, collecting
        self.islands: dict[int, int] = {}  # live island -> current incarnation
        self._last_incarnation: dict[int, int] = {}  # island slot -> newest incarnation ever registered
        self.step_time = MovingAverage(0.2)
        self.quorum_time = MovingAverage(0.2)
        self.sync_time = MovingAverage(0.2)
        self.tokens_merged = [0] * P
        self.tokens_refused = [0] * P
        self.tokens_late = [0] * P  # taken from islands after stop began
        self.bytes_received = 0
        self.rounds: list[RoundRecord] = []
        self.holding = False  # set by hold() before the final flush: queue submissions, close no round
        self.refusals: list[Refusal] = []
        # Per (island, incarnation), per fragment: tokens received (accepted or refused). With the
        # islands' own counters this gives every token its fate, even across outer restarts.
        self.received: dict[tuple[int, int], list[int]] = {}
        self.useful_s = 0.0  # inner-step time whose effect reached the global parameters, / P
        self.resume_cursor: dict[int, DataCursor] = {}  # island slot -> data cursor of its newest merged submission
        self.advances: list[float] = []  # wall times of version advances (uptime)
        self.first_merged: dict[int, float] = {}  # island slot -> wall time of its first merged round (uptime's fill)
        self._diverged: set[tuple[int, int]] = set()  # (island, incarnation) that sent non-finite values
        # Finite, well-shaped and wrong outer gradients (policies.poison_guard), judged against the other islands'.
        self.guard = PoisonGuard(P) if settings.poison_guard else None
        # An incarnation refused as poisoned so many times in a row is restarted (policies.poison_guard.RefusalStreaks).
        self.streaks = RefusalStreaks(settings.poison_restart_after)
        self._poisoned: set[tuple[int, int]] = set()  # (island, incarnation) the monitor is to restart
        # The digest each recent version was published with, to check a submission's base against (base_check.py).
        self.base_digests = base_digests_for(settings, P)
        self.epoch = 0  # the shell's restart count (FragmentUpdate.epoch), which islands report their base's with

    # ---------------------------------------------------------------- membership

    def register(self, island: int, incarnation: int) -> None:
        """Admit an island incarnation; older incarnations of the slot are refused from now on."""
        old = self.islands.get(island)
        if old is not None and incarnation < old:
            raise ValueError(f"island {island} incarnation {incarnation} is older than the live one ({old})")
        self.islands[island] = incarnation
        self._last_incarnation[island] = max(self._last_incarnation.get(island, 0), incarnation)

    def unregister(self, island: int) -> None:
        """Mark an island slot dead: it no longer counts toward 'every live island submitted'."""
        self.islands.pop(island, None)

    def pending_from(self, island: int, incarnation: int) -> int:
        """Submissions of one island incarnation waiting in open rounds (a leaving island waits for them to merge)."""
        return sum(1 for r in self._open for e in r.pending if (e.sub.island, e.sub.incarnation) == (island, incarnation))

    # ---------------------------------------------------------------- submissions

    def receive(self, sub: Submission, now: float) -> tuple[list[RoundResult], Refusal | None]:
        """Take one submission; refuse it or queue it, then close any round that is due."""
        verdict = check_submission(
            sub, live=self.islands.get(sub.island), last=self._last_incarnation.get(sub.island), shapes=self._shapes,
            versions=self.versions, compression=self.settings.compression, max_staleness=self.settings.max_staleness,
        )
        if 0 <= sub.fragment < self.plan.num_fragments:
            self.received.setdefault((sub.island, sub.incarnation), [0] * self.plan.num_fragments)[sub.fragment] += max(sub.tokens, 0)
        if verdict.reason is not None:
            return self.poll(now), self._refuse(sub, verdict.reason)
        p = sub.fragment
        stale = stale_base(sub, self.base_digests, self.epoch, self.versions[p], self.params[p])
        if stale is not None:
            return self.poll(now), self._refuse(sub, stale)
        if self.guard is not None and self.versions[p] > 0:  # a first round is judged as a whole when it closes
            poisoned = judge_arrival(p, sub, verdict, self.guard, self.streaks, self._opts[p].momentum_buffers())
            if poisoned is not None:
                return self.poll(now), self._refuse(sub, poisoned)
        self.bytes_received += sub.nbytes
        if sub.step_time_s > 0:
            self.step_time.update(sub.step_time_s)
        round_ = self._open[p]
        round_.pending.append(Pending(sub, verdict.staleness, verdict.deltas, verdict.norms))
        if not sub.salvaged and self.islands.get(sub.island) == sub.incarnation:
            round_.voters.add(sub.island)
        if round_.quorum_at is None and self._pending_islands(p) >= self._round_quorum(p):
            round_.quorum_at = now
            self.quorum_time.update(now - round_.opened_at)
            round_.grace_s = grace_window_s(
                gamma=self.settings.grace_gamma,
                tau_steps=sync_every_at(self.progress, self.settings.tau_schedule, self.settings.tau_steps),
                step_time_s=self.step_time.value, quorum_time_s=self.quorum_time.value,
                sync_time_s=self.sync_time.value, cap_s=self.settings.grace_cap_s,
            )
        return self.poll(now), None

    def _refuse(self, sub: Submission, reason: str) -> Refusal:
        # Counted and logged once; a non-finite outer gradient also marks its incarnation as diverged.
        if "non-finite" in reason:
            self._diverged.add((sub.island, sub.incarnation))
        elif reason.startswith(POISONED) and self.streaks.refused(sub.island, sub.incarnation,
                                                                  far_out=reason.startswith(FAR_OUT)):
            self._poisoned.add((sub.island, sub.incarnation))
        refusal = Refusal(sub.island, sub.incarnation, sub.seq, sub.fragment, max(sub.tokens, 0), reason,
                          cursor=DataCursor.of(sub.cursor).batch)
        if 0 <= sub.fragment < self.plan.num_fragments:
            self.tokens_refused[sub.fragment] += refusal.tokens
        self.refusals.append(refusal)
        log.warning("refused submission %s/%s seq %s fragment %s: %s",
                    sub.island, sub.incarnation, sub.seq, sub.fragment, reason)
        return refusal

    def poll(self, now: float) -> list[RoundResult]:
        """Close every round whose quorum and grace rules say so."""
        if self.holding:
            return []
        closing = [(p, d.reason) for p, d in self._decisions(now) if d.close]
        return [self._close(p, now, reason) for p, reason in closing if self._judged_first_round(p)]

    def hold(self) -> None:
        """Stop closing rounds (the final flush is coming): submissions are still checked and queued."""
        self.holding = True

    def close_all(self, now: float) -> list[RoundResult]:
        """Close every fragment's round that has accepted submissions, whatever quorum and grace say.

        The final flush at the end of a run: the islands have stopped and cut their last progress into
        submissions, no more will come, so waiting for a quorum would only leave that work unmerged.
        The step is the islands' weighted mean position (plain mean whatever `merge_rule`, `average_step`,
        no momentum); rounds close normally again.
        """
        out = [self._close(p, now, "final flush", final=True) for p in range(self.plan.num_fragments)
               if self._open[p].pending and self._judged_first_round(p)]
        self.holding = False
        return out

    def next_wakeup_s(self, now: float) -> float:
        """Seconds until a round could close without a new arrival (inf when only arrivals matter)."""
        if self.holding:
            return math.inf
        return min((d.wait_s for _, d in self._decisions(now)), default=math.inf)

    def _live_islands(self) -> int:
        # What "every island" means for K = all and for a round's share of a full round (at least 1).
        return max(1, len(self.islands))

    def _quorum(self) -> int:
        # K follows membership where pools are elastic (policies.quorum.membership_quorum); else the configured K.
        s = self.settings
        if not s.elastic_slots:
            return s.min_quorum
        return membership_quorum(s.min_quorum, fixed_slots=s.fixed_slots,
                                 elastic_members=sum(1 for i in self.islands if i in s.elastic_slots))

    def _round_quorum(self, p: int) -> int:
        # Under the poison guard a fragment's first round waits for enough islands to outvote a bad one.
        if self.guard is not None and self.versions[p] == 0:
            return first_round_quorum(self._quorum(), self._live_islands())
        return self._quorum()

    def _judged_first_round(self, p: int) -> bool:
        """Judge fragment p's first round by its submissions against each other (policies.poison_guard), refuse
        the poisoned ones and record the rest; whether any remain to merge. Later rounds pass unchanged."""
        if self.guard is None or self.versions[p] > 0:
            return bool(self._open[p].pending)
        return judge_opening_round(self._open[p], p, self.guard, self.streaks, self._refuse)

    def _pending_islands(self, p: int) -> int:
        # Quorum counts islands, not submissions: a fast island's second submission is not a second vote.
        # A submission votes if its incarnation was live when it arrived (dying afterwards does not take
        # the vote back: K = 1 rounds would stall). A dead island's work that arrives late, or salvaged,
        # joins the round without a vote.
        return len(self._open[p].voters)

    def _decisions(self, now: float):
        for p in range(self.plan.num_fragments):
            if not self._open[p].pending:
                continue
            yield p, decide_round(
                now=now, pending=self._pending_islands(p),
                min_quorum=self._round_quorum(p), live_islands=self._live_islands(),
                quorum_reached_at=self._open[p].quorum_at, grace_s=self._open[p].grace_s,
            )

    def _close(self, p: int, now: float, reason: str, final: bool = False) -> RoundResult:
        t0 = time.perf_counter()
        round_ = self._open[p]
        pending = round_.pending
        subs = [e.sub for e in pending]
        refused = round_.refused
        merged = self.merges.merge(p, pending, settings=self.settings, live_islands=self._live_islands(), final=final)
        self.versions[p] += 1
        version = self.versions[p]
        note_version(self.base_digests, p, version, self.params[p])
        record = RoundRecord.of(
            p, version, subs, weights=merged.weights, staleness=[e.staleness for e in pending],
            quorum_s=(round_.quorum_at or now) - round_.opened_at, grace_s=round_.grace_s,
            wait_s=now - round_.opened_at, merge_s=time.perf_counter() - t0, reason=reason,
            step_scale=merged.step_scale, rda_factor=merged.rda_factor,
        )
        self._account(p, subs, record)
        round_.clear()
        round_.opened_at = now
        log.info("round fragment %d -> v%d: islands %s weights %s staleness %s (%s)", p, version,
                 record.participants, [round(w, 3) for w in merged.weights], record.staleness, reason)
        tensors = [t.clone() for t in self.params[p]] if self.copy_results else list(self.params[p])
        return RoundResult(p, version, tensors, tuple(s.key for s in subs), record, tuple(refused))

    def _account(self, p: int, subs: list[Submission], record: RoundRecord) -> None:
        # A closed round's tokens, served average, useful time, data cursors, uptime and record.
        self.tokens_merged[p] += record.tokens
        if self.average is not None:
            self.average.update(p, self.params[p], record.tokens, self.tokens_merged[p])
        self.useful_s += sum(s.compute_s for s in subs) / self.plan.num_fragments
        for s in subs:
            self.resume_cursor[s.island] = max(self.resume_cursor.get(s.island, DataCursor()), DataCursor.of(s.cursor))
            self.first_merged.setdefault(s.island, record.wall_time)
        self.advances.append(record.wall_time)
        self.rounds.append(record)

    def observe_publish(self, seconds: float, merge_s: float = 0.0) -> None:
        """Record the time to merge and publish a round (t_sync of the grace window)."""
        self.sync_time.update(merge_s + seconds)

    # ---------------------------------------------------------------- views

    def fragment(self, p: int) -> list[torch.Tensor]:
        """A private copy of the current global tensors of fragment p."""
        return [t.clone() for t in self.params[p]]

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """All current global parameters by name (copies)."""
        return self._by_name(self.params)

    def served_parameters(self) -> dict[str, torch.Tensor]:
        """The run's model by name (copies): the moving average under `average_window`, else the global parameters."""
        return self._by_name(self.params if self.average is None else self.average.fragments)

    def _by_name(self, fragments: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-fragment tensor lists (the parameters' or the average's) as copies by parameter name."""
        return {n: t.clone() for names, frag in zip(self.plan.fragments, fragments) for n, t in zip(names, frag)}

    def pending_tokens(self) -> list[int]:
        """Per fragment: tokens in accepted submissions waiting for their round."""
        return [sum(e.sub.tokens for e in r.pending) for r in self._open]

    def record_late(self, sub: Submission) -> None:
        """A submission taken after stop began: received, never merged (in flight at stop)."""
        if 0 <= sub.fragment < self.plan.num_fragments:
            self.received.setdefault((sub.island, sub.incarnation), [0] * self.plan.num_fragments)[sub.fragment] += sub.tokens
            self.tokens_late[sub.fragment] += sub.tokens

    def take_diverged(self) -> set[tuple[int, int]]:
        """(island, incarnation) pairs that sent non-finite outer gradients since the last call."""
        out, self._diverged = self._diverged, set()
        return out

    def take_poisoned(self) -> set[tuple[int, int]]:
        """(island, incarnation) pairs marked for a restart since the last call: refused as poisoned
        `poison_restart_after` times in a row, or once far out of line (policies.poison_guard.RefusalStreaks)."""
        out, self._poisoned = self._poisoned, set()
        return out

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON metadata) for a checkpoint: parameters, outer optimizer state, versions, ledger, cursors
        (core/outer_checkpoint.py)."""
        return checkpoint_of(self)

    def build_optimizers(self) -> None:
        """Build each fragment's torch optimizer now (see FragmentOuterOptimizer.build): the actor does this at
        start so the first round is not delayed; a driver that only writes checkpoint 0 never pays for it."""
        for opt in self._opts:
            opt.build()

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore from `state_dict()` output; refuses a checkpoint of another model or fragment plan."""
        restore_checkpoint(self, tensors, meta)

    def ledger(self) -> dict[str, list[int]]:
        """Per-fragment token ledger: merged, refused, pending."""
        return {"merged": list(self.tokens_merged), "refused": list(self.tokens_refused), "pending": self.pending_tokens(),
                "late": list(self.tokens_late)}
