"""policies.poison_guard: which finite, well-shaped outer gradients are refused as poisoned, and which are not.

The readings are built from real tensors: an honest island's outer gradient is a shared signal plus its
own noise (the shape measured in a default run: sizes within ~30% of each other, cosines with the outer
momentum of 0.05-0.86), and the four poisons are made from it as islands/faults.py makes them.
"""

from __future__ import annotations

import math

import pytest
import torch

from islands.faults import POISON_KINDS, poisoned
from policies.poison_guard import (
    FAR_OUT,
    FIRST_ROUND_ISLANDS,
    SIZE_RATIO_FLOOR,
    PoisonGuard,
    Reading,
    first_round_quorum,
    judge_first_round,
    reading_of,
    step_share,
)

N = 50_000  # elements of the fragment


def _honest(gen: torch.Generator, signal: torch.Tensor, *, noise: float = 3.0) -> torch.Tensor:
    return signal + noise * torch.randn(N, generator=gen) / math.sqrt(N) * float(signal.norm())


def _world(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(N, generator=gen)
    momentum = signal * 5 + torch.randn(N, generator=gen) * 2  # several merged rounds: mostly signal
    return gen, signal, momentum


def _filled_guard(gen, signal, momentum, islands=(1, 2, 3), rounds=6) -> PoisonGuard:
    guard = PoisonGuard(1)
    for _ in range(rounds):
        for i in islands:
            r = reading_of(i, [_honest(gen, signal)], [None], 40, [momentum])
            assert guard.judge(0, r) is None
            guard.record(0, r)
    return guard


def test_reading_of_takes_the_size_per_sqrt_step_and_the_cosine_with_the_momentum():
    d = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])]
    m = [torch.tensor([1.0, 0.0]), None]  # the second tensor keeps no momentum (a trained buffer)
    r = reading_of(7, d, [3.0, None], 25, m)
    assert r.island == 7 and r.size == pytest.approx(5.0 / 5.0)
    assert r.alignment == pytest.approx(1.0) and r.elements == 2  # over the tensors with momentum only
    assert reading_of(7, d, [None, None], 25, [None, None]).alignment is None


@pytest.mark.parametrize("kind", POISON_KINDS)
def test_every_poison_kind_is_refused_once_the_window_holds_other_islands(kind):
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    honest = _honest(gen, signal)
    # stale_submission: measured from the base it held long ago, so it carries the fragment's drift since then
    stale_base = [torch.zeros(N) + 40 * signal]
    [bad] = poisoned(kind, [honest], stale_base=stale_base, anchor=[torch.zeros(N)], seed=3)
    reason = guard.judge(0, reading_of(0, [bad], [None], 40, [momentum]))
    assert reason is not None and reason.startswith("poisoned: "), (kind, reason)
    assert guard.judge(0, reading_of(0, [honest], [None], 40, [momentum])) is None  # the same island, honest


def test_honest_partial_and_salvaged_submissions_are_not_refused():
    gen, signal, momentum = _world(1)
    guard = _filled_guard(gen, signal, momentum)
    for steps in (1, 3, 10, 20, 39):  # fewer inner steps: a smaller outer gradient, less aligned
        frac = steps / 40
        d = frac * signal + math.sqrt(frac) * 3.0 * torch.randn(N, generator=gen) / math.sqrt(N) * float(signal.norm())
        assert guard.judge(0, reading_of(0, [d], [None], steps, [momentum])) is None, steps


def test_sizes_within_the_floor_are_never_refused_however_tight_the_others():
    guard = PoisonGuard(1)
    for i in (1, 2, 3, 1, 2, 3):
        guard.record(0, Reading(i, 1.0, None))  # identical sizes: MAD 0
    assert guard.judge(0, Reading(0, SIZE_RATIO_FLOOR * 0.99, None)) is None
    reason = guard.judge(0, Reading(0, SIZE_RATIO_FLOOR * 1.01, None))
    assert reason is not None and "4.0x the size" in reason


