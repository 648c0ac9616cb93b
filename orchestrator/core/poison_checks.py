"""The poison guard's side of the outer optimizer (policies.poison_guard): when a submission is judged.

After a fragment's first round each submission is judged on arrival against the islands' recent ones
(:func:`judge_arrival`). A first round has no momentum or history yet to compare an outer gradient with, so
it is judged as a whole when it closes, each submission's size and its cosines with the others' deciding
(:func:`judge_opening_round`). Before either, a submission's base digest is checked against what was published
as the version it names (:func:`stale_base`, policies/base_check.py). The outer optimizer refuses what is judged
poisoned; the rest is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from islands.messages import Submission
from orchestrator.core.round_merge import decoded
from orchestrator.core.rounds import OpenRound, Pending
from orchestrator.core.settings import OuterSettings
from orchestrator.core.submission_check import Verdict
from policies.base_check import BaseDigests, fragment_digest
from policies.poison_guard import FAR_OUT, PoisonGuard, Reading, RefusalStreaks, judge_first_round, reading_of

__all__ = ["base_digests_for", "first_round_verdicts", "judge_arrival", "judge_opening_round", "note_version", "stale_base"]


def base_digests_for(settings: OuterSettings, num_fragments: int) -> BaseDigests | None:
    """The record of published versions' digests the stale-base check needs: under the guard, and only where islands
    hold the published float32 tensors bit for bit (no lossy downlink); else None."""
    exact = settings.downlink == "none" and settings.downlink_delta is None
    return BaseDigests(num_fragments, settings.max_staleness + 2) if settings.poison_guard and exact else None


def note_version(digests: BaseDigests | None, p: int, version: int, params: Sequence[torch.Tensor]) -> None:
    """Record the digest of fragment `p`'s global tensors `params` as `version`, unless known (or not kept)."""
    if digests is not None and not digests.knows(p, version):
        digests.record(p, version, fragment_digest(params))


def stale_base(sub: Submission, digests: BaseDigests | None, epoch: int, version: int,
               params: Sequence[torch.Tensor]) -> str | None:
    """Why `sub` is refused as measured from a base other than the version it names (policies.base_check), far out
    of line (its island is restarted at once: its copy is wrong, not its judgement), or None. `version` and `params`:
    the fragment's current ones; a base from another `epoch` (before the outer optimizer restarted) is not checked."""
    # Every version a round closes on had a submission received at it, so noting the current one here (whatever the
    # submission's epoch) records each version before its step changes the tensors.
    note_version(digests, sub.fragment, version, params)
    if digests is None or sub.base_epoch != epoch:
        return None
    problem = digests.problem(sub.fragment, sub.base_version, sub.base_digest)
    return None if problem is None else FAR_OUT + problem


def judge_arrival(p: int, sub: Submission, verdict: Verdict, guard: PoisonGuard, streaks: RefusalStreaks,
                  momentum: Sequence[torch.Tensor | None]) -> str | None:
    """Why `sub` (accepted by the submission check as `verdict`) is refused as poisoned, judged against fragment
    `p`'s recent outer gradients and its outer `momentum`, or None (its streak ends). Its reading joins the window
    either way (policies.poison_guard: what the window holds)."""
    reading = reading_of(sub.island, [decoded(d) for d in verdict.deltas], verdict.norms, sub.inner_steps, momentum)
    poisoned = guard.judge(p, reading, started_mid_run=sub.started_at_version > 0)
    guard.record(p, reading)
    if poisoned is None:
        streaks.accepted(sub.island, sub.incarnation)
    return poisoned


def judge_opening_round(round_: OpenRound, p: int, guard: PoisonGuard, streaks: RefusalStreaks,
                        refuse: Callable[[Submission, str], object]) -> bool:
    """Judge fragment `p`'s first round (:func:`first_round_verdicts`): `refuse` the poisoned submissions and drop
    them from `round_`, record every reading with `guard` and the rest with `streaks`; whether any remain to merge."""
    kept = []
    for e, reason, reading in first_round_verdicts(round_.pending):
        guard.record(p, reading)
        if reason is not None:
            refuse(e.sub, reason)
            round_.refused.append(e.sub.key)
            continue
        kept.append(e)
        streaks.accepted(e.sub.island, e.sub.incarnation)
    round_.pending = kept
    round_.voters &= {e.sub.island for e in kept}
    return bool(kept)


def first_round_verdicts(pending: Sequence[Pending]) -> list[tuple[Pending, str | None, Reading]]:
    """Per pending submission: itself, why it is refused (None: kept) and the reading to record (its
    size per root inner step, its alignment with the other kept islands, the fragment's elements)."""
    deltas = [[decoded(d) for d in e.deltas] for e in pending]
    sq = [sum(float(torch.linalg.vector_norm(t)) ** 2 for t in ds) for ds in deltas]
    n = len(deltas)
    dots = [[sum(float(torch.dot(a.reshape(-1), b.reshape(-1))) for a, b in zip(deltas[i], deltas[j]))
             for j in range(n)] for i in range(n)]
    cosines = [[dots[i][j] / math.sqrt(sq[i] * sq[j]) if sq[i] > 0 and sq[j] > 0 else 0.0 for j in range(n)]
               for i in range(n)]
    sizes = [math.sqrt(sq[i]) / math.sqrt(max(1, e.sub.inner_steps)) for i, e in enumerate(pending)]
    elements = sum(t.numel() for t in deltas[0]) if deltas else 0
    verdicts = judge_first_round([e.sub.island for e in pending], sizes, cosines, elements)
    return [(e, reason, Reading(e.sub.island, size, alignment, elements, e.sub.inner_steps))
            for e, size, (reason, alignment) in zip(pending, sizes, verdicts)]
