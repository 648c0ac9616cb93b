"""Staleness: which submissions a round may accept, and the ring of recent versions.

A submission was computed from fragment version ``base_version``; its staleness is
``current_version - base_version`` (docs/architecture.md section 3, outer step 3). The outer optimizer
needs only version numbers for it: an island's outer gradient is measured from the version the island
holds, so no older version's tensors are kept. :class:`VersionRing` keeps the last few
values of anything versioned; the outer optimizer no longer uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["StalenessDecision", "check_staleness", "VersionRing"]

T = TypeVar("T")


@dataclass(frozen=True)
class StalenessDecision:
    """Whether a submission is accepted.

    Attributes:
        accept: merge it in this round.
        staleness: ``current_version - base_version`` (negative for a base from the future).
        reason: one line for the log.
    """

    accept: bool
    staleness: int
    reason: str


def check_staleness(*, current_version: int, base_version: int, max_staleness: int) -> StalenessDecision:
    """Accept a submission iff ``0 <= current_version - base_version <= max_staleness``.

    A base newer than the current version cannot come from a correct island and is refused;
    one older than ``max_staleness`` versions is refused so the island resyncs.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}; use 0 to accept only fresh submissions")
    staleness = current_version - base_version
    if staleness < 0:
        return StalenessDecision(
            False, staleness, f"base_version from the future: base {base_version} > current {current_version}"
        )
    if staleness > max_staleness:
        return StalenessDecision(
            False, staleness, f"too stale: staleness {staleness} > max_staleness {max_staleness}"
        )
    return StalenessDecision(True, staleness, f"staleness {staleness} <= max_staleness {max_staleness}")


class VersionRing(Generic[T]):
    """The last ``capacity`` versions of a value, keyed by strictly increasing version numbers.

    Args:
        capacity: how many versions to keep, ``>= 1``; pushing more evicts the oldest.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}; keep at least the latest version")
        self._capacity = capacity
        self._items: OrderedDict[int, T] = OrderedDict()

    @property
    def capacity(self) -> int:
        """How many versions are kept at most."""
        return self._capacity

    def push(self, version: int, value: T) -> None:
        """Store ``value`` as ``version``, which must exceed the latest version; evict the oldest beyond capacity."""
        if self._items:
            latest = next(reversed(self._items))
            if version <= latest:
                raise ValueError(
                    f"version {version} must be > the latest version {latest}; versions increase strictly"
                )
        self._items[version] = value
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def get(self, version: int) -> T:
        """The value stored as ``version``.

        Raises:
            KeyError: if ``version`` was never pushed or has been evicted.
        """
        try:
            return self._items[version]
        except KeyError:
            if not self._items:
                raise KeyError(f"version {version} is not kept: the ring is empty") from None
            oldest, latest = next(iter(self._items)), next(reversed(self._items))
            raise KeyError(
                f"version {version} is not kept: the ring holds versions {oldest}..{latest} "
                f"(oldest kept {oldest}, capacity {self._capacity})"
            ) from None

    def __contains__(self, version: object) -> bool:
        return version in self._items

    def __len__(self) -> int:
        return len(self._items)

    def versions(self) -> list[int]:
        """Kept versions, oldest first."""
        return list(self._items)

    def latest(self) -> tuple[int, T]:
        """``(version, value)`` of the newest entry.

        Raises:
            LookupError: if nothing has been pushed yet.
        """
        if not self._items:
            raise LookupError("VersionRing is empty; push a version before asking for the latest")
        version = next(reversed(self._items))
        return version, self._items[version]