def test_nothing_is_judged_without_two_other_islands_and_an_island_is_not_its_own_reference():
    guard = PoisonGuard(1)
    for _ in range(10):
        guard.record(0, Reading(1, 1.0, 0.3, N))
    assert guard.judge(0, Reading(0, 100.0, -0.5, N)) is None  # one other island: no majority
    guard.record(0, Reading(0, 100.0, -0.5, N))
    guard.record(0, Reading(2, 1.0, 0.3, N))
    assert guard.judge(0, Reading(0, 100.0, -0.5, N)) is not None
    # island 0's own earlier readings do not make its next one look normal
    assert guard.judge(0, Reading(0, 1.0, 0.3, N)) is None


def test_no_direction_is_judged_when_the_others_do_not_agree_on_one():
    guard = PoisonGuard(1)
    for i in (1, 2, 1, 2):
        guard.record(0, Reading(i, 1.0, 0.001, N))  # no clear alignment among the others (limit ~0.016)
    assert guard.judge(0, Reading(0, 1.0, -0.2, N)) is None
    guard.record(0, Reading(3, 1.0, 0.2, N))
    for i in (1, 2, 3):
        guard.record(0, Reading(i, 1.0, 0.2, N))
    assert "cosine with the outer momentum -0.2000" in guard.judge(0, Reading(0, 1.0, -0.2, N))


def test_first_round_quorum_waits_for_three_islands_or_every_live_one():
    assert FIRST_ROUND_ISLANDS == 3
    assert first_round_quorum(1, 4) == 3 and first_round_quorum(1, 2) == 2 and first_round_quorum(4, 8) == 4


@pytest.mark.parametrize("kind", ["scaled_submission", "flipped_submission", "noise_submission"])
def test_a_first_round_refuses_the_poisoned_one_by_the_others(kind):
    gen = torch.Generator().manual_seed(5)
    signal = torch.randn(N, generator=gen)
    honest = [_honest(gen, signal, noise=0.7) for _ in range(4)]  # early rounds: cosines ~0.7-0.9 (measured)
    [bad] = poisoned(kind, [honest[0]], stale_base=None, anchor=[torch.zeros(N)], seed=1)
    deltas = [bad] + honest[1:]
    cos = [[float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for b in deltas] for a in deltas]
    out = judge_first_round([0, 1, 2, 3], [float(d.norm()) / math.sqrt(40) for d in deltas], cos, N)
    assert out[0][0] is not None and out[0][0].startswith("poisoned: ")
    assert out[0][0].startswith(FAR_OUT), out[0][0]  # noise too: the others all agree clearly
    assert [r for r, _ in out[1:]] == [None, None, None]
    assert all(a is not None and a > 0.3 for _, a in out[1:])  # their alignment, recorded for later judgements


def test_a_first_round_of_two_islands_refuses_nothing():
    out = judge_first_round([0, 1], [1.0, 1.0], [[1.0, -1.0], [-1.0, 1.0]], 4)
    assert [r for r, _ in out] == [None, None]


def test_state_round_trips():
    guard = PoisonGuard(2)
    guard.record(1, Reading(3, 0.5, 0.25, 10, 40))
    guard.record(1, Reading(2, 0.6, None, 10, 20))
    again = PoisonGuard(2)
    again.load_state_dict(guard.state_dict())
    assert again.state_dict() == guard.state_dict() == [[], [[3, 0.5, 0.25, 10, 40], [2, 0.6, None, 10, 20]]]
    older = PoisonGuard(2)  # a checkpoint from before inner steps were kept: four fields, steps unknown
    older.load_state_dict([[], [[3, 0.5, 0.25, 10]]])
    assert older.state_dict() == [[], [[3, 0.5, 0.25, 10, 0]]]


def _with_cosine(gen: torch.Generator, momentum: torch.Tensor, cosine: float, norm: float) -> torch.Tensor:
    """A vector of `norm` whose cosine with `momentum` is exactly `cosine`."""
    m = momentum / momentum.norm()
    r = torch.randn(N, generator=gen, dtype=torch.float64).to(m.dtype)
    r = r - (r @ m) * m
    r = r / r.norm()
    return norm * (cosine * m + math.sqrt(1 - cosine**2) * r)


