"""The poison guard: refuse an outer gradient that is finite and well shaped but wrong (docs/architecture.md section 3).

The submission checks (orchestrator/core/submission_check.py) refuse what is malformed: the wrong
shape, NaN, a base too old. An island with a bug or an attacker behind it can send what passes them
and still spoils the model: its outer gradient scaled 100x, its sign flipped, measured from a base
long gone, or noise. The guard judges each accepted submission of a fragment against what the *other*
islands sent for that fragment recently, by two readings (:class:`Reading`):

- **size**: ``||delta|| / sqrt(inner_steps)``. AdamW moves each coordinate by about ``lr`` a step, so H
  steps move a fragment between ``sqrt(H)`` (uncorrelated steps) and ``H`` (aligned) steps' worth;
  dividing by ``sqrt(H)`` puts a partial submission (a salvaged snapshot, a flush, an island restarted
  mid-round) at or below a full one, and only sizes far *above* the others' are refused.
- **alignment**: the cosine between the outer gradient and the fragment's outer momentum, which holds
  the recent merged outer gradients: the direction the islands have been agreeing on. An honest island
  points along it; a flipped one points against it, noise of any norm is orthogonal to it (a random
  direction's cosine is about ``1/sqrt(n)`` for ``n`` parameters), an outer gradient from a stale base
  carries the fragment's whole drift since then and shows in the size, once the drift is large (the exact
  check that catches it at once compares base digests: policies/base_check.py).

The constants are the same for every model (no per-model tuning). A size is refused above
``median * max(SIZE_RATIO_FLOOR, exp(Z * sigma))`` of the others' sizes in log space, sigma being
``1.4826 * MAD`` (the normal-consistent spread) and Z the usual outlier cut of modified z-scores. An
alignment is refused when it is not significantly positive, below ``Z / sqrt(n)`` (what a random
direction in ``n`` dimensions exceeds with probability about 2e-4), while the others' median is well
above that (twice), scaled by the submission's share of the others' inner steps (:func:`step_share`): so
noise and flips are refused, and an honest partial submission, whose few steps align less than a full one's
(a final flush's one step read +0.0061 where full ones read +0.2), is not judged. In a default run's clean rounds honest alignments were 0.05-0.86
against a limit of about 0.007 (docs/architecture.md section 3 has the measurements). Nothing is judged
until readings of at least ``MIN_OTHER_ISLANDS`` other islands are in the window: with two islands
there is no majority to tell the bad one from the good one. Without outer momentum
(``outer.momentum: 0``) there is no direction to compare with, and only the size is judged.

**The first round** of a fragment has no momentum and no history, and what it merges becomes the
momentum every later judgement leans on: one poisoned island merged alone in it turned the honest
islands' alignments negative for ten rounds (measured). So under the guard a fragment's first round
waits for ``FIRST_ROUND_ISLANDS`` islands (or every live one, if fewer: :func:`first_round_quorum`),
and :func:`judge_first_round` judges them against each other: the size rule against the others'
sizes, and each one's median cosine with the others against the limit, where the others agree among
themselves (early outer gradients of honest islands point the same way: cosines of 0.6-0.86 measured).

**What the window holds.** Every judged reading, refused ones too, at most ``PER_ISLAND`` per island: the
reference is what the islands send, not what the guard let through. A window of accepted readings only kept the
honest islands' alignments from when they agreed while their current ones fell to about zero, and then refused
them all (the hour soak of 2026-12-02: 3,453 honest refusals, nearly every fragment-0 submission in its last 4
minutes). In process, 4 honest nano islands on real text drift so (benchmarks/guard_drift.py): the cosine of
fragment 0's outer gradients with its momentum fell from +0.09 after 40 cuts each to -0.08 after 120, and with the
other island's latest one to about 0 (fragment 1's stayed at +0.12 to +0.30). Once the others do not agree, the
gate closes and only sizes are
judged. A poisoned island's refused readings only ever judge the others, and only toward leniency (a higher size
median, a lower cosine median); the cap keeps a fast one from crowding the honest readings out.

Pure: no Ray, no clock; the outer optimizer asks `judge` before a submission joins a round and
`record` once it is judged, refused or not.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FAR_OUT", "FIRST_ROUND_ISLANDS", "POISONED", "PoisonGuard", "Reading", "RefusalStreaks", "first_round_quorum",
           "judge_first_round", "reading_of", "step_share"]

Z = 3.5  # modified z-score outlier cut (Iglewicz and Hoaglin)
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation
SIZE_RATIO_FLOOR = 4.0  # never refuse a size within 4x the others' median, however tight their spread
WINDOW = 32  # readings kept per fragment (of all islands)
PER_ISLAND = 8  # of them at most this many of one island's: a fast (poisoned) one cannot crowd the others out
MIN_OTHER_ISLANDS = 2  # readings of at least this many other islands before anything is judged (a majority)
FIRST_ROUND_ISLANDS = MIN_OTHER_ISLANDS + 1  # islands a fragment's first round waits for under the guard


@dataclass(frozen=True)
class Reading:
    """What the guard knows of one submission of a fragment."""

    island: int
    size: float  # ||outer gradient|| / sqrt(inner steps)
    alignment: float | None  # cosine with the fragment's outer momentum; None: no momentum yet (or none kept)
    elements: int = 0  # elements the cosine was taken over (its significance: a random direction's is ~1/sqrt)
    inner_steps: int = 0  # inner steps it covers (0: not known, as in a checkpoint from before it was kept)


def reading_of(island: int, deltas: Sequence[torch.Tensor], norms: Sequence[float | None], inner_steps: int,
               momentum: Sequence[torch.Tensor | None]) -> Reading:
    """The reading of one submission: its decoded outer gradient per tensor (`deltas`), their norms where known,
    its inner steps and the fragment's momentum buffers (None for a tensor without one)."""
    sq = 0.0
    dot = m_sq = d_sq = 0.0
    elements = 0
    for d, n, m in zip(deltas, norms, momentum):
        n2 = float(torch.linalg.vector_norm(d)) ** 2 if n is None else n * n
        sq += n2
        if m is not None:
            dot += float(torch.dot(d.reshape(-1), m.reshape(-1)))
            m_sq += float(torch.linalg.vector_norm(m)) ** 2
            d_sq += n2
            elements += m.numel()
    size = math.sqrt(sq) / math.sqrt(max(1, inner_steps))
    alignment = dot / math.sqrt(m_sq * d_sq) if m_sq > 0 and d_sq > 0 else None
    return Reading(island, size, alignment, elements, inner_steps)


