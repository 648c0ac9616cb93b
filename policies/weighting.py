"""Merge weights of the accepted submissions of one round (docs/architecture.md section 3, outer step 4)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["WEIGHT_SCHEMES", "merge_weights"]

WEIGHT_SCHEMES = ("tokens", "uniform")


def merge_weights(
    *,
    tokens: Sequence[float],
    steps: Sequence[int],
    scheme: str = "tokens",
    staleness: Sequence[int] | None = None,
    staleness_discount: float = 0.0,
) -> list[float]:
    """Normalized merge weights, one per submission.

    Raw weights:

    - ``"tokens"``: ``w_m = tokens_m * (tokens_m / steps_m)``, quantity (tokens seen) times
      quality (tokens per inner step, i.e. batch size), as in Decoupled DiLoCo.
    - ``"uniform"``: ``w_m = 1``.

    If ``staleness_discount > 0``: ``w_m *= (1 + staleness_m) ** (-staleness_discount)``.
    Finally ``w_m /= sum_k w_k``.

    Args:
        tokens: tokens each submission was trained on since its base, ``>= 0``.
        steps: inner steps each submission took since its base, ``> 0``.
        scheme: one of ``WEIGHT_SCHEMES``.
        staleness: ``current_version - base_version`` per submission, ``>= 0``; required when
            ``staleness_discount > 0``.
        staleness_discount: exponent of the staleness discount, ``>= 0`` (0 disables it).
    """
    n = len(tokens)
    if n == 0:
        raise ValueError("merge_weights got no submissions; a round merges at least one")
    if len(steps) != n:
        raise ValueError(f"tokens has {n} entries but steps has {len(steps)}; give one of each per submission")
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown weighting scheme {scheme!r}; use one of {WEIGHT_SCHEMES}")
    if math.isnan(staleness_discount) or staleness_discount < 0:
        raise ValueError(f"staleness_discount must be >= 0, got {staleness_discount}; use 0.0 to disable it")
    for m, (t, s) in enumerate(zip(tokens, steps)):
        if s <= 0:
            raise ValueError(f"steps[{m}] must be > 0, got {s}; a submission follows at least one inner step")
        if math.isnan(t) or t < 0:
            raise ValueError(f"tokens[{m}] must be >= 0, got {t}; count the tokens the island trained on")

    if scheme == "tokens":
        raw = [float(t) * (float(t) / float(s)) for t, s in zip(tokens, steps)]
    else:
        raw = [1.0] * n

    if staleness_discount > 0:
        if staleness is None:
            raise ValueError("staleness_discount > 0 needs staleness; pass one staleness per submission")
        if len(staleness) != n:
            raise ValueError(f"staleness has {len(staleness)} entries but there are {n} submissions; give one each")
        for m, st in enumerate(staleness):
            if st < 0:
                raise ValueError(f"staleness[{m}] must be >= 0, got {st}; staleness = current - base version")
        raw = [w * (1.0 + st) ** (-staleness_discount) for w, st in zip(raw, staleness)]

    total = math.fsum(raw)
    if not total > 0:
        raise ValueError(
            f"all merge weights are zero (tokens={list(tokens)}); no submission carries tokens, "
            "count tokens or use scheme='uniform'"
        )
    return [w / total for w in raw]
