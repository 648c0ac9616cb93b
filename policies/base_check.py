"""The stale-base check: is an outer gradient measured from the version of the fragment it names?

An island's outer gradient is ``base - theta``, and the submission names the base by its version. An island whose
adoption went wrong (a copy that failed while the version counter moved on, a restore from an old file) measures
from an older base under a current version's number. Its outer gradient then carries the fragment's drift since that
base on top of the honest work: at first as large as an honest one and *more* aligned with the islands' direction,
so the poison guard's size and direction readings (policies/poison_guard.py) pass it until the drift is several
times an honest outer gradient, and by then it has been merged for many rounds (measured: a stale base cost 5.5% of
held-out loss where the size rule alone caught it; benchmarks/RESULTS.md#poison-restart).

So each submission carries a digest of the base it is measured from (:func:`fragment_digest`), and the outer
optimizer, which knows what it published as each version, compares (:class:`BaseDigests`). The digest is exact, not
statistical: an island's base is a bit-for-bit copy of the published float32 tensors (islands/fragment_state.py,
`adopted`), so an honest island matches and any other base does not. Where islands do not hold the published tensors
exactly (a lossy downlink: ``outer.downlink`` bf16 or int8, or ``outer.downlink_delta``), no digest is recorded and
nothing is judged. An island that lies about its digest as well as its version is not a bug this catches; the size
rule still does, later.

Pure: no Ray, no clock.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["DIGEST_SAMPLES", "BaseDigests", "fragment_digest"]

DIGEST_SAMPLES = 16_384
"""Elements of each tensor a digest reads at most (evenly strided): an outer step moves nearly every element, so a
stale base differs in a sample as surely as in the whole, and a digest of a large fragment on a GPU copies ~64 KiB
per tensor to the host, not the tensor."""


def fragment_digest(tensors: Sequence[torch.Tensor]) -> str:
    """A digest of a fragment's tensors: their shapes and the float32 bits of up to DIGEST_SAMPLES strided elements
    of each. Equal tensors give equal digests on any device; it is only ever compared, never decoded."""
    h = hashlib.blake2b(digest_size=8)
    with torch.no_grad():
        for t in tensors:
            flat = t.detach().reshape(-1)
            stride = max(1, math.ceil(flat.numel() / DIGEST_SAMPLES))
            sample = flat[::stride].to(device="cpu", dtype=torch.float32).contiguous()
            h.update(repr(tuple(t.shape)).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


class BaseDigests:
    """Per fragment, the digests of its last `keep` versions as published (older ones are refused as too stale
    before their base matters)."""

    def __init__(self, num_fragments: int, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}; use max_staleness + 2")
        self.keep = keep
        self._digests: list[OrderedDict[int, str]] = [OrderedDict() for _ in range(num_fragments)]

    def knows(self, p: int, version: int) -> bool:
        """Whether version `version` of fragment `p` has a recorded digest."""
        return version in self._digests[p]

    def record(self, p: int, version: int, digest: str) -> None:
        """Version `version` of fragment `p` was published with this digest."""
        kept = self._digests[p]
        kept[version] = digest
        kept.move_to_end(version)
        while len(kept) > self.keep:
            kept.popitem(last=False)

    def problem(self, p: int, version: int, digest: str | None) -> str | None:
        """Why an outer gradient of fragment `p` that names `version` and carries `digest` is not measured from that
        version (the reason's words, without a prefix), or None: it is, or it cannot be told (no digest sent, the
        version not recorded)."""
        known = self._digests[p].get(version)
        if digest is None or known is None or digest == known:
            return None
        return (f"outer gradient measured from a base that is not version {version} of fragment {p} (base digest "
                f"{digest}, published {known}): the island's copy is stale or corrupt")