POISONED = "poisoned: "
"""How every reason the guard gives begins (a Refusal's reason; RefusalStreaks counts only these)."""

FAR_OUT = POISONED + "far out of line, "
"""How a reason begins when the reading is beyond doubt (:data:`FAR_OUT_FACTOR`): RefusalStreaks restarts at once."""

FAR_OUT_FACTOR = 2.0
"""A reading is far out of line when it passes a limit by this factor in the limit's own terms: a size whose log ratio
to the others' median is over twice the limit's (16x at the 4x floor), a cosine below minus the limit (significantly
*against* the others, as likely by chance as one above it, ~2e-4), or a cosine below the limit while *every one* of the
others' recent cosines, scaled by the submission's share of their inner steps (:func:`step_share`), is above twice it.
Scaled and flipped outer gradients read so from their first submission (100x the size; the honest cosines, 0.05-0.86,
negated, against a limit of about 0.007), and noise (a cosine about 0) does where the honest islands are all clearly
aligned; where some honest cosines are near the limit (an island restarted lately), noise waits for the streak, as a
stale base does (its size grows from 1x; the exact check is its digest). The share matters: an honest final flush of
three steps read +0.0047 against a limit of +0.0073 and was marked for a restart by the rule without it (2026-12-07).

A cosine is never far out of line for an incarnation that started mid-run (restarted, or joined late): its first cuts
read lower than the others' (benchmarks/guard_drift.py, fragment 0: +0.000 against +0.093 after 40 cuts each, -0.113
against -0.031 after 80), whether its AdamW state is fresh or copied from a live island: what differs is where it starts, the
global parameters with no progress of its own. In a 10-minute soak with the guard on (8 nano
islands, 121 faults, 2026-12-07, before the window kept refused readings) 84 honest submissions were refused, every
one from an incarnation that started mid-run, with cosines down to -0.23; 70 read far out of line and each
restarted its island, whose next incarnation did the same (70 restarts the guard caused). Its refusals count toward
the streak, which an accepted cut of another fragment ends."""


def _median_sigma(values: Sequence[float]) -> tuple[float, float]:
    med = statistics.median(values)
    return med, MAD_TO_SIGMA * statistics.median(abs(v - med) for v in values)


