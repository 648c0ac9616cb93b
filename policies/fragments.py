"""Fragment planning: a fixed, size-balanced grouping of parameter tensors.

A fragment is the unit of synchronization (docs/architecture.md section 2). Islands submit fragments in a
fixed global order, so every island and the outer optimizer must derive the same plan from the same
model; the plan is therefore a pure, deterministic function of ``(name, nbytes)`` pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FragmentPlan", "plan_fragments"]


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameter tensors belong to which fragment.

    Attributes:
        fragments: ``fragments[p]`` is the tuple of tensor names of fragment ``p``, in the
            order the tensors were given to :func:`plan_fragments`.
        nbytes: ``nbytes[p]`` is the total bytes of fragment ``p``.
    """

    fragments: tuple[tuple[str, ...], ...]
    nbytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.fragments) != len(self.nbytes):
            raise ValueError(
                f"FragmentPlan has {len(self.fragments)} fragments but {len(self.nbytes)} "
                "byte totals; give one total per fragment"
            )

    @property
    def num_fragments(self) -> int:
        """Number of fragments ``P``."""
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        """Index of the fragment that holds tensor ``name``.

        Raises:
            KeyError: if ``name`` is in no fragment.
        """
        for p, names in enumerate(self.fragments):
            if name in names:
                return p
        raise KeyError(
            f"tensor {name!r} is in no fragment of this plan ({self.num_fragments} fragments); "
            "plan with the same parameter names the model has"
        )


def plan_fragments(tensor_bytes: Sequence[tuple[str, int]], num_fragments: int) -> FragmentPlan:
    """Greedy bin packing of tensors into ``num_fragments`` size-balanced fragments.

    Tensors are visited by bytes descending (ties: original order) and each goes into the
    fragment with the fewest bytes so far (ties: lowest index), i.e. the LPT heuristic:
    ``p* = argmin_p (bytes[p], p)``. Within each fragment, names keep their original input order
    so the plan does not depend on sizes for the order of tensors inside a fragment.

    Args:
        tensor_bytes: ``(name, nbytes)`` for every parameter tensor, in model order.
        num_fragments: number of fragments ``P``; ``1 <= P <= len(tensor_bytes)``.

    Returns:
        The :class:`FragmentPlan`; identical inputs always give identical plans.
    """
    pairs = list(tensor_bytes)
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}; use 1 for a single fragment")
    if num_fragments > len(pairs):
        raise ValueError(
            f"num_fragments must be <= the number of tensors ({len(pairs)}), got {num_fragments}; "
            "lower num_fragments so no fragment is empty"
        )
    seen: set[str] = set()
    for name, nbytes in pairs:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}; give every tensor a unique name")
        seen.add(name)
        if nbytes < 0:
            raise ValueError(f"tensor {name!r} has nbytes {nbytes}, must be >= 0; pass its size in bytes")

    totals = [0] * num_fragments
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    # sorted() is stable, so equal sizes keep their original order.
    order = sorted(range(len(pairs)), key=lambda i: -pairs[i][1])
    for i in order:
        p = min(range(num_fragments), key=lambda q: (totals[q], q))
        totals[p] += pairs[i][1]
        members[p].append(i)

    fragments = tuple(tuple(pairs[i][0] for i in sorted(idx)) for idx in members)
    return FragmentPlan(fragments=fragments, nbytes=tuple(totals))
