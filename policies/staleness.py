"""Staleness: which submissions a round may accept.

A submission was computed from fragment version ``base_version``; its staleness is
``current_version - base_version`` (docs/architecture.md section 3, outer step 3). The outer optimizer
needs only version numbers for it: an island's outer gradient is measured from the version the island
holds, so no older version's tensors are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StalenessDecision", "check_staleness"]


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