def _size_problem(size: float, others: Sequence[float]) -> str | None:
    """Why `size` is far above the `others` (log-space median and MAD), or None."""
    logs = [math.log(max(v, 1e-30)) for v in others]
    med, sigma = _median_sigma(logs)
    limit = max(math.log(SIZE_RATIO_FLOOR), Z * sigma)
    ratio = math.exp(math.log(max(size, 1e-30)) - med)
    if math.log(ratio) > limit:
        begins = FAR_OUT if math.log(ratio) > FAR_OUT_FACTOR * limit else POISONED
        return (f"{begins}outer gradient {ratio:.1f}x the size of the other islands' recent ones (limit "
                f"{math.exp(limit):.1f}x; per sqrt inner step)")
    return None


def step_share(steps: int, others: Sequence[int]) -> float:
    """What share of the others' usual inner steps (their median) a submission of `steps` covers, at most 1; 1 where
    either is unknown (0)."""
    known = [n for n in others if n > 0]
    if steps <= 0 or not known:
        return 1.0
    return min(1.0, steps / statistics.median(known))


def _alignment_problem(alignment: float | None, elements: int, others: Sequence[float], against: str,
                       share: float = 1.0, can_be_far_out: bool = True) -> str | None:
    """Why `alignment` (a cosine over `elements` values) is no better than a random direction's while the `others`
    are clearly aligned, or None. `share`: the submission's inner steps as a share of the others' (step_share);
    `can_be_far_out`: False for an incarnation that started mid-run (see FAR_OUT_FACTOR)."""
    if alignment is None or elements <= 0 or not others:
        return None
    limit = Z / math.sqrt(elements)  # a random direction's cosine exceeds this with probability ~2e-4
    med = statistics.median(others)
    # An honest submission of a few steps aligns less: its cosine fell in proportion to its steps in the runs
    # measured (a final flush's one step: +0.0061 where full ones had +0.2), so it is judged only where even that
    # share of the others' cosine clears the gate.
    if med * share <= 2 * limit:
        return None  # the others do not agree on a direction clearly enough to be out of line with
    if alignment < limit:
        far = alignment < -(FAR_OUT_FACTOR - 1) * limit or min(others) * share > 2 * limit
        begins = FAR_OUT if far and can_be_far_out else POISONED
        why = "; started mid-run, so not far out of line" if far and not can_be_far_out else ""
        return (f"{begins}outer gradient's cosine with {against} {alignment:+.4f}, no more than a random "
                f"direction's (limit {limit:+.4f}; the other islands' median {med:+.3f}{why})")
    return None


def first_round_quorum(min_quorum: int, live_islands: int) -> int:
    """K of a fragment's first round under the guard: FIRST_ROUND_ISLANDS islands, or every live one if fewer."""
    return max(min_quorum, min(FIRST_ROUND_ISLANDS, live_islands))


def judge_first_round(islands: Sequence[int], sizes: Sequence[float], cosines: Sequence[Sequence[float]],
                      elements: int) -> list[tuple[str | None, float | None]]:
    """Judge a fragment's first round, where there is no momentum or history, by its submissions against each other.

    `islands[i]`, `sizes[i]`: submission i's island and size (see :class:`Reading`); `cosines[i][j]`: the cosine
    between submissions i and j, over `elements` values. Returns per submission (why it is refused or None, its
    alignment to record: the median of its cosines with the other islands' submissions)."""
    def median_with(i: int, among: Sequence[int]) -> float | None:
        values = [cosines[i][j] for j in among if islands[j] != islands[i]]
        return statistics.median(values) if values else None

    everyone = range(len(islands))
    reasons: list[str | None] = []
    for i in everyone:
        rest = [j for j in everyone if islands[j] != islands[i]]
        if len({islands[j] for j in rest}) < MIN_OTHER_ISLANDS:
            reasons.append(None)
            continue
        # The others' agreement among themselves: each one's median cosine with the rest of the others.
        agreement = [a for j in rest if (a := median_with(j, rest)) is not None]
        reasons.append(_size_problem(sizes[i], [sizes[j] for j in rest])
                       or _alignment_problem(median_with(i, rest), elements, agreement,
                                             "the other islands' outer gradients"))
    # What is recorded is each kept one's agreement with the other kept ones: a refused island's cosines would
    # drag the honest islands' recorded alignment down (to below zero, measured), and open the gate to it later.
    kept = [j for j in everyone if reasons[j] is None]
    return [(reasons[i], median_with(i, kept) if reasons[i] is None else median_with(i, everyone)) for i in everyone]