def test_a_submission_of_a_few_steps_is_not_judged_by_a_cosine_a_full_one_is_refused_for():
    # Measured: an honest final flush of one inner step read +0.0061 against a limit of +0.0071, where full
    # submissions read about +0.2, and was refused; its cosine is what a random direction's is.
    gen, signal, momentum = _world(2)
    guard = _filled_guard(gen, signal, momentum)
    limit = 3.5 / math.sqrt(N)
    norm = float(signal.norm())
    low = _with_cosine(gen, momentum, 0.6 * limit, norm)
    assert guard.judge(0, reading_of(0, [low / math.sqrt(40)], [None], 1, [momentum])) is None
    full = guard.judge(0, reading_of(0, [low], [None], 40, [momentum]))
    assert full is not None and "no more than a random direction's" in full
    # Half the steps is judged as before: the others' cosines, halved, still clear the gate by far.
    assert guard.judge(0, reading_of(0, [low / math.sqrt(2)], [None], 20, [momentum])) is not None


def test_step_share_is_the_share_of_the_others_median_steps_at_most_one_and_one_where_unknown():
    assert step_share(10, [40, 40, 20]) == 0.25
    assert step_share(80, [40]) == 1.0
    assert step_share(0, [40]) == step_share(5, [0, 0]) == step_share(5, []) == 1.0


def test_refusal_streaks_mark_an_incarnation_at_the_nth_refusal_in_a_row_and_an_acceptance_resets():
    from policies.poison_guard import RefusalStreaks

    streaks = RefusalStreaks(3)
    assert [streaks.refused(0, 1) for _ in range(2)] == [False, False]
    streaks.accepted(0, 1)  # an honest island refused now and then is never restarted for it
    assert streaks.streak(0, 1) == 0
    assert [streaks.refused(0, 1) for _ in range(5)] == [False, False, True, False, False], "marked once"
    assert streaks.refused(0, 2) is False and streaks.streak(0, 2) == 1, "a new incarnation counts afresh"
    assert streaks.refused(1, 1) is False, "islands count apart"
    never = RefusalStreaks(0)
    assert not any(never.refused(0, 1) for _ in range(10))
    with pytest.raises(ValueError, match="restart_after=-1 must be >= 0"):
        RefusalStreaks(-1)


@pytest.mark.parametrize("kind", ["scaled_submission", "flipped_submission", "noise_submission"])
def test_scaled_flipped_and_noise_among_clearly_aligned_islands_read_far_out_of_line(kind):
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    [bad] = poisoned(kind, [_honest(gen, signal)], stale_base=None, anchor=[torch.zeros(N)], seed=3)
    reason = guard.judge(0, reading_of(0, [bad], [None], 40, [momentum]))
    assert reason is not None and reason.startswith(FAR_OUT), reason


def test_noise_waits_for_the_streak_where_one_honest_cosine_is_near_the_limit_or_its_share_is_small():
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    limit = 3.5 / math.sqrt(N)
    [noise] = poisoned("noise_submission", [_honest(gen, signal)], stale_base=None, anchor=[torch.zeros(N)], seed=3)
    guard.record(0, Reading(3, 1.0, 0.1, N, 40))  # others ~0.29, one at 0.1: every one above twice the limit (0.031)
    assert guard.judge(0, reading_of(0, [noise], [None], 40, [momentum])).startswith(FAR_OUT)
    # 10 of the others' 40 steps: their median's share (~0.07) still clears the gate, the lowest one's (0.025) does not.
    small = guard.judge(0, reading_of(0, [0.5 * noise], [None], 10, [momentum]))
    assert small is not None and small.startswith("poisoned: ") and not small.startswith(FAR_OUT), small
    guard.record(0, Reading(3, 1.0, 1.5 * limit, N, 40))  # an honest island restarted lately: barely aligned
    reason = guard.judge(0, reading_of(0, [noise], [None], 40, [momentum]))
    assert reason is not None and reason.startswith("poisoned: ") and not reason.startswith(FAR_OUT), reason


