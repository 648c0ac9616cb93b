"""Health verdicts: each rule of assess_island, and a hang timeout that follows the island's own step time."""

import pytest

from policies.health import HealthVerdict, assess_island, hang_timeout_s


def _assess(**overrides):
    """A healthy training island at now=100 (step 50, progress 1 s ago, 1 s steps); override one thing."""
    kw = dict(now=100.0, state="training", steps=50, last_progress_at=99.0, step_time_s=1.0,
              status_ok=True, last_status_at=100.0)
    kw.update(overrides)
    return assess_island(**kw)


# --- hang_timeout_s ----------------------------------------------------------------------------


def test_hang_timeout_is_factor_times_step_time_with_a_floor():
    assert hang_timeout_s(step_time_s=1.0) == 20.0
    assert hang_timeout_s(step_time_s=10.0) == 200.0
    assert hang_timeout_s(step_time_s=0.05) == 5.0  # 20 x 0.05 = 1 s < floor 5 s
    assert hang_timeout_s(step_time_s=0.5, factor=4.0, floor_s=1.0) == 2.0
    assert hang_timeout_s(step_time_s=0.5, factor=4.0, floor_s=3.0) == 3.0


def test_hang_timeout_before_first_step_is_startup():
    assert hang_timeout_s(step_time_s=None) == 60.0
    assert hang_timeout_s(step_time_s=None, startup_s=7.5) == 7.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step_time_s": 0.0}, "step_time_s must be > 0, got 0.0"),
        ({"step_time_s": 1.0, "factor": 0.0}, "factor must be > 0, got 0.0"),
        ({"step_time_s": 1.0, "floor_s": -1.0}, "floor_s must be >= 0, got -1.0"),
        ({"step_time_s": None, "startup_s": 0.0}, "startup_s must be > 0, got 0.0"),
        ({"step_time_s": float("nan")}, "step_time_s must be > 0, got nan"),
    ],
)
def test_hang_timeout_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hang_timeout_s(**kwargs)


# --- assess_island, one rule at a time ---------------------------------------------------------


def test_training_with_recent_progress_is_ok():
    v = _assess()
    assert v.healthy and v.kind == "ok"


def test_rule1_diverged():
    v = _assess(state="diverged")
    assert v == HealthVerdict(False, "diverged", v.reason)
    assert "divergence" in v.reason


def test_rule2_failed_is_dead():
    assert _assess(state="failed").kind == "dead"
    assert not _assess(state="failed").healthy


def test_rule1_and_2_win_over_unreachable():
    assert _assess(state="diverged", status_ok=False, last_status_at=0.0).kind == "diverged"
    assert _assess(state="failed", status_ok=False, last_status_at=0.0).kind == "dead"


def test_rule3_unreachable_only_after_unreachable_s():
    # Status failing for 10.5 s > 10 s: unreachable, whatever the last known state.
    v = _assess(status_ok=False, last_status_at=89.5, state="blocked")
    assert v == HealthVerdict(False, "unreachable", v.reason)
    assert "10.5s" in v.reason and "10.0s" in v.reason
    # Failing for exactly 10 s, or a shorter outage: judged on the last known state.
    assert _assess(status_ok=False, last_status_at=90.0).kind == "ok"
    assert _assess(status_ok=False, last_status_at=95.0, unreachable_s=3.0).kind == "unreachable"
    # A successful status call is never unreachable, however old last_status_at is.
    assert _assess(status_ok=True, last_status_at=0.0).kind == "ok"


def test_rule4_stopped_is_not_a_failure():
    v = _assess(state="stopped", last_progress_at=0.0)
    assert v.healthy and v.kind == "ok" and "stopped" in v.reason


def test_rule5_blocked_is_not_a_hang():
    # 90 s without progress would be a hang (timeout 20 s) but the island is waiting for a round.
    v = _assess(state="blocked", last_progress_at=10.0)
    assert v.healthy and v.kind == "ok" and "blocked" in v.reason
    assert _assess(state="training", last_progress_at=10.0).kind == "hung"


def test_rule6_hung_names_seconds_and_timeout():
    v = _assess(last_progress_at=75.0)  # 25 s idle > 20 x 1 s
    assert v == HealthVerdict(False, "hung", v.reason)
    assert "25.0s" in v.reason and "20.0s" in v.reason
    assert _assess(last_progress_at=80.0).kind == "ok"  # exactly the timeout: not yet hung


def test_slow_pool_is_not_hung_where_a_fast_one_would_be():
    # Both islands made no progress for 50 s. The fast pool steps in 1 s (timeout 20 s): hung.
    # The slow pool steps in 10 s (timeout 200 s): a slow pool is not a dead pool.
    fast = _assess(step_time_s=1.0, last_progress_at=50.0)
    slow = _assess(step_time_s=10.0, last_progress_at=50.0)
    assert fast.kind == "hung" and not fast.healthy
    assert slow.kind == "ok" and slow.healthy
    # The slow pool is hung too once it passes its own timeout.
    assert _assess(step_time_s=10.0, last_progress_at=100.0 - 201.0).kind == "hung"


def test_floor_protects_fast_islands_from_noise():
    # 0.01 s steps: 20 x 0.01 = 0.2 s, but the floor is 5 s.
    assert _assess(step_time_s=0.01, last_progress_at=96.0).kind == "ok"
    assert _assess(step_time_s=0.01, last_progress_at=94.0).kind == "hung"


def test_rule7_starting_within_startup():
    v = _assess(state="starting", steps=0, step_time_s=None, last_progress_at=60.0)  # 40 s of 60 s
    assert v == HealthVerdict(True, "starting", v.reason)
    hung = _assess(state="starting", steps=0, step_time_s=None, last_progress_at=30.0)  # 70 s > 60 s
    assert hung.kind == "hung" and "startup" in hung.reason
    # A training state with no step yet is also 'starting'.
    assert _assess(steps=0, step_time_s=None, last_progress_at=95.0).kind == "starting"


def test_assess_validation():
    with pytest.raises(ValueError, match="state must be one of .*'running'"):
        _assess(state="running")
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        _assess(steps=-1)
    with pytest.raises(ValueError, match="unreachable_s must be >= 0, got -1"):
        _assess(unreachable_s=-1.0)
    with pytest.raises(ValueError, match="step_time_s must be > 0"):
        _assess(step_time_s=-2.0)


def test_verdict_validation():
    with pytest.raises(ValueError, match="kind must be one of"):
        HealthVerdict(True, "fine", "")
    with pytest.raises(ValueError, match="inconsistent"):
        HealthVerdict(True, "dead", "")
    with pytest.raises(ValueError, match="inconsistent"):
        HealthVerdict(False, "ok", "")
