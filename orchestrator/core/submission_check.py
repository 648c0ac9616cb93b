"""The checks a submission passes before it may join a round (docs/architecture.md section 3).

In order: the sender's identity (a live or recently live incarnation), the fragment and counters,
the wire format and shapes, staleness (policies.staleness), then the values: tensors whose compressor proves
them finite from their scales (int8/int4) stay in their wire format; the rest are decoded and their shapes and
finiteness checked. The first failure is the refusal's reason; a refused submission never touches state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from islands.messages import Submission
from policies.compression import Compressed, compressor, decompress, finite_without_decoding
from policies.staleness import check_staleness


@dataclass(frozen=True)
class Verdict:
    """What `check_submission` found: a refusal's reason (None: accepted), the staleness, and for an accepted
    submission its outer gradients and what is known of their norms."""

    reason: str | None
    staleness: int = 0
    # Per tensor: float32 values, or the wire tensor itself (int8/int4, decoded when the round merges it).
    deltas: list[torch.Tensor | Compressed] = field(default_factory=list)
    # Per tensor: float(torch.linalg.vector_norm(values)) when the finite check computed it, else None.
    norms: list[float | None] = field(default_factory=list)


def check_submission(
    sub: Submission,
    *,
    live: int | None,
    last: int | None,
    shapes: list[list[tuple[int, ...]]],
    versions: list[int],
    compression: str,
    max_staleness: int,
) -> Verdict:
    """Check one submission against the slot's live (`live`) and newest (`last`) incarnations, the
    fragments' tensor `shapes`, their current `versions`, the wire `compression` and `max_staleness`."""
    reason = _identity_problem(sub, live, last) or _shape_problem(sub, shapes, compression)
    if reason is not None:
        return Verdict(reason)
    decision = check_staleness(
        current_version=versions[sub.fragment], base_version=sub.base_version, max_staleness=max_staleness,
    )
    if not decision.accept:
        return Verdict(decision.reason, decision.staleness)
    # A well-formed int8/int4 tensor with small finite scales decodes to finite values: it waits in its wire
    # format (a quarter or an eighth of float32) and is decoded when its round merges it. The rest decode now.
    try:
        deltas = [c if finite_without_decoding(c) else decompress(c) for c in sub.payload]
    except Exception as err:  # noqa: BLE001 - a malformed payload is the sender's fault, refuse it
        return Verdict(f"payload does not decode: {err}")
    norms: list[float | None] = []
    for i, d in enumerate(deltas):
        if isinstance(d, Compressed):
            norms.append(None)
            continue
        if tuple(d.shape) != shapes[sub.fragment][i]:
            return Verdict(f"tensor {i}: decoded shape {tuple(d.shape)} != {shapes[sub.fragment][i]}")
        # NaN/Inf propagate into the norm, so one reduction clears the common case, and RDA reuses it; only a
        # non-finite norm (which finite values can also reach by overflow) pays for the elementwise scan.
        norm = float(torch.linalg.vector_norm(d))
        if not math.isfinite(norm):
            if not torch.isfinite(d).all():
                return Verdict(f"tensor {i}: non-finite values (NaN/Inf)")
            # Finite values whose norm overflows float32: RDA's mean norm and direction would turn them into
            # Inf/NaN in the global parameters, so this is refused like a non-finite tensor.
            return Verdict(f"tensor {i}: norm overflows float32 (finite values too large to merge)")
        norms.append(norm)
    return Verdict(None, decision.staleness, deltas, norms)


def _identity_problem(sub: Submission, live: int | None, last: int | None) -> str | None:
    # Work a slot's newest incarnation sent before it died (late off the wire) is still good, and so is
    # a salvaged snapshot of any incarnation we admitted, even once the next one is live. Both join a
    # round but never count toward its quorum (OuterOptimizer._pending_islands).
    if sub.salvaged:
        if last is None or sub.incarnation > last:
            return f"unknown or dead island {sub.island}: salvaged work of incarnation {sub.incarnation}"
    elif live is None and sub.incarnation != last:
        return f"unknown or dead island {sub.island}"
    elif live is not None and sub.incarnation != live:
        return f"stale incarnation {sub.incarnation} of island {sub.island} (live: {live})"
    return None


def _shape_problem(sub: Submission, shapes: list[list[tuple[int, ...]]], compression: str) -> str | None:
    # The fragment, the counters, and every tensor's wire format, dtype and shape, before anything decodes.
    if not 0 <= sub.fragment < len(shapes):
        return f"fragment {sub.fragment} out of range 0..{len(shapes) - 1}"
    if sub.tokens < 0 or sub.inner_steps <= 0:
        return f"bad counters tokens={sub.tokens} inner_steps={sub.inner_steps}"
    frag = shapes[sub.fragment]
    if len(sub.payload) != len(frag):
        return f"fragment {sub.fragment} has {len(frag)} tensors, submission has {len(sub.payload)}"
    wire = compressor(compression).wire_dtype  # the run's, loaded by the outer optimizer (core/round_merge.py)
    for i, (c, shape) in enumerate(zip(sub.payload, frag)):
        if not isinstance(c, Compressed) or c.scheme != compression:
            return f"tensor {i}: wire format is not {compression!r}"
        if c.payload.dtype != wire:
            return f"tensor {i}: dtype {c.payload.dtype} is not {wire} for {c.scheme!r}"
        if tuple(c.shape) != shape:
            return f"tensor {i}: shape {tuple(c.shape)} != {shape}"
    return None
