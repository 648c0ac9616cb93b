"""Pacing the downlink: which new fragment versions go to an island now (``outer.downlink_every``).

Pure and torch-free: the outer-optimizer actor shell asks it once per island for every published version.
"""

from __future__ import annotations

__all__ = ["paced_send"]


def paced_send(version: int, last_sent: int | None, every: int, participant: bool) -> bool:
    """Whether a new ``version`` of a fragment goes to an island now, under ``outer.downlink_every``.

    With K = 1 every submission closes a round and every round's version goes to every island, so with M
    islands each receives a fragment about M times per sync of it, and the downlink carries M times the uplink.
    Pacing sends an island a version of a round it took no part in only once it is at least ``every``
    versions newer than the last one sent to it (``last_sent``; None: nothing sent to this incarnation yet,
    so it goes). A version it skips is not lost: the next one sent carries it (a version is the whole fragment,
    and a difference is taken from what the island holds). A version whose round merged the island's own
    submission always goes, so its bases stay fresh and its merged keys come back. ``every = 1`` sends every
    version (DESIGN.md section 3); with every island taking part in turn, ``every = 2`` takes M from about 4
    to 2.
    """
    if every < 1:
        raise ValueError(f"downlink_every must be >= 1, got {every}; use 1 to send every version")
    return participant or last_sent is None or version - last_sent >= every
