"""OuterOptimizer: the single source of truth for the global parameters (DESIGN.md section 3).

A plain class, stepped with submissions and the current time. Per fragment p it keeps the global
tensors, a Nesterov outer optimizer, the version, a ring of recent versions and the pending
submissions. A round closes on quorum + grace (policies.quorum), merges with token weights
(policies.weighting) and RDA (policies.merge), applies the outer step and yields a `RoundResult`
for the shell to publish. Bad submissions are refused, counted and logged; they never touch state.

The Ray shell that polls islands and publishes lives in orchestrator/actors/outer.py.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from islands.messages import Submission, SubmissionKey
from orchestrator.core.checkpoint import AVERAGE_PREFIX, PARAM_PREFIX
from orchestrator.core.settings import OuterSettings  # re-exported: the outer optimizer's settings
from policies.averaging import average_weight
from policies.compression import WIRE_DTYPES, Compressed, decompress
from policies.fragments import FragmentPlan
from policies.merge import RdaAcrossRounds, join_segments, merge_fragment
from policies.outer_optimizer import FragmentOuterOptimizer, is_clock_rule, round_step_scale
from policies.quorum import MovingAverage, decide_round, grace_window_s
from policies.staleness import VersionRing, check_staleness
from policies.sync_schedule import sync_every_at
from policies.weighting import merge_weights

log = logging.getLogger(__name__)

@dataclass
class RoundRecord:
    """One merged round, as it goes to the event log."""

    fragment: int
    version: int
    participants: list[int]
    incarnations: list[int]
    seqs: list[int]
    weights: list[float]
    staleness: list[int]
    tokens: int
    inner_steps: int
    bytes: int
    quorum_s: float  # round open -> quorum reached
    grace_s: float  # grace window granted at quorum
    wait_s: float  # round open -> close
    merge_s: float  # decompress + merge + outer step
    reason: str
    step_scale: float = 1.0  # the factor on the merged outer gradient (policies.outer_optimizer.round_step_scale)
    rda_factor: float = 1.0  # RdaAcrossRounds' lengthening of the outer gradient, size-weighted mean over tensors
    wall_time: float = field(default_factory=time.time)


@dataclass
class Refusal:
    """A refused submission, as it goes to the event log."""

    island: int
    incarnation: int
    seq: int
    fragment: int
    tokens: int
    reason: str
    wall_time: float = field(default_factory=time.time)

    @property
    def key(self) -> SubmissionKey:
        """The refused submission's identity."""
        return SubmissionKey(self.island, self.incarnation, self.seq)


@dataclass
class RoundResult:
    """A new global version of one fragment for the shell to publish to every live island."""

    fragment: int
    version: int
    tensors: list[torch.Tensor]  # a private copy, safe to hand to the object store
    merged: tuple[SubmissionKey, ...]
    record: RoundRecord


