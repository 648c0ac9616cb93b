"""Typed settings of the health monitor: where its run lives, what it creates, how long it waits, how it judges.

The driver builds these from `RunConfig` (orchestrator/run/driver.py) and passes them to the monitor's
constructor, grouped by what they are about instead of as sixteen loose arguments. They are frozen and
hold no defaults of their own: every value is declared once, in the config or in the policy it feeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchestrator.config import PoolConfig

__all__ = ["ActorClasses", "HealthThresholds", "MonitorPools", "MonitorTimeouts", "RunAddress"]


@dataclass(frozen=True)
class RunAddress:
    """Where the monitor's run lives: the run id every actor name starts with, their Ray namespace, and the
    name of the outer optimizer's actor."""

    run_id: str
    namespace: str
    outer_name: str


@dataclass(frozen=True)
class MonitorPools:
    """The pools the monitor places its islands in, in config order (`pools`), and how many ready island
    processes it keeps per pool to replace a failed island from (`warm_spares`, health.warm_spares)."""

    pools: tuple[PoolConfig, ...]
    warm_spares: int


@dataclass(frozen=True)
class ActorClasses:
    """The Ray actor classes the monitor creates (from orchestrator/actors/remote.py) and the islands' runtime env.

    Attributes:
        island: an island's leader (rank 0), also a warm spare (`IslandActor`).
        worker: a follower of an island of several workers (`IslandWorkerActor`); needed only by such pools.
        keeper: a pool's progress keeper (`ProgressKeeperActor`); needed only when specs name keepers.
        island_runtime_env: the job's runtime env, given back to every island process (the monitor may run with
            the control plane's, and actors inherit their creator's); None = DATA_PLANE_RUNTIME_ENV. Empty (a
            Ray the driver started) lets the islands take Ray's prestarted workers.
    """

    island: Any
    worker: Any = None
    keeper: Any = None
    island_runtime_env: dict | None = None


@dataclass(frozen=True)
class MonitorTimeouts:
    """How long the monitor waits, seconds: for a placement group or a starting process (`placement_s`), for any
    control call (`call_s`), and between two health-check rounds (`tick_s`)."""

    placement_s: float
    call_s: float
    tick_s: float


@dataclass(frozen=True)
class HealthThresholds:
    """The thresholds policies.health.assess_island judges an island by (see its docstring for each rule)."""

    factor: float
    floor_s: float
    startup_s: float
    unreachable_s: float

    def as_kwargs(self) -> dict[str, float]:
        """The keyword arguments of policies.health.assess_island these stand for."""
        return asdict(self)
