"""The outer step's settings from what a run knows before it starts (issue 61: defaults from the regime).

A config that leaves ``outer.lr`` or ``outer.momentum`` unset takes them from here, field by field, where a
rule applies; a value the user gives always wins, and so does ``outer.optimizer`` (a plug-in has its own).
Each rule is written down with its evidence in docs/outer.md ("Defaults from the regime").

The rules, pure functions of the run's shape:

- **One island: lr 1, momentum 0.** With one island every round merges only its own outer gradient, so an
  outer step of lr 1 without momentum puts the global fragment where the island's cut was, and rebase adoption
  keeps the island's trajectory exactly its inner optimizer's (tests/engine/test_one_island_reference.py:
  AdamW written out, to 5e-5). The Nesterov step (lr 0.7, momentum 0.9) instead replays the island's last
  progress on top of itself: measured at 3M tokens on the default model, 3 repeats each in two invocations, it
  ended 3.0-4.6% above the plain step in every repeat, and the plain step within 0.1% of data parallel on the same
  data (benchmarks/RESULTS.md#outer-regime).

Two or more islands keep the config's defaults: averaging is what the outer step is for, and no rule measured
better there yet (benchmarks/RESULTS.md#outer-regime).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OuterStep", "regime_outer_step"]


@dataclass(frozen=True)
class OuterStep:
    """Outer-step settings a regime rule picks: the built-in Nesterov SGD's learning rate and momentum."""

    lr: float
    momentum: float
    rule: str
    """The rule that picked them, in words (for the run's log)."""


def regime_outer_step(*, islands: int) -> OuterStep | None:
    """The outer step for a run of `islands` island slots (an elastic pool counts its maximum), or None where
    the config's defaults stand. Raises ValueError for fewer than one island."""
    if islands < 1:
        raise ValueError(f"islands must be >= 1, got {islands}")
    if islands == 1:
        return OuterStep(lr=1.0, momentum=0.0, rule="one island: its own trajectory, outer lr 1 and no momentum")
    return None
