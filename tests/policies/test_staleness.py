"""Staleness checks and the version ring."""

import pytest

from policies.staleness import StalenessDecision, VersionRing, check_staleness


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


def test_ring_keeps_last_capacity_versions():
    ring = VersionRing[str](capacity=3)
    for v in range(5):
        ring.push(v, f"v{v}")
    assert ring.versions() == [2, 3, 4]
    assert len(ring) == 3
    assert ring.get(3) == "v3"
    assert 2 in ring and 1 not in ring
    assert ring.latest() == (4, "v4")


def test_ring_accepts_gaps():
    ring = VersionRing(capacity=2)
    ring.push(0, "a")
    ring.push(10, "b")
    ring.push(11, "c")
    assert ring.versions() == [10, 11]


def test_ring_get_evicted_names_oldest_kept():
    ring = VersionRing(capacity=2)
    for v in (1, 2, 3):
        ring.push(v, v)
    with pytest.raises(KeyError, match="oldest kept 2"):
        ring.get(1)
    with pytest.raises(KeyError, match="version 9 is not kept"):
        ring.get(9)


def test_ring_errors():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        VersionRing(0)
    ring = VersionRing(2)
    with pytest.raises(KeyError, match="ring is empty"):
        ring.get(0)
    with pytest.raises(LookupError, match="empty"):
        ring.latest()
    ring.push(5, "x")
    with pytest.raises(ValueError, match="version 5 must be > the latest version 5"):
        ring.push(5, "y")
    with pytest.raises(ValueError, match="version 4 must be > the latest version 5"):
        ring.push(4, "y")
    assert ring.versions() == [5]  # a refused push changes nothing