@pytest.mark.parametrize("kind", ["scaled_submission", "flipped_submission"])
def test_an_incarnation_that_started_mid_run_is_refused_but_far_out_only_by_its_size(kind):
    # A restarted incarnation's honest first cuts pointed against the momentum (cosines down to -0.23 in the guard-on
    # soak): its cosine is refused, and waits for the streak; a size 100x the others' is still beyond doubt.
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    [bad] = poisoned(kind, [_honest(gen, signal)], stale_base=None, anchor=[torch.zeros(N)], seed=3)
    reason = guard.judge(0, reading_of(0, [bad], [None], 40, [momentum]), started_mid_run=True)
    assert reason is not None and reason.startswith("poisoned: "), reason
    assert reason.startswith(FAR_OUT) is (kind == "scaled_submission"), reason
    if kind == "flipped_submission":
        assert "started mid-run, so not far out of line" in reason, reason
    assert guard.judge(0, reading_of(0, [_honest(gen, signal)], [None], 40, [momentum]), started_mid_run=True) is None


def test_a_size_just_over_the_limit_is_not_far_out_of_line():
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    # 6x the others (over the 4x floor, under its square, 16x), pointing the honest way
    reason = guard.judge(0, reading_of(0, [6 * _honest(gen, signal)], [None], 40, [momentum]))
    assert reason is not None and "x the size" in reason and not reason.startswith(FAR_OUT), reason
    reason = guard.judge(0, reading_of(0, [20 * _honest(gen, signal)], [None], 40, [momentum]))
    assert reason is not None and reason.startswith(FAR_OUT), reason


def test_a_far_out_refusal_marks_the_incarnation_at_once_and_only_once():
    from policies.poison_guard import RefusalStreaks

    streaks = RefusalStreaks(3)
    assert streaks.refused(0, 1) is False
    assert streaks.refused(0, 1, far_out=True) is True, "the second refusal, far out: marked now, not at the third"
    assert [streaks.refused(0, 1, far_out=f) for f in (False, True)] == [False, False], "marked once"
    assert RefusalStreaks(3).refused(4, 1, far_out=True) is True, "a first refusal far out is enough"
    assert RefusalStreaks(0).refused(4, 1, far_out=True) is False, "0 restarts none, far out or not"


def test_when_the_honest_islands_stop_agreeing_the_gate_closes_instead_of_refusing_them_all():
    # The islands' outer gradients of a fragment can drift to a cosine near zero with its momentum (fragment 0 of 4
    # nano islands, in process: +0.12 to -0.07). A window of accepted readings alone kept the old agreement and
    # refused every island from then on; refused readings count, so the reference follows them.
    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum)
    limit = 3.5 / math.sqrt(N)
    verdicts = []
    for _ in range(12):
        for i in (1, 2, 3):
            r = Reading(i, 1.0, 0.2 * limit, N, 40)  # honest, and no longer aligned
            verdicts.append(guard.judge(0, r))
            guard.record(0, r)
    assert verdicts[0] is not None and verdicts[0].startswith("poisoned: "), "at first they read out of line"
    assert verdicts[-6:] == [None] * 6, verdicts[-6:]
    # A size far over the others' is still refused: the size rule needs no agreement.
    assert guard.judge(0, Reading(0, 100.0, 0.2 * limit, N, 40)).startswith(FAR_OUT)


def test_a_window_keeps_at_most_per_island_readings_of_one_island():
    from policies.poison_guard import PER_ISLAND, WINDOW

    gen, signal, momentum = _world()
    guard = _filled_guard(gen, signal, momentum, rounds=2)  # 6 readings of islands 1-3
    for _ in range(3 * WINDOW):  # a fast island, refused every time, its readings kept
        guard.record(0, Reading(0, 100.0, -0.5, N, 40))
    islands = [r[0] for r in guard.state_dict()[0]]
    assert islands.count(0) == PER_ISLAND and sorted(set(islands)) == [0, 1, 2, 3], islands
    # Judging island 0 against the others still sees the honest islands, and refuses it.
    assert guard.judge(0, Reading(0, 100.0, -0.5, N, 40)).startswith(FAR_OUT)
