"""How an island adopts a newly published fragment (docs/architecture.md section 3, island step 3).

- ``overwrite``: ``theta = Theta`` (the paper).
- ``rebase``: ``theta = Theta + (theta - anchor)``, keeping local progress not yet merged.
- ``mix(alpha)``: ``theta = alpha * theta + (1 - alpha) * Theta`` (Streaming DiLoCo).

The global tensors may be read-only shared memory from the object store, so every function here
returns new tensors and never writes to its inputs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ADOPTION_KINDS", "AdoptionPolicy", "parse_adoption", "adopt_fragment"]

ADOPTION_KINDS = ("overwrite", "rebase", "mix")

_VALID_FORMS = "'overwrite', 'rebase' or 'mix(alpha)' with 0 <= alpha < 1, e.g. 'mix(0.5)'"


@dataclass(frozen=True)
class AdoptionPolicy:
    """An adoption policy: ``kind`` in ``ADOPTION_KINDS``; ``alpha`` is used by ``mix`` only.

    ``alpha`` is the weight kept on the local parameters, ``0 <= alpha < 1``.
    """

    kind: str
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ADOPTION_KINDS:
            raise ValueError(f"unknown adoption kind {self.kind!r}; use {_VALID_FORMS}")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"adoption alpha must be in [0, 1), got {self.alpha}; alpha is the weight kept on local")
        if self.kind != "mix" and self.alpha != 0.0:
            raise ValueError(f"alpha={self.alpha} only applies to 'mix', not {self.kind!r}; use mix({self.alpha})")

    def __str__(self) -> str:
        return f"mix({self.alpha})" if self.kind == "mix" else self.kind


def parse_adoption(spec: str) -> AdoptionPolicy:
    """Parse ``"overwrite"``, ``"rebase"`` or ``"mix(alpha)"`` (whitespace tolerant)."""
    text = spec.strip()
    if text in ("overwrite", "rebase"):
        return AdoptionPolicy(text)
    match = re.fullmatch(r"mix\s*\(\s*([^()]*?)\s*\)", text)
    if match is None:
        raise ValueError(f"cannot parse adoption policy {spec!r}; use {_VALID_FORMS}")
    try:
        alpha = float(match.group(1))
    except ValueError:
        raise ValueError(
            f"cannot parse alpha {match.group(1)!r} in adoption policy {spec!r}; use {_VALID_FORMS}"
        ) from None
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"adoption alpha must be in [0, 1), got {alpha} in {spec!r}; use {_VALID_FORMS}")
    return AdoptionPolicy("mix", alpha)


def adopt_fragment(
    policy: AdoptionPolicy,
    *,
    local: Sequence[Tensor],
    anchor: Sequence[Tensor],
    global_: Sequence[Tensor],
) -> list[Tensor]:
    """New local parameters of a fragment after adopting the published ``global_`` tensors.

    Per tensor, computed in float32 and returned in ``local``'s dtype:

    - overwrite: ``global_``
    - rebase: ``global_ + (local - anchor)``
    - mix(alpha): ``alpha * local + (1 - alpha) * global_``

    Args:
        policy: the adoption policy.
        local: the island's current parameters of the fragment.
        anchor: the parameters the island's not-yet-merged local progress is measured from (the
            caller picks it); read by ``rebase`` only.
        global_: the newly published global parameters; never written to.

    Returns:
        New tensors; no input is modified or aliased.
    """
    n = len(local)
    if len(global_) != n or len(anchor) != n:
        raise ValueError(
            f"local has {n} tensors, anchor {len(anchor)}, global_ {len(global_)}; "
            "pass the same fragment's tensors to all three"
        )
    out = []
    for i, (lo, an, gl) in enumerate(zip(local, anchor, global_)):
        if gl.shape != lo.shape or an.shape != lo.shape:
            raise ValueError(
                f"tensor {i}: local {tuple(lo.shape)}, anchor {tuple(an.shape)}, global_ {tuple(gl.shape)} "
                "differ; pass the same fragment's tensors to all three"
            )
        g32 = gl.to(device=lo.device, dtype=torch.float32)
        if policy.kind == "overwrite":
            new = g32
        elif policy.kind == "rebase":
            new = g32 + (lo.to(torch.float32) - an.to(device=lo.device, dtype=torch.float32))
        else:
            new = policy.alpha * lo.to(torch.float32) + (1.0 - policy.alpha) * g32
        # .to(copy=True) guarantees a fresh tensor even when new aliases global_.
        out.append(new.to(dtype=lo.dtype, copy=True) if new is g32 else new.to(dtype=lo.dtype))
    return out
