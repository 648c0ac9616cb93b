"""Merge rules as plug-ins: how one tensor's outer gradients of a round become one (``outer.merge_rule``).

A rule is a :class:`MergeRule`: one in-place method, :meth:`MergeRule.merge_into`, that writes the merged
tensor into a buffer the round owns, reading the submissions' outer gradients one at a time from a
:class:`Column` (decoded from the wire where they arrive compressed), and two flags the round reads. Rules are
registered by name (:func:`register_merge_rule`); the built-in ``rda`` and ``mean`` are registered here exactly
as a user's rule is, and a user's rule from any module is named by its import path ``package.module:Name``
(resolved by islands/plugins.py, which registers it under that path). docs/outer.md, Writing a merge rule.

Pure (torch only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from policies.plugin_registry import Registry

if TYPE_CHECKING:
    from policies.compression import Compressed

__all__ = ["Column", "MeanRule", "MergeRule", "RdaRule", "merge_rule", "merge_rule_names", "merge_rule_registry", "register_merge_rule"]


class Column:
    """One tensor's outer gradients in a round, one entry per island (its segments already joined).

    Entries are read one at a time so that a round holds at most one decoded copy: :meth:`value` of an entry
    that arrived compressed may lie in a decode buffer the next :meth:`value` overwrites; ``.clone()`` what must
    outlive that. Float32 tensors and lossless wire tensors are read where they lie (never write to them).

    Args:
        entries: float32 tensors or wire tensors (``policies.compression.Compressed``), all of one shape.
        norms: ``norms[m]`` is the Frobenius norm of entry ``m`` where the caller knows it (the outer optimizer's
            finite check computes it), else None; None for all.
        decode: how a wire tensor is read: ``decode(c, scratch)`` returns its float32 values (in `scratch` where
            its format decodes in place). The outer optimizer passes policies.merge's.
        scratch: flat float32 with at least the tensor's elements, the decode buffer; None allocates one when
            first needed.
    """

    def __init__(self, entries: Sequence[Tensor | Compressed], norms: Sequence[float | None] | None = None, *,
                 decode: Callable[[Compressed, Tensor | None], Tensor] | None = None,
                 scratch: Tensor | None = None) -> None:
        self._entries = list(entries)
        self._norms = list(norms) if norms is not None else [None] * len(self._entries)
        self._decode = decode
        self._scratch = scratch
        self._last: tuple[int, Tensor] | None = None  # the entry value() gave last: norm() then value() decodes once

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return tuple(self._entries[0].shape)

    def value(self, m: int) -> Tensor:
        """Entry `m` as float32 values of the tensor's shape (see the class docstring on how long they last)."""
        if self._last is not None and self._last[0] == m:
            return self._last[1]
        d = self._entries[m]
        if isinstance(d, Tensor):
            v = d.to(torch.float32)
        else:
            if self._decode is None:
                raise ValueError("a Column of wire tensors needs decode=; build it through policies.merge.merge_into")
            v = self._decode(d, self._scratch)
        self._last = (m, v)
        return v

    def norm(self, m: int) -> float:
        """``float(torch.linalg.vector_norm(self.value(m)))``, without decoding where the caller knew it."""
        known = self._norms[m]
        return float(torch.linalg.vector_norm(self.value(m))) if known is None else known


class MergeRule(ABC):
    """How one tensor's outer gradients of a round merge into one: subclass it and define :meth:`merge_into`.

    Class attributes the round reads:

    - ``across_rounds``: RDA's norm rule is carried across partial rounds for this rule's tensors
      (``outer.rda_across_rounds``, policies.merge.RdaAcrossRounds); a rule that does not lengthen its
      merged step by the islands' norms leaves it False.
    - ``mean_for_embeddings``: embedding tensors take the weighted mean instead of this rule (trained buffers
      always do).

    A rule holds no state between rounds (one instance serves every tensor and fragment) and must be
    deterministic: a resumed run merges again what the rounds it replays would have merged.
    """

    across_rounds: bool = False
    mean_for_embeddings: bool = True

    @abstractmethod
    def merge_into(self, out: Tensor, column: Column, weights: Sequence[float]) -> Tensor:
        """Write the merged tensor into `out` and return it.

        Args:
            out: contiguous float32 of the column's shape, holding garbage (overwrite all of it).
            column: one outer gradient per island (:class:`Column`), already checked for shape.
            weights: one weight per entry, >= 0, summing to 1 (policies.weighting.merge_weights).
        """

    def merged(self, deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
        """The merge of float32 `deltas` in a new tensor (tests, notebooks; the round merges in place)."""
        out = torch.zeros(deltas[0].shape, dtype=torch.float32, device=deltas[0].device)
        return self.merge_into(out, Column(deltas), weights)


class MeanRule(MergeRule):
    """The weighted mean ``sum_m w_m * d_m``, in float32 (``outer.merge_rule: mean``)."""

    def merge_into(self, out: Tensor, column: Column, weights: Sequence[float]) -> Tensor:
        """Zeros, then ``+= w_m * d_m`` entry by entry (the order fixes the rounding, signed zeros included)."""
        out.zero_()
        for m, w in enumerate(weights):
            out.add_(column.value(m), alpha=float(w))
        return out


class RdaRule(MergeRule):
    """Radial-directional averaging (``outer.merge_rule: rda``), Frobenius norms over the whole tensor:

    - ``r = sum_m w_m * ||d_m||`` (weighted mean norm),
    - ``u = sum_m w_m * d_m / ||d_m||`` (weighted mean direction; ``d_m = 0`` adds nothing),
    - result ``= r * u / ||u||``, or zeros if ``||u|| == 0``.

    Near-orthogonal island updates keep their typical size instead of shrinking like ``1/sqrt(M)`` under a plain
    mean. A single delta with weight 1 comes back unchanged (up to float error). Embeddings take the mean, as the
    design specifies (docs/architecture.md section 3, outer step 5).
    """

    across_rounds = True

    def merge_into(self, out: Tensor, column: Column, weights: Sequence[float]) -> Tensor:
        """``u`` accumulated in `out`, then scaled to ``r``."""
        out.zero_()
        r = 0.0
        for m, w in enumerate(weights):
            norm = column.norm(m)
            if norm == 0.0:
                continue
            r += float(w) * norm
            out.add_(column.value(m), alpha=float(w) / norm)
        u_norm = float(torch.linalg.vector_norm(out))
        if u_norm == 0.0:
            return out.zero_()
        return out.mul_(r / u_norm)


_RULES: Registry[MergeRule] = Registry("merge rule", MergeRule, "'package.module:Name' (a MergeRule subclass)")


def register_merge_rule(name: str, rule: MergeRule) -> MergeRule:
    """Make `rule` the merge rule `name` (``outer.merge_rule: name``); returns it. A name is registered once."""
    return _RULES.register(name, rule)


def merge_rule(name: str) -> MergeRule:
    """The registered merge rule `name`; a one-line ValueError naming the registered ones if there is none."""
    return _RULES.get(name)


def merge_rule_registry() -> Registry[MergeRule]:
    """The registry itself (islands/plugins.py registers a user's rule under its import path)."""
    return _RULES


def merge_rule_names() -> tuple[str, ...]:
    """Names registered so far, built-ins first."""
    return _RULES.names()


register_merge_rule("rda", RdaRule())
register_merge_rule("mean", MeanRule())
