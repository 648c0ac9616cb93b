"""The data plan: which island reads which units of the corpus, in which order (pure: no I/O, no Ray).

A corpus is cut into **units** by its metadata alone (a Parquet row group, a fixed token range of a
token file, one standard-library file; islands/corpus.py). This module decides, from the units' sizes
and the run's seed only, so that every process derives the same answer:

- :func:`assign_units`: each island's units. Shuffled (the default), units are visited in a seeded
  pseudo-random order and each goes to the island with the fewest tokens so far (ties to the lowest
  island number), so every island gets a representative sample of about ``1/M`` of the tokens. In
  source order (``shuffle=False``, for studying non-IID islands) island ``i`` gets a contiguous run of
  units, cut where the running token count crosses ``i/M`` of the total, as contiguous shards were.
- :func:`epoch_order`: the order an island reads its units in epoch ``e``: a permutation seeded by
  ``(seed, island, e)`` (source order without shuffling). An island that has read all its units starts
  the next epoch.
- :func:`block_permutation`: the order of the windows inside one block of an island's stream (the
  shuffle buffer), seeded by ``(seed, island, block)``.
- :func:`copies_differ`: whether two copies of a corpus (one per region) hold different units.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["assign_units", "block_permutation", "copies_differ", "epoch_order"]

# Salts keep the plan's three random streams apart from each other and from the samplers'.
_ASSIGN_SALT, _EPOCH_SALT, _BLOCK_SALT = 0x41, 0x45, 0x42


def _check(islands: int, seed: int) -> None:
    if not isinstance(islands, int) or islands < 1:
        raise ValueError(f"islands={islands!r} must be a positive int")
    if seed < 0:
        raise ValueError(f"seed={seed} must be non-negative (numpy SeedSequence rule)")


def assign_units(sizes: Sequence[int], islands: int, *, seed: int, shuffle: bool = True) -> list[list[int]]:
    """Unit indices per island: ``result[i]`` lists island ``i``'s units in plan order.

    ``sizes[u]`` is unit ``u``'s token count (or an estimate from metadata); it only balances the
    islands. Every unit goes to exactly one island. Raises ValueError when there are fewer units than
    islands: an island without a unit would have nothing to read.
    """
    _check(islands, seed)
    n = len(sizes)
    if n < islands:
        raise ValueError(f"{n} units for {islands} islands; every island needs at least one unit: cut the corpus "
                         f"finer (smaller units) or train fewer islands")
    if any(s < 0 for s in sizes):
        raise ValueError("unit sizes must be non-negative token counts")
    result: list[list[int]] = [[] for _ in range(islands)]
    if not shuffle:
        # Island i starts at the first unit whose first token lies at or past i/M of the tokens, moved so
        # that every island keeps at least one unit.
        starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))[:-1]])  # (n,)
        total = int(sum(sizes))
        bounds = [0]
        for i in range(1, islands):
            first = int(np.searchsorted(starts * islands, i * total, side="left"))
            bounds.append(min(max(first, bounds[-1] + 1), n - (islands - i)))
        bounds.append(n)
        return [list(range(bounds[i], bounds[i + 1])) for i in range(islands)]
    order = np.random.default_rng([seed, _ASSIGN_SALT]).permutation(n)
    loads = [0] * islands
    for k, u in enumerate(order.tolist()):
        # The first M units seed one island each, so no island is left without a unit.
        island = k if k < islands else min(range(islands), key=lambda i: (loads[i], i))
        result[island].append(u)
        loads[island] += sizes[u]
    return result


def epoch_order(count: int, *, seed: int, island: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The positions ``0..count-1`` of an island's units in the order it reads them in ``epoch``."""
    if count < 1:
        raise ValueError(f"an island needs at least one unit, got {count}")
    if epoch < 0 or island < 0:
        raise ValueError(f"epoch={epoch} and island={island} must be non-negative")
    if not shuffle:
        return list(range(count))
    return np.random.default_rng([seed, _EPOCH_SALT, island, epoch]).permutation(count).tolist()


def block_permutation(size: int, *, seed: int, island: int, block: int) -> np.ndarray:
    """The order of the ``size`` windows of block ``block`` of an island's stream: a permutation of ``0..size-1``."""
    if size < 1 or block < 0:
        raise ValueError(f"size={size} must be positive and block={block} non-negative")
    return np.random.default_rng([seed, _BLOCK_SALT, island, block]).permutation(size)


def copies_differ(reference: Sequence[tuple[str, int]], other: Sequence[tuple[str, int]]) -> str | None:
    """How copy ``other`` differs from ``reference``, each a list of ``(unit name, length)`` in plan order,
    in words for an error message; None when they hold the same units."""
    for (name, length), (other_name, other_length) in zip(reference, other):
        if name != other_name:
            return f"{other_name!r} where the first copy has {name!r}"
        if length != other_length:
            return f"{name!r} holds {other_length:,} against {length:,}"
    if len(reference) != len(other):
        return f"{len(other)} entries against {len(reference)}"
    return None
