"""Fault kinds: every kind of fault the chaos machinery knows, declared once, each a class (issue 58 item 3).

A kind says

- what it hits (``target``): the island's incarnation (:data:`ISLAND`), the island's node (:data:`NODE`), a node for
  the island's pool (:data:`POOL`) or the run's control plane (:data:`RUN`: no island, a fault's ``island`` is 0);
- whether it ends the incarnation, so the health monitor dates that failure at the fault (``failure``), whether it
  kills (``kills``: ``duration_s`` is the recovery delay), whether it is capacity that comes and goes (``capacity``);
- what ``duration_s`` and ``factor`` mean for it and which values they may take (:meth:`FaultKind.check`, run by
  ``policies.chaos.Fault``), and what a drawn tape fills in for it (:meth:`FaultKind.drawn`);
- how it is injected: by the chaos injector actor through the mechanism named by ``injection``
  (orchestrator/actors/chaos_injector.py implements each mechanism once, as ``_fire_<injection>``), and, for an
  :class:`IslandFaultKind`, on the island itself through :meth:`IslandFaultKind.inject_island`, which sets the
  island's fault hooks (:class:`IslandHooks`, implemented by ``islands.faults.InjectedFaults``).

A kind names its mechanism instead of holding the code that needs Ray handles, so this module stays pure: it
imports neither Ray nor torch at import time (the health monitor and the injector never import torch; the noise
poison imports it when an island, which holds torch anyway, makes one).

The registry: defining a subclass that sets ``name`` registers one instance of it, in definition order. That order
is the tie-break of faults of equal time (``Fault.sort_key``), so kinds are only ever appended. A new built-in kind
is one class at the end of this module; docs/architecture.md ("Adding a fault kind") says what to set. A kind
defined in another module (a test's) registers when that module is imported, so in a Ray run it would have to be
imported by every process that meets it: built-in kinds live here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypedDict

__all__ = [
    "CAPACITY_KINDS", "DRAIN_DEADLINE_S", "FAILURE_KINDS", "FAULT_KINDS", "ISLAND", "JOINED_NODE_DEADLINE_S",
    "KILL_KINDS", "NODE", "POISON_KINDS", "POISON_SCALE", "POOL", "RUN", "RUN_KINDS",
    "Drawn", "FaultFields", "FaultKind", "IslandFaultKind", "IslandHooks", "PoisonKind", "RunKind", "TapeParams",
    "fault_kind", "index", "island_kind", "kinds", "names", "poison_kind", "unregister", "until",
]

# What a kind hits (FaultKind.target).
ISLAND, NODE, POOL, RUN = "island", "node", "pool", "run"
JOINED_NODE_DEADLINE_S = 20.0  # the deadline a node_joins node is drained with when its duration_s runs out
DRAIN_DEADLINE_S = 20.0  # drain_node's deadline in Poisson and fixed tapes (drain_deadline_s)
POISON_SCALE = 100.0  # scaled_submission's factor on the outer gradient

_REGISTRY: dict[str, FaultKind] = {}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def until(now: float, duration_s: float) -> float:
    """The end of a fault injected at ``now`` lasting ``duration_s`` (0: until the incarnation ends, ``inf``)."""
    return now + duration_s if duration_s > 0 else math.inf


@dataclass(frozen=True)
class TapeParams:
    """What a drawn tape (``policies.chaos.poisson_tape`` / ``fixed_tape``) offers a kind to fill a fault in with."""

    recovery_delay_s: float  # this draw's recovery delay (Poisson: Uniform(recovery_delay_s); fixed: 0)
    slow_factor: float
    slow_duration_s: float
    drain_deadline_s: float


class FaultFields(Protocol):
    """What a kind's rules read of a fault (``policies.chaos.Fault``, which imports this module: no import back)."""

    @property
    def island(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def factor(self) -> float: ...


class Drawn(TypedDict, total=False):
    """The ``Fault`` fields a kind fills in on a drawn tape (:meth:`FaultKind.drawn`); a field left out keeps its default."""

    duration_s: float
    factor: float


class IslandHooks(Protocol):
    """The island's fault state an :class:`IslandFaultKind` sets (``islands.faults.InjectedFaults``). Times are
    monotonic seconds; ``inf`` = until the incarnation ends. The inner loop and the outbox read the state back."""

    def hang_until(self, until: float) -> None:
        """Hold the inner loop (control calls still answered) until ``until``."""

    def slow_until(self, factor: float, until: float) -> None:
        """Stretch each inner step by ``factor`` until ``until``."""

    def drop_next(self) -> None:
        """Lose the next submission on the way."""

    def drop_until(self, until: float) -> None:
        """Lose every submission until ``until``."""

    def corrupt_next(self) -> None:
        """Send the next submission as NaN."""

    def corrupt_until(self, until: float) -> None:
        """Send every submission until ``until`` as NaN."""

    def poison_until(self, kind: str, until: float) -> None:
        """Send every submission until ``until`` poisoned as ``kind`` (a :class:`PoisonKind`'s name)."""

    def kill_node(self) -> None:
        """Kill the island's node (its raylet): the island dies with every other process there."""


class FaultKind:
    """One kind of fault. Subclass it and set ``name`` to declare (and register) a kind.

    Class attributes describe the kind (module docstring); the methods are its rules. The defaults are an island kind
    that takes no factor, whose ``duration_s`` is free (``>= 0``) and which a drawn tape gives neither."""

    name: ClassVar[str]
    target: ClassVar[str] = ISLAND
    failure: ClassVar[bool] = False  # ends the incarnation: the monitor dates the failure at the fault
    kills: ClassVar[bool] = False  # duration_s is the recovery delay the monitor waits before restarting the island
    capacity: ClassVar[bool] = False  # capacity that comes and goes (elastic pools), not an island failure
    takes_factor: ClassVar[bool] = False  # Fault.factor applies (else it must stay 1.0)
    injection: ClassVar[str]  # the injector's mechanism: ChaosInjector._fire_<injection>
    reported: ClassVar[bool] = True  # the injector tells the monitor (note_fault) before an island or node fault

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _require(cls.name not in _REGISTRY, f"fault kind {cls.name!r} is declared twice ({_REGISTRY.get(cls.name)!r} "
                                                f"and {cls.__qualname__}); give the new kind another name")
            _REGISTRY[cls.name] = cls()

    def __repr__(self) -> str:
        return f"<fault kind {self.name}>"

    @property
    def per_run(self) -> bool:
        """A run kind hits the run once, not each island: one target in a tape, its own Poisson stream."""
        return self.target == RUN

    def check(self, fault: FaultFields) -> None:
        """Refuse a fault of this kind whose parameters do not fit it (a one-line ``ValueError``)."""
        _require(self.takes_factor or fault.factor == 1.0,
                 f"Fault.factor only applies to kind {' or '.join(repr(k.name) for k in kinds() if k.takes_factor)}, got "
                 f"factor={fault.factor} for {fault.kind!r}; leave it 1.0")

    def drawn(self, params: TapeParams) -> Drawn:
        """The ``Fault`` fields (``duration_s``, ``factor``) a drawn tape gives a fault of this kind; unset: 0 and 1."""
        return {}

    def recovery_delay_s(self, fault: FaultFields) -> float:
        """Seconds the monitor waits before restarting the island this fault ends (the injector reports it)."""
        return fault.duration_s if self.kills else 0.0


class IslandFaultKind(FaultKind):
    """A kind the island injects into itself (``LearnerIsland.inject``), through its fault hooks."""

    injection = "on_island"  # the injector calls the island's inject() and waits for it

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        """Set ``hooks`` for this fault, injected at monotonic time ``now``."""
        raise NotImplementedError(f"{type(self).__qualname__} must define inject_island")


# --- the kinds, in their order (appended only) -------------------------------------------------------------------


class _Kill(FaultKind):
    """A kill: ``duration_s`` is the recovery delay, seconds after the kill before the health monitor may restart the
    island (models a replacement node arriving); 0 = restart at once. Poisson tapes draw it from ``recovery_delay_s``."""

    failure = kills = True

    def drawn(self, params: TapeParams) -> Drawn:
        return {"duration_s": params.recovery_delay_s}


class KillIsland(_Kill):
    """``kill_island``: the island's actor is killed from outside (``ray.kill``). Recovery delay as :class:`_Kill`."""

    name = "kill_island"
    injection = "kill_island"


class KillNode(_Kill, IslandFaultKind):
    """``kill_node``: the island kills its node's raylet (never the driver's node). Recovery delay as :class:`_Kill`."""

    name = "kill_node"
    target = NODE
    injection = "kill_node"  # the injector asks the island and waits for no reply: the node dies with it

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        hooks.kill_node()


class Hang(IslandFaultKind):
    """``hang``: ``duration_s`` seconds the inner loop hangs; 0 = until the health monitor kills the incarnation."""

    name = "hang"
    failure = True

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        hooks.hang_until(until(now, duration_s))


class Slow(IslandFaultKind):
    """``slow``: seconds each inner step is stretched by ``factor`` (``> 1``); 0 = until the incarnation dies."""

    name = "slow"
    takes_factor = True

    def check(self, fault: FaultFields) -> None:
        _require(fault.factor > 1.0, f"Fault.factor of a slow fault must be > 1, got {fault.factor}; use e.g. factor=4.0")

    def drawn(self, params: TapeParams) -> Drawn:
        return {"duration_s": params.slow_duration_s, "factor": params.slow_factor}

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        if factor <= 1.0:
            raise ValueError(f"slow fault needs factor > 1, got {factor}")
        hooks.slow_until(factor, until(now, duration_s))


class DropSubmission(IslandFaultKind):
    """``drop_submission``: every submission the island makes in ``[at, at + duration_s)`` is lost on the way;
    0 = only its next submission."""

    name = "drop_submission"

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        if duration_s > 0:
            hooks.drop_until(now + duration_s)
        else:
            hooks.drop_next()


class CorruptSubmission(IslandFaultKind):
    """``corrupt_submission``: every submission in ``[at, at + duration_s)`` goes out as NaN (the outer optimizer
    refuses it and the island as diverged); 0 = only its next submission."""

    name = "corrupt_submission"
    failure = True

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        if duration_s > 0:
            hooks.corrupt_until(now + duration_s)
        else:
            hooks.corrupt_next()


class DrainNode(FaultKind):
    """``drain_node``: the island's node is drained with a deadline ``duration_s`` seconds away (a preemption notice),
    ``> 0``, and ended at the deadline, as a cloud reclaims a VM. Never the driver's node."""

    name = "drain_node"
    target = NODE
    capacity = True
    injection = "drain_node"
    reported = False  # no failure to note: the monitor sees the drain itself (orchestrator/actors/drains.py)

    def check(self, fault: FaultFields) -> None:
        _require(fault.duration_s > 0, f"Fault.duration_s of a {self.name} fault is its node's deadline and must be > 0, "
                                       f"got {fault.duration_s}; use e.g. duration_s=20")
        super().check(fault)

    def drawn(self, params: TapeParams) -> Drawn:
        return {"duration_s": params.drain_deadline_s}


class NodeJoins(FaultKind):
    """``node_joins``: a node for the island's pool joins the cluster (``island`` names a slot of that pool: an elastic
    pool's vacant slots fill from it); ``duration_s`` 0 = it stays, else it is drained with deadline
    :data:`JOINED_NODE_DEADLINE_S` after that many seconds."""

    name = "node_joins"
    target = POOL
    capacity = True
    injection = "node_joins"


class PoisonKind(IslandFaultKind):
    """A poisoned island: for ``duration_s`` seconds (0 = until the incarnation ends) it sends outer gradients that are
    finite and well shaped but wrong; the outer optimizer's poison guard (policies/poison_guard.py) must refuse them.
    ``factor`` is unused (1.0)."""

    needs_stale_base: ClassVar[bool] = False  # the outbox keeps each fragment's base from when the poison began

    def inject_island(self, hooks: IslandHooks, *, now: float, duration_s: float, factor: float) -> None:
        hooks.poison_until(self.name, until(now, duration_s))

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        """A fragment's honest outer gradient ``owed`` (tensors, measured from ``anchor``) as this poison sends it.

        ``stale_base``: the fragment's base when the fault began; ``seed``: the cut's own (its island and seq), so a
        run is reproducible."""
        raise NotImplementedError(f"{type(self).__qualname__} must define poisoned")


class ScaledSubmission(PoisonKind):
    """``scaled_submission``: the outer gradient times :data:`POISON_SCALE`."""

    name = "scaled_submission"

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        return [o * POISON_SCALE for o in owed]


class FlippedSubmission(PoisonKind):
    """``flipped_submission``: the outer gradient sign-flipped."""

    name = "flipped_submission"

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        return [-o for o in owed]


class StaleSubmission(PoisonKind):
    """``stale_submission``: measured from the base the island held when the fault began, so ever more stale, under
    the current version's number, as an island whose copy stopped following would send it (its base digest is the
    stale base's: islands/outbox.py; policies/base_check.py)."""

    name = "stale_submission"
    needs_stale_base = True

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        if stale_base is None or [t.shape for t in stale_base] != [t.shape for t in owed]:
            return owed  # an FSDP worker's parts: the stale base is of whole tensors only
        return [o + (b - a) for o, b, a in zip(owed, stale_base, anchor)]


class NoiseSubmission(PoisonKind):
    """``noise_submission``: random noise of the honest outer gradient's norm, seeded by the cut."""

    name = "noise_submission"

    def poisoned(self, owed: list, *, stale_base: list | None, anchor: list, seed: int) -> list:
        import hashlib

        import torch  # here, not at import: the monitor and the injector never import torch

        # The cut's seed hashed, not used as is: island 0's first cut has seed 0, the run's default seed, and torch's
        # randn from seed 0 drew exactly the model's initial token embedding (cosine 1.0), which every honest outer
        # gradient shares through weight decay: that "noise" read +0.01 against a limit of +0.007 and was merged.
        digest = hashlib.blake2b(f"{self.name}:{seed}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        out = []
        for o in owed:
            r = torch.randn(o.shape, generator=gen, dtype=o.dtype)
            out.append(r * (torch.linalg.vector_norm(o) / torch.linalg.vector_norm(r).clamp_min(1e-30)))
        return out


class RunKind(FaultKind):
    """A run kind: one of the run's control-plane actors is killed with ``ray.kill(no_restart=False)`` and Ray restarts
    it. It names no island (``island`` must be 0) and ``duration_s`` is unused (0): Ray restarts the actor at once."""

    target = RUN

    def check(self, fault: FaultFields) -> None:
        super().check(fault)
        # A run kind hits the run's one outer optimizer or monitor: an island number would read as a target it is not.
        _require(fault.island == 0, f"Fault.island of a {self.name} fault must be 0 (it names no island: the run has one), "
                                    f"got {fault.island}")
        _require(fault.duration_s == 0, f"Fault.duration_s of a {self.name} fault must be 0 (Ray restarts the actor at "
                                        f"once), got {fault.duration_s}")


class KillOuter(RunKind):
    """``kill_outer``: the outer optimizer is killed; it restarts from its newest checkpoint."""

    name = "kill_outer"
    injection = "kill_outer"


class KillMonitor(RunKind):
    """``kill_monitor``: the health monitor is killed; it restarts and re-adopts the islands."""

    name = "kill_monitor"
    injection = "kill_monitor"


# --- the registry ------------------------------------------------------------------------------------------------


def kinds() -> tuple[FaultKind, ...]:
    """Every registered kind, in declaration order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    """Every registered kind's name, in declaration order."""
    return tuple(_REGISTRY)


def fault_kind(name: str) -> FaultKind:
    """The kind called ``name``; an unknown name is a one-line ``ValueError`` naming the valid kinds."""
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown fault kind {name!r}; valid kinds are {', '.join(_REGISTRY)}")
    return kind


def island_kind(name: str) -> IslandFaultKind:
    """The island kind called ``name`` (one an island injects into itself); anything else is a one-line
    ``ValueError`` naming the island kinds."""
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if not isinstance(kind, IslandFaultKind):
        island_kinds = [k.name for k in _REGISTRY.values() if isinstance(k, IslandFaultKind)]
        raise ValueError(f"unknown fault kind {name!r} for an island; use {', '.join(island_kinds)}")
    return kind


def poison_kind(name: str) -> PoisonKind:
    """The poison kind called ``name``; anything else is a one-line ``ValueError`` naming the poison kinds."""
    kind = _REGISTRY.get(name) if isinstance(name, str) else None
    if not isinstance(kind, PoisonKind):
        poisons = [k.name for k in _REGISTRY.values() if isinstance(k, PoisonKind)]
        raise ValueError(f"unknown poison kind {name!r}; use one of {', '.join(poisons)}")
    return kind


def index(name: str) -> int:
    """A kind's place in declaration order (the tie-break of faults of equal time)."""
    return list(_REGISTRY).index(name)


def unregister(name: str) -> None:
    """Take a kind off the registry: for a kind a test declared, once the test is done. Built-in kinds stay."""
    _require(name not in FAULT_KINDS, f"fault kind {name!r} is built in and cannot be unregistered")
    _REGISTRY.pop(name, None)


def _named(pick: Sequence[FaultKind]) -> tuple[str, ...]:
    return tuple(k.name for k in pick)


# Views of the built-in kinds (taken here, after the last of them): kinds registered later, by tests, are in names().
FAULT_KINDS = names()
KILL_KINDS = _named([k for k in kinds() if k.kills])
# Faults that end the island's incarnation (killed, hung until killed, refused as diverged): the monitor dates such a
# failure at the fault. A slow island or a dropped submission goes on training, so a later failure of it is not theirs.
FAILURE_KINDS = _named([k for k in kinds() if k.failure])
POISON_KINDS = _named([k for k in kinds() if isinstance(k, PoisonKind)])
RUN_KINDS = _named([k for k in kinds() if k.per_run])  # the run's control-plane actors, not an island: `island` is 0
CAPACITY_KINDS = _named([k for k in kinds() if k.capacity])  # capacity that comes and goes (elastic pools)