class OuterOptimizer:
    """Global parameters, outer momentum, versions, version ring, pending rounds and token ledger."""

    def __init__(
        self,
        initial: dict[str, torch.Tensor],
        plan: FragmentPlan,
        *,
        settings: OuterSettings,
        embedding_names: frozenset[str] | set[str] = frozenset(),
        now: float = 0.0,
    ) -> None:
        self.plan = plan
        self.settings = settings
        self.progress: float | None = None  # tokens processed / budget, as the driver last said (tau_schedule)
        P = plan.num_fragments
        self.params = [[initial[n].detach().to(torch.float32).clone() for n in frag] for frag in plan.fragments]
        self._shapes = [[tuple(t.shape) for t in frag] for frag in self.params]
        self._embedding_mask = [[n in embedding_names for n in frag] for frag in plan.fragments]
        self._opts = [
            FragmentOuterOptimizer(self.params[p], lr=settings.lr, momentum=settings.momentum,
                                   partial_momentum=settings.partial_momentum) for p in range(P)
        ]
        # Per fragment: RDA's norm rule across partial rounds (policies.merge.RdaAcrossRounds), if enabled.
        tracked = [[settings.merge_rule == "rda" and not emb for emb in mask] for mask in self._embedding_mask]
        self._rda_windows = [RdaAcrossRounds(len(tracked[p]), tracked[p]) if settings.rda_across_rounds else None
                             for p in range(P)]
        # The served model (run.average_window): a moving average of each fragment's global tensors, or None.
        self.average = None if settings.average_window is None else [[t.clone() for t in frag] for frag in self.params]
        self.versions = [0] * P
        # Recent versions per fragment: what any accepted submission can have been measured from.
        self._rings: list[VersionRing] = [VersionRing(settings.max_staleness + 1) for _ in range(P)]
        for p in range(P):
            self._rings[p].push(0, [t.clone() for t in self.params[p]])
        # Accepted submissions per fragment: (submission, staleness, decoded fp32 deltas).
        self._pending: list[list[tuple[Submission, int, list[torch.Tensor]]]] = [[] for _ in range(P)]
        # Per fragment, the islands whose pending submissions vote toward its quorum (see _pending_islands).
        self._voters: list[set[int]] = [set() for _ in range(P)]
        self._round_open = [now] * P
        self._quorum_at: list[float | None] = [None] * P
        self._grace = [0.0] * P
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
        self.resume_cursor: dict[int, int] = {}  # island slot -> data cursor of its newest merged submission
        self.advances: list[float] = []  # wall times of version advances (uptime)
        self._diverged: set[tuple[int, int]] = set()  # (island, incarnation) that sent non-finite values

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

    # ---------------------------------------------------------------- submissions

    def _check(self, sub: Submission) -> tuple[str | None, int, list[torch.Tensor]]:
        live = self.islands.get(sub.island)
        last = self._last_incarnation.get(sub.island)
        # Work a slot's newest incarnation sent before it died (late off the wire) is still good, and so is
        # a salvaged snapshot of any incarnation we admitted, even once the next one is live. Both join a
        # round but never count toward its quorum (_pending_islands).
        if sub.salvaged:
            if last is None or sub.incarnation > last:
                return f"unknown or dead island {sub.island}: salvaged work of incarnation {sub.incarnation}", 0, []
        elif live is None and sub.incarnation != last:
            return f"unknown or dead island {sub.island}", 0, []
        elif live is not None and sub.incarnation != live:
            return f"stale incarnation {sub.incarnation} of island {sub.island} (live: {live})", 0, []
        if not 0 <= sub.fragment < self.plan.num_fragments:
            return f"fragment {sub.fragment} out of range 0..{self.plan.num_fragments - 1}", 0, []
        if sub.tokens < 0 or sub.inner_steps <= 0:
            return f"bad counters tokens={sub.tokens} inner_steps={sub.inner_steps}", 0, []
        shapes = self._shapes[sub.fragment]
        if len(sub.payload) != len(shapes):
            return f"fragment {sub.fragment} has {len(shapes)} tensors, submission has {len(sub.payload)}", 0, []
        wire = WIRE_DTYPES[self.settings.compression]
        for i, (c, shape) in enumerate(zip(sub.payload, shapes)):
            if not isinstance(c, Compressed) or c.scheme != self.settings.compression:
                return f"tensor {i}: wire format is not {self.settings.compression!r}", 0, []
            if c.payload.dtype != wire:
                return f"tensor {i}: dtype {c.payload.dtype} is not {wire} for {c.scheme!r}", 0, []
            if tuple(c.shape) != shape:
                return f"tensor {i}: shape {tuple(c.shape)} != {shape}", 0, []
        decision = check_staleness(
            current_version=self.versions[sub.fragment], base_version=sub.base_version,
            max_staleness=self.settings.max_staleness,
        )
        if not decision.accept:
            return decision.reason, decision.staleness, []
        try:
            deltas = [decompress(c) for c in sub.payload]
        except Exception as err:  # noqa: BLE001 - a malformed payload is the sender's fault, refuse it
            return f"payload does not decode: {err}", 0, []
        for i, d in enumerate(deltas):
            if tuple(d.shape) != shapes[i]:
                return f"tensor {i}: decoded shape {tuple(d.shape)} != {shapes[i]}", 0, []
            # NaN/Inf propagate into a sum, so one reduction clears the common case; only a non-finite
            # sum (which finite values can also reach by overflow) pays for the elementwise scan.
            if not torch.isfinite(d.sum()) and not torch.isfinite(d).all():
                return f"tensor {i}: non-finite values (NaN/Inf)", 0, []
        return None, decision.staleness, deltas

    def receive(self, sub: Submission, now: float) -> tuple[list[RoundResult], Refusal | None]:
        """Take one submission; refuse it or queue it, then close any round that is due."""
        reason, staleness, deltas = self._check(sub)
        if 0 <= sub.fragment < self.plan.num_fragments:
            self.received.setdefault((sub.island, sub.incarnation), [0] * self.plan.num_fragments)[sub.fragment] += max(sub.tokens, 0)
        if reason is not None:
            if "non-finite" in reason:
                self._diverged.add((sub.island, sub.incarnation))
            refusal = Refusal(sub.island, sub.incarnation, sub.seq, sub.fragment, max(sub.tokens, 0), reason)
            if 0 <= sub.fragment < self.plan.num_fragments:
                self.tokens_refused[sub.fragment] += refusal.tokens
            self.refusals.append(refusal)
            log.warning("refused submission %s/%s seq %s fragment %s: %s",
                        sub.island, sub.incarnation, sub.seq, sub.fragment, reason)
            return self.poll(now), refusal
        p = sub.fragment
        self.bytes_received += sub.nbytes
        if sub.step_time_s > 0:
            self.step_time.update(sub.step_time_s)
        self._pending[p].append((sub, staleness, deltas))
        if not sub.salvaged and self.islands.get(sub.island) == sub.incarnation:
            self._voters[p].add(sub.island)
        if self._quorum_at[p] is None and self._pending_islands(p) >= self.settings.min_quorum:
            self._quorum_at[p] = now
            self.quorum_time.update(now - self._round_open[p])
            self._grace[p] = grace_window_s(
                gamma=self.settings.grace_gamma,
                tau_steps=sync_every_at(self.progress, self.settings.tau_schedule, self.settings.tau_steps),
                step_time_s=self.step_time.value, quorum_time_s=self.quorum_time.value,
                sync_time_s=self.sync_time.value, cap_s=self.settings.grace_cap_s,
            )
        return self.poll(now), None

    def poll(self, now: float) -> list[RoundResult]:
        """Close every round whose quorum and grace rules say so."""
        if self.holding:
            return []
        return [self._close(p, now, d.reason) for p, d in self._decisions(now) if d.close]

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
        out = [self._close(p, now, "final flush", final=True) for p in range(self.plan.num_fragments) if self._pending[p]]
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

    def _pending_islands(self, p: int) -> int:
        # Quorum counts islands, not submissions: a fast island's second submission is not a second vote.
        # A submission votes if its incarnation was live when it arrived (dying afterwards does not take
        # the vote back: K = 1 rounds would stall). A dead island's work that arrives late, or salvaged,
        # joins the round without a vote.
        return len(self._voters[p])

    def _decisions(self, now: float):
        for p in range(self.plan.num_fragments):
            if not self._pending[p]:
                continue
            yield p, decide_round(
                now=now, pending=self._pending_islands(p),
                min_quorum=self.settings.min_quorum, live_islands=self._live_islands(),
                quorum_reached_at=self._quorum_at[p], grace_s=self._grace[p],
            )

    def _close(self, p: int, now: float, reason: str, final: bool = False) -> RoundResult:
        t0 = time.perf_counter()
        subs = [s for s, _, _ in self._pending[p]]
        staleness = [st for _, st, _ in self._pending[p]]
        # An island's several submissions in one round are consecutive segments: weighted and merged as one.
        groups, deltas = join_segments([(s.island, s.incarnation) for s in subs], [d for _, _, d in self._pending[p]])
        tokens = [sum(subs[i].tokens for i in g) for g in groups]
        group_weights = merge_weights(
            tokens=tokens, steps=[sum(subs[i].inner_steps for i in g) for g in groups],
            scheme=self.settings.weighting, staleness=[max(staleness[i] for i in g) for g in groups],
            staleness_discount=self.settings.staleness_discount,
        )
        # The final flush moves to the islands' weighted mean position. Radial-directional averaging lengthens
        # the merged step to the islands' mean norm, which later rounds would correct; after the last round it
        # only amplifies their disagreement: on identical held-out batches the RDA flush raised the final loss
        # by 0.54-0.70% in four default 3M runs, the mean flush lowered it by 0.65-1.11% in four more
        # (benchmarks/RESULTS.md, the final flush).
        rule = "mean" if final else self.settings.merge_rule
        outer_grad = merge_fragment(deltas, group_weights, rule=rule, embedding_mask=self._embedding_mask[p])
        weights = [0.0] * len(subs)  # per submission, for the record: its group's weight shared by tokens
        for g, members in enumerate(groups):
            for i in members:
                weights[i] = group_weights[g] * (subs[i].tokens / tokens[g] if tokens[g] else 1.0 / len(members))
        scale, rda_factor = 1.0, 1.0
        if final:
            self._opts[p].average_step(outer_grad)
        else:
            scale = round_step_scale(self.settings.step_scale, participants=len({s.island for s in subs}),
                                     live_islands=self._live_islands())
            window = self._rda_windows[p]
            if window is not None:
                factors = window.update(outer_grad, scale)
                outer_grad = [g.mul_(f) if f != 1.0 else g for g, f in zip(outer_grad, factors)]
                sizes = [g.numel() for g in outer_grad]
                rda_factor = sum(f * n for f, n in zip(factors, sizes)) / max(1, sum(sizes))
            self._opts[p].step(outer_grad, scale=scale, clock=is_clock_rule(self.settings.step_scale))
        self.versions[p] += 1
        version = self.versions[p]
        self._rings[p].push(version, [t.clone() for t in self.params[p]])
        merge_s = time.perf_counter() - t0
        record = RoundRecord(
            fragment=p, version=version, participants=[s.island for s in subs],
            incarnations=[s.incarnation for s in subs], seqs=[s.seq for s in subs], weights=list(weights),
            staleness=staleness, tokens=sum(s.tokens for s in subs), inner_steps=sum(s.inner_steps for s in subs),
            bytes=sum(s.nbytes for s in subs),
            quorum_s=(self._quorum_at[p] or now) - self._round_open[p], grace_s=self._grace[p],
            wait_s=now - self._round_open[p], merge_s=merge_s, reason=reason, step_scale=scale, rda_factor=rda_factor,
        )
        self.tokens_merged[p] += record.tokens
        if self.average is not None:
            w = average_weight(record.tokens, self.tokens_merged[p], self.settings.average_window)
            with torch.no_grad():
                for a, t in zip(self.average[p], self.params[p]):
                    a.lerp_(t, w)
        self.useful_s += sum(s.compute_s for s in subs) / self.plan.num_fragments
        for s in subs:
            self.resume_cursor[s.island] = max(self.resume_cursor.get(s.island, 0), s.cursor)
        self.advances.append(record.wall_time)
        self.rounds.append(record)
        self._pending[p] = []
        self._voters[p] = set()
        self._quorum_at[p] = None
        self._round_open[p] = now
        log.info("round fragment %d -> v%d: islands %s weights %s staleness %s (%s)", p, version,
                 record.participants, [round(w, 3) for w in weights], staleness, reason)
        return RoundResult(p, version, [t.clone() for t in self.params[p]], tuple(s.key for s in subs), record)

    def observe_publish(self, seconds: float, merge_s: float = 0.0) -> None:
        """Record the time to merge and publish a round (t_sync of the grace window)."""
        self.sync_time.update(merge_s + seconds)

    # ---------------------------------------------------------------- views

    def fragment(self, p: int) -> list[torch.Tensor]:
        """A private copy of the current global tensors of fragment p."""
        return [t.clone() for t in self.params[p]]

    def version_of(self, p: int, version: int) -> list[torch.Tensor]:
        """Fragment p as it was at `version` (KeyError if older than the ring keeps)."""
        return self._rings[p].get(version)

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """All current global parameters by name (copies)."""
        return self._by_name(self.params)

    def served_parameters(self) -> dict[str, torch.Tensor]:
        """The run's model by name (copies): the moving average under `average_window`, else the global parameters."""
        return self._by_name(self.params if self.average is None else self.average)

    def _by_name(self, fragments: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-fragment tensor lists (the parameters' or the average's) as copies by parameter name."""
        return {n: t.clone() for names, frag in zip(self.plan.fragments, fragments) for n, t in zip(names, frag)}

    def pending_tokens(self) -> list[int]:
        """Per fragment: tokens in accepted submissions waiting for their round."""
        return [sum(s.tokens for s, _, _ in pend) for pend in self._pending]

    def record_late(self, sub: Submission) -> None:
        """A submission taken after stop began: received, never merged (in flight at stop)."""
        if 0 <= sub.fragment < self.plan.num_fragments:
            self.received.setdefault((sub.island, sub.incarnation), [0] * self.plan.num_fragments)[sub.fragment] += sub.tokens
            self.tokens_late[sub.fragment] += sub.tokens

    def take_diverged(self) -> set[tuple[int, int]]:
        """(island, incarnation) pairs that sent non-finite outer gradients since the last call."""
        out, self._diverged = self._diverged, set()
        return out

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON metadata) for a checkpoint: parameters, outer momentum, versions, ledger, cursors."""
        tensors: dict[str, torch.Tensor] = {}
        windows = [None if w is None else w.state_dict() for w in self._rda_windows]
        for p, (names, frag) in enumerate(zip(self.plan.fragments, self.params)):
            state = self._opts[p].state_dict()["sgd"]["state"]
            for i, (name, t) in enumerate(zip(names, frag)):
                tensors[PARAM_PREFIX + name] = t.clone()
                buf = state.get(i, {}).get("momentum_buffer")
                if buf is not None:
                    tensors[f"momentum/{name}"] = buf.clone()
            if self.average is not None:
                for name, a in zip(names, self.average[p]):
                    tensors[AVERAGE_PREFIX + name] = a.clone()
            if windows[p] is not None:
                for name, v in zip(names, windows[p]["sums"]):
                    if v is not None:
                        tensors[f"rda_window/{name}"] = v
        meta = {
            "versions": list(self.versions), "tokens_merged": list(self.tokens_merged),
            "tokens_refused": list(self.tokens_refused), "bytes_received": self.bytes_received,
            # Pending submissions are not saved: after a restore they were never received (and so lost).
            "received": [[i, inc, toks] for (i, inc), toks in self._received_without_pending().items()],
            "useful_s": self.useful_s, "resume_cursor": {str(k): v for k, v in self.resume_cursor.items()},
            "rounds": len(self.rounds), "fragments": [list(f) for f in self.plan.fragments],
            "rda_window_norms": [None if w is None else w["norms"] for w in windows],
        }
        return tensors, meta

    def _received_without_pending(self) -> dict[tuple[int, int], list[int]]:
        out = {k: list(v) for k, v in self.received.items()}
        for pend in self._pending:
            for sub, _, _ in pend:
                out[(sub.island, sub.incarnation)][sub.fragment] -= sub.tokens
        return out

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore from `state_dict()` output; refuses a checkpoint of another model or fragment plan."""
        if [list(f) for f in self.plan.fragments] != meta.get("fragments"):
            raise ValueError("checkpoint was written for another model or fragment plan; start a new run directory")
        for p, names in enumerate(self.plan.fragments):
            with torch.no_grad():
                for t, name in zip(self.params[p], names):
                    t.copy_(tensors[PARAM_PREFIX + name])
            sgd = self._opts[p].state_dict()
            sgd["sgd"]["state"] = {i: {"momentum_buffer": tensors[f"momentum/{n}"].clone()}
                                   for i, n in enumerate(names) if f"momentum/{n}" in tensors}
            self._opts[p].load_state_dict(sgd)
            norms = (meta.get("rda_window_norms") or [None] * len(self.plan.fragments))[p]
            if self._rda_windows[p] is not None and norms is not None:  # else the window starts empty
                self._rda_windows[p].load_state_dict(
                    {"norms": norms, "sums": [tensors.get(f"rda_window/{n}") for n in names]})
            if self.average is not None:  # a checkpoint written without averaging starts it at its global model
                self.average[p] = [tensors.get(AVERAGE_PREFIX + n, t).clone() for n, t in zip(names, self.params[p])]
            self._rings[p] = VersionRing(self.settings.max_staleness + 1)
            self._rings[p].push(meta["versions"][p], [t.clone() for t in self.params[p]])
            self._pending[p] = []
            self._voters[p] = set()
            self._quorum_at[p] = None
        self.versions = list(meta["versions"])
        self.tokens_merged = list(meta["tokens_merged"])
        self.tokens_refused = list(meta["tokens_refused"])
        self.bytes_received = meta["bytes_received"]
        self.received = {(i, inc): list(toks) for i, inc, toks in meta["received"]}
        self.useful_s = meta["useful_s"]
        self.resume_cursor = {int(k): v for k, v in meta["resume_cursor"].items()}

    def ledger(self) -> dict[str, list[int]]:
        """Per-fragment token ledger: merged, refused, pending."""
        return {"merged": list(self.tokens_merged), "refused": list(self.tokens_refused), "pending": self.pending_tokens(),
                "late": list(self.tokens_late)}
