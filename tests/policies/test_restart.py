"""Restart backoff: the exponential sequence, its cap, reset after a healthy spell, the limit, state round trip."""

import json
import math

import pytest

from policies.restart import RestartBudget, RestartDecision, backoff_s


def test_backoff_sequence_doubles_to_the_cap():
    assert [backoff_s(a) for a in range(1, 10)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_backoff_custom_and_huge_attempts():
    assert [backoff_s(a, base_s=1.0, factor=3.0, cap_s=20.0) for a in (1, 2, 3, 4)] == [1.0, 3.0, 9.0, 20.0]
    assert backoff_s(5, base_s=2.0, factor=1.0) == 2.0  # factor 1: constant delay
    assert backoff_s(10_000) == 30.0  # 2.0 ** 9999 overflows a float; still the cap
    assert backoff_s(10_000, cap_s=math.inf) == math.inf


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0,), {}, "attempt must be an int >= 1, got 0"),
        ((1.0,), {}, "attempt must be an int >= 1, got 1.0"),
        ((True,), {}, "attempt must be an int"),
        ((1,), {"base_s": 0.0}, "base_s must be finite and > 0, got 0.0"),
        ((1,), {"factor": 0.5}, "factor must be finite and >= 1, got 0.5"),
        ((1,), {"cap_s": 0.1}, "cap_s must be >= base_s=0.5, got 0.1"),
    ],
)
def test_backoff_validation(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        backoff_s(*args, **kwargs)


def test_budget_backs_off_per_island():
    budget = RestartBudget()
    reason = "island 0 failure 1 in a row: restart in 0.5s"
    assert budget.on_failure(0, now=10.0) == RestartDecision(True, 10.5, 1, reason)
    d = budget.on_failure(0, now=20.0)
    assert (d.restart, d.at, d.attempt) == (True, 21.0, 2)
    d = budget.on_failure(0, now=30.0)
    assert (d.at, d.attempt) == (32.0, 3)
    # Another island has its own count.
    d = budget.on_failure(1, now=30.0)
    assert (d.at, d.attempt) == (30.5, 1)
    assert budget.attempt(0) == 3 and budget.attempt(1) == 1 and budget.attempt(9) == 0
    assert budget.restarts(0) == 3


def test_budget_resets_after_healthy_spell_since_last_restart():
    budget = RestartBudget(reset_after_s=60.0)
    budget.on_failure(0, now=0.0)  # restart at 0.5
    d = budget.on_failure(0, now=10.0)  # attempt 2, restart at 11.0
    assert d.at == 11.0
    assert budget.on_healthy(0, now=30.0) is False  # healthy 19 s since the restart: not yet
    assert budget.on_healthy(0, now=70.999) is False
    assert budget.attempt(0) == 2
    assert budget.on_healthy(0, now=71.0) is True  # 11.0 + 60.0
    assert budget.attempt(0) == 0
    assert budget.on_healthy(0, now=80.0) is False  # nothing left to reset
    d = budget.on_failure(0, now=100.0)
    assert (d.at, d.attempt) == (100.5, 1)  # back to the base delay
    assert budget.restarts(0) == 3  # the total over the run keeps counting


def test_a_submission_since_the_restart_resets_the_budget_at_once():
    budget = RestartBudget(reset_after_s=60.0)
    budget.on_failure(0, now=0.0)  # restart at 0.5
    budget.on_failure(0, now=10.0)  # attempt 2, restart at 11.0
    assert budget.on_healthy(0, now=20.0) is False, "healthy, no submission yet, 9 s since the restart"
    assert budget.on_healthy(0, now=21.0, submitted=True) is True
    d = budget.on_failure(0, now=40.0)  # killed again 29 s later: an independent failure, not a crash loop
    assert (d.at, d.attempt) == (40.5, 1)


def test_a_crash_loop_without_submissions_still_backs_off_and_gives_up():
    budget = RestartBudget(max_restarts=2, reset_after_s=60.0)
    assert budget.on_failure(1, now=0.0).restart
    assert budget.on_healthy(1, now=3.0) is False  # stepping, never reaching a submission
    assert budget.on_failure(1, now=5.0).at == 6.0  # doubled
    assert not budget.on_failure(1, now=9.0).restart


def test_reset_on_submission_off_keeps_the_time_rule_only():
    budget = RestartBudget(reset_after_s=60.0, reset_on_submission=False)
    budget.on_failure(0, now=0.0)
    assert budget.on_healthy(0, now=20.0, submitted=True) is False
    assert budget.on_healthy(0, now=60.5, submitted=True) is True


def test_healthy_checks_of_unknown_island_do_nothing():
    budget = RestartBudget()
    assert budget.on_healthy(4, now=1e9) is False
    assert budget.state_dict() == {"islands": {}}


def test_max_restarts_gives_up_on_a_crash_loop():
    budget = RestartBudget(max_restarts=2)
    assert budget.on_failure(3, now=0.0).restart
    assert budget.on_failure(3, now=1.0).restart
    d = budget.on_failure(3, now=2.0)
    assert d == RestartDecision(False, math.inf, 3, d.reason)
    assert "max_restarts 2" in d.reason and "3 times" in d.reason
    assert budget.restarts(3) == 2


def test_max_restarts_counts_consecutive_failures_only():
    budget = RestartBudget(max_restarts=1, reset_after_s=5.0)
    for k in range(4):  # fail, recover for 5 s, fail again: never a crash loop
        now = 100.0 * k
        d = budget.on_failure(0, now=now)
        assert d.restart and d.attempt == 1
        assert budget.on_healthy(0, now=d.at + 5.0)
    assert budget.restarts(0) == 4


def test_max_restarts_zero_never_restarts():
    d = RestartBudget(max_restarts=0).on_failure(0, now=5.0)
    assert not d.restart and d.attempt == 1


def test_state_dict_round_trip_through_json():
    budget = RestartBudget(reset_after_s=60.0)
    budget.on_failure(0, now=0.0)
    budget.on_failure(0, now=5.0)
    budget.on_failure(2, now=7.0)
    state = budget.state_dict()
    assert state == {"islands": {0: {"attempt": 2, "restart_at": 6.0, "restarts": 2},
                                 2: {"attempt": 1, "restart_at": 7.5, "restarts": 1}}}
    restored = RestartBudget(reset_after_s=60.0)
    restored.load_state_dict(json.loads(json.dumps(state)))  # JSON turns island keys into strings
    assert restored.state_dict() == state
    # The restored budget continues the sequence where the original left off.
    assert restored.on_failure(0, now=10.0) == budget.on_failure(0, now=10.0)
    assert restored.on_healthy(2, now=67.5) and restored.attempt(2) == 0


def test_load_state_dict_validation():
    with pytest.raises(ValueError, match="exactly the key 'islands'"):
        RestartBudget().load_state_dict({"islands": {}, "extra": 1})
    with pytest.raises(ValueError, match="island '0' must have keys attempt, restart_at, restarts"):
        RestartBudget().load_state_dict({"islands": {"0": {"attempt": 1}}})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"reset_after_s": -1.0}, "reset_after_s must be >= 0, got -1.0"),
        ({"max_restarts": -1}, "max_restarts must be None or an int >= 0, got -1"),
        ({"max_restarts": 2.5}, "max_restarts must be None or an int"),
        ({"base_s": -1.0}, "base_s must be finite and > 0"),
        ({"cap_s": 0.1}, "cap_s must be >= base_s"),
    ],
)
def test_budget_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RestartBudget(**kwargs)
