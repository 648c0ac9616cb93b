"""Staleness checks and the version ring."""

import pytest

from policies.staleness import StalenessDecision, check_staleness


def test_fresh_and_at_limit_are_accepted():
    assert check_staleness(current_version=5, base_version=5, max_staleness=2).accept
    d = check_staleness(current_version=7, base_version=5, max_staleness=2)
    assert d.accept and d.staleness == 2


def test_too_stale_is_refused_naming_both_numbers():
    d = check_staleness(current_version=8, base_version=5, max_staleness=2)
    assert d == StalenessDecision(False, 3, d.reason)
    assert not d.accept
    assert "3" in d.reason and "2" in d.reason


def test_base_from_the_future_is_refused():
    d = check_staleness(current_version=4, base_version=6, max_staleness=10)
    assert not d.accept and d.staleness == -2
    assert "base_version from the future" in d.reason


def test_zero_max_staleness_accepts_only_current():
    assert check_staleness(current_version=3, base_version=3, max_staleness=0).accept
    assert not check_staleness(current_version=3, base_version=2, max_staleness=0).accept


def test_max_staleness_validation():
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        check_staleness(current_version=0, base_version=0, max_staleness=-1)