class PoisonGuard:
    """Per fragment, the recent readings of accepted submissions, and the rule that judges a new one."""

    def __init__(self, num_fragments: int) -> None:
        """A guard with an empty window for each of `num_fragments` fragments."""
        self._windows: list[deque[Reading]] = [deque(maxlen=WINDOW) for _ in range(num_fragments)]

    def judge(self, fragment: int, reading: Reading, *, started_mid_run: bool = False) -> str | None:
        """Why `reading` of `fragment` is refused as poisoned, or None (accepted, or too few others to judge).
        `started_mid_run`: its incarnation started from a global version past 0 (Submission.started_at_version), so
        its cosine is never far out of line (FAR_OUT_FACTOR)."""
        others = [r for r in self._windows[fragment] if r.island != reading.island]
        if len({r.island for r in others}) < MIN_OTHER_ISLANDS:
            return None
        return (_size_problem(reading.size, [r.size for r in others])
                or _alignment_problem(reading.alignment, reading.elements,
                                      [r.alignment for r in others if r.alignment is not None], "the outer momentum",
                                      step_share(reading.inner_steps, [r.inner_steps for r in others]),
                                      can_be_far_out=not started_mid_run))

    def record(self, fragment: int, reading: Reading) -> None:
        """Add a judged submission's reading (accepted or refused) to its fragment's window, dropping the oldest of
        its island's when that island already has PER_ISLAND there."""
        window = self._windows[fragment]
        mine = [r for r in window if r.island == reading.island]
        if len(mine) >= PER_ISLAND:
            window.remove(mine[0])
        window.append(reading)

    def state_dict(self) -> list[list[list[float | int | None]]]:
        """The windows as JSON-ready lists (the outer optimizer's checkpoint keeps them)."""
        return [[[r.island, r.size, r.alignment, r.elements, r.inner_steps] for r in w] for w in self._windows]

    def load_state_dict(self, state: Sequence[Sequence[Sequence[float | int | None]]]) -> None:
        """Restore `state_dict()` output; a checkpoint of another fragment count starts the windows empty."""
        if len(state) != len(self._windows):
            return
        for w, readings in zip(self._windows, state):
            w.clear()
            # A checkpoint from before inner steps were kept has four fields: their steps are unknown (0).
            w.extend(Reading(int(r[0]), float(r[1]), None if r[2] is None else float(r[2]),  # type: ignore[arg-type]
                             int(r[3]), int(r[4]) if len(r) > 4 else 0)  # type: ignore[arg-type]
                     for r in readings)


class RefusalStreaks:
    """Consecutive poison refusals of each island incarnation, and when the incarnation is to be restarted.

    A guard only refuses: an island whose every outer gradient is wrong (scaled, sign-flipped, computed from an
    old base, noise) keeps spending a quarter of the run's compute on refused work. What it sends is its own
    state's fault, not the others' (the guard judges it against them), so `restart_after` refusals in a row
    mark the incarnation broken and the health monitor restarts it from the global parameters, as it does an
    island that diverged. An accepted submission ends a streak: an honest island refused now and then (a
    restart that left its direction behind the momentum) is never restarted for it. 0 restarts none.

    A refusal far out of line (:data:`FAR_OUT`: 16x the others' size, pointing against them from an incarnation that
    started with the run, or a stale base by its digest) marks the incarnation at once: each refusal waited for
    costs the run a submission's tokens (a streak of 3 and the one in flight were about 4% of a 3M-token budget).
    Incarnations that started mid-run can point against the momentum honestly, so their cosines wait for the
    streak (:data:`FAR_OUT_FACTOR`).
    """

    def __init__(self, restart_after: int) -> None:
        """Streaks that mark an incarnation after `restart_after` consecutive refusals (0: never)."""
        if restart_after < 0:
            raise ValueError(f"restart_after={restart_after} must be >= 0 (0: never restart)")
        self.restart_after = restart_after
        self._streaks: dict[tuple[int, int], int] = {}
        self._marked: set[tuple[int, int]] = set()

    def refused(self, island: int, incarnation: int, *, far_out: bool = False) -> bool:
        """Count one poison refusal; True exactly once per incarnation: when this one makes the streak
        `restart_after` long, or sooner if it is `far_out` (its reason begins with :data:`FAR_OUT`)."""
        key = (island, incarnation)
        self._streaks[key] = self._streaks.get(key, 0) + 1
        if self.restart_after == 0 or key in self._marked or not (far_out or self._streaks[key] >= self.restart_after):
            return False
        self._marked.add(key)
        return True

    def accepted(self, island: int, incarnation: int) -> None:
        """An accepted submission of the incarnation: its streak starts again from 0."""
        self._streaks.pop((island, incarnation), None)

    def streak(self, island: int, incarnation: int) -> int:
        """The incarnation's current run of consecutive refusals."""
        return self._streaks.get((island, incarnation), 0)
