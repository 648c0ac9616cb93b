"""What a run's start-up is doing, as it happens: the stages the driver reports before (and at) the first step.

The driver (orchestrator/run/driver.py) hands each `Stage` to the `stages` callable of `train()` / `Run`;
`diloco train` prints them on the progress bar's stream (orchestrator/cli/train.py). Imports neither
torch nor Ray, so the CLI can announce the first stage before it loads the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config import RunConfig

__all__ = ["STAGES", "Stage", "StartupStages", "islands_ready", "placing_text", "stepped_islands"]

# In the order a run begins them; "islands" repeats as more islands come up, and "first_step" comes as soon as
# one island has stepped, which may be before the last island is up.
STAGES = ("load", "ray", "placing", "islands", "first_step")


@dataclass(frozen=True)
class Stage:
    """One start-up stage, reported when it begins (or, for "islands" and "first_step", when it happened).

    name: one of STAGES. text: one line for a person, e.g. "islands ready 2 of 4".
    done, of: for "islands", how many of how many islands are up (their processes built, training).
    """

    name: str
    text: str
    done: int = 0
    of: int = 0


class StartupStages:
    """Hands a session's start-up stages to `stages` (the `stages` callable of `train()`; None: nobody listens),
    and "first_step" once: `first_step_seen` says whether it came (kept whether anyone listens or not)."""

    def __init__(self, stages: Callable[[Stage], None] | None) -> None:
        self.stages = stages
        self.first_step_seen = False

    @property
    def listening(self) -> bool:
        """Whether a caller takes the stages (the driver then polls its islands while they start)."""
        return self.stages is not None

    def __call__(self, name: str, text: str, done: int = 0, of: int = 0) -> None:
        """Report the stage `name` (one of STAGES) with `text`; `done` of `of` for "islands"."""
        if self.stages is not None:
            self.stages(Stage(name, text, done, of))

    def first_step(self, stepped: list[int]) -> None:
        """Report "first_step" the first time `stepped` (the islands that have stepped) names one."""
        if stepped and not self.first_step_seen:
            self.first_step_seen = True
            self("first_step", f"first step (island {', '.join(map(str, stepped))})")


def placing_text(cfg: RunConfig) -> str:
    """"placing 4 islands in 2 pools (fast 2, slow 2)": what the "placing" stage says."""
    pools = ", ".join(f"{p.name} {p.min_islands}-{p.islands}" if p.elastic else f"{p.name} {p.islands}" for p in cfg.pools)
    count = f"{cfg.required_islands}-{cfg.num_islands}" if cfg.required_islands < cfg.num_islands else str(cfg.num_islands)
    return f"placing {count} islands in {len(cfg.pools)} pools ({pools})"


def islands_ready(snapshot: dict, first_incarnation: dict[int, int]) -> int:
    """How many island slots of a health monitor's `snapshot` hold a started process of this session: placed,
    built and answering (the monitor sets a slot's node once the process's constructor has returned)."""
    return sum(1 for i, slot in snapshot["slots"].items()
               if slot.get("node") and slot["incarnation"] >= first_incarnation.get(int(i), 1))


def stepped_islands(snapshot: dict, first_incarnation: dict[int, int]) -> list[int]:
    """The island slots of a health monitor's `snapshot` whose process of this session has completed a step."""
    return sorted(int(i) for i, slot in snapshot["slots"].items()
                  if slot.get("steps", 0) > 0 and slot["incarnation"] >= first_incarnation.get(int(i), 1))
