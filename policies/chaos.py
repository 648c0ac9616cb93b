"""Chaos schedules: which fault hits which island, and when (docs/architecture.md sections 4 and 7).

A :class:`FaultTape` is a list of :class:`Fault` values decided up front, so a chaos run is
reproducible: the injector replays the tape, the test asserts exact counts of injected faults.
Tapes come from a YAML file, from :func:`poisson_tape` (independent Poisson failures per island, over
seconds of the run), from :func:`fixed_tape` (exactly N failures per island, evenly spread over seconds)
or from :func:`fixed_budget_tape` (the same over the token budget, chaos mode ``fixed``: every fault falls
inside the run however long it takes). :func:`parse_chaos_spec`
turns the CLI shorthand of ``diloco train --chaos ...`` into a config dict and
:func:`tape_from_config` turns that dict into a tape. Nothing here reads the clock or injects
anything; the injector in ``orchestrator/`` acts on the tape.

Fault kinds are declared once, in :mod:`policies.fault_kinds`: what each hits, what ``duration_s`` and
``factor`` mean for it and which values they take, what a drawn tape fills in for it and how it is injected (each
kind's docstring there). The kind tuples this module exports (``FAULT_KINDS``, ``KILL_KINDS``, ...) are views of
that registry.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from policies import fault_kinds
from policies.fault_kinds import (
    CAPACITY_KINDS,
    DRAIN_DEADLINE_S,
    FAILURE_KINDS,
    FAULT_KINDS,
    JOINED_NODE_DEADLINE_S,
    KILL_KINDS,
    POISON_KINDS,
    RUN_KINDS,
    TapeParams,
    fault_kind,
)

__all__ = [
    "CAPACITY_KINDS", "DRAIN_DEADLINE_S", "FAILURE_KINDS", "FAULT_KINDS", "JOINED_NODE_DEADLINE_S", "KILL_KINDS",
    "POISON_KINDS", "RUN_KINDS", "Fault", "FaultTape", "poisson_tape", "retarget_island",
    "fixed_tape", "fixed_budget_tape",
    "parse_chaos_spec",
    "tape_from_config",
]

_RUN_STREAM = 2**32 - 1  # the run's Poisson stream's seed word, beside the islands' 0, 1, ... (poisson_tape)

_FAULT_FIELDS = ("island", "kind", "at_s", "at_step", "incarnation", "duration_s", "factor", "at_progress", "retarget")
_TRIGGERS = ("at_s", "at_step", "at_progress")


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass(frozen=True)
class Fault:
    """One fault for one island.

    Exactly one trigger is set: ``at_s`` (seconds since run start; hits whichever incarnation of
    the island is live then), ``at_progress`` (once the run has processed that fraction of its token
    budget; hits whichever incarnation is live then) or ``at_step`` (after that many inner steps of
    incarnation ``incarnation`` of the island; never fires if that incarnation does not reach the step).

    Attributes:
        island: island slot index, ``>= 0``; 0 for the run kinds (:data:`RUN_KINDS`), which name no island.
        kind: a registered kind's name (:func:`policies.fault_kinds.names`; the built-in ones: :data:`FAULT_KINDS`).
        at_s: trigger time in seconds since run start, ``>= 0``.
        at_step: trigger inner step of incarnation ``incarnation``, ``>= 0``.
        at_progress: trigger fraction of the run's token budget processed, ``0 <= at_progress < 1``.
        incarnation: incarnation ``at_step`` counts in, ``>= 1`` (informational for ``at_s``).
        duration_s: ``>= 0``, meaning by kind (its class in policies/fault_kinds.py; recovery delay for kills).
        factor: step-time multiplier of a ``slow`` fault, ``> 1``; must stay 1.0 for kinds that take none.
        retarget: a time or progress fault of an island or node kind that finds its island down when due hits the
            next live island instead (:func:`retarget_island`) rather than waiting for its own to come back; so a
            tape's fault rate holds however long restarts take. Default ``False``: the fault waits.
    """

    island: int
    kind: str
    at_s: float | None = None
    at_step: int | None = None
    incarnation: int = 1
    duration_s: float = 0.0
    factor: float = 1.0
    at_progress: float | None = None  # last: positional construction (island, kind, at_s, at_step, ...) is unchanged
    retarget: bool = False

    def __post_init__(self) -> None:
        _require(_is_int(self.island) and self.island >= 0,
                 f"Fault.island must be an int >= 0, got {self.island!r}; use the island slot index")
        _require(isinstance(self.kind, str) and self.kind in fault_kinds.names(),
                 f"Fault.kind must be one of {fault_kinds.names()}, got {self.kind!r}")
        _require(sum(getattr(self, t) is not None for t in _TRIGGERS) == 1,
                 f"Fault needs exactly one of at_s / at_step / at_progress, got at_s={self.at_s!r}, "
                 f"at_step={self.at_step!r}, at_progress={self.at_progress!r}; set at_s for a time trigger, at_step "
                 "for a step trigger or at_progress for a fraction of the token budget")
        if self.at_s is not None:
            _require(_is_number(self.at_s) and math.isfinite(self.at_s) and self.at_s >= 0,
                     f"Fault.at_s must be a finite number >= 0, got {self.at_s!r}; use seconds since run start")
            object.__setattr__(self, "at_s", float(self.at_s))
        if self.at_step is not None:
            _require(_is_int(self.at_step) and self.at_step >= 0,
                     f"Fault.at_step must be an int >= 0, got {self.at_step!r}; count inner steps of the incarnation")
            object.__setattr__(self, "at_step", int(self.at_step))
        if self.at_progress is not None:
            _require(_is_number(self.at_progress) and 0 <= self.at_progress < 1,
                     f"Fault.at_progress must be a number in [0, 1), got {self.at_progress!r}; use the fraction of the "
                     "token budget processed")
            object.__setattr__(self, "at_progress", float(self.at_progress))
        _require(_is_int(self.incarnation) and self.incarnation >= 1,
                 f"Fault.incarnation must be an int >= 1, got {self.incarnation!r}; the first incarnation is 1")
        _require(_is_number(self.duration_s) and math.isfinite(self.duration_s) and self.duration_s >= 0,
                 f"Fault.duration_s must be a finite number >= 0, got {self.duration_s!r}; 0 = the kind's default")
        _require(_is_number(self.factor) and math.isfinite(self.factor),
                 f"Fault.factor must be a finite number, got {self.factor!r}")
        _require(isinstance(self.retarget, bool), f"Fault.retarget must be true or false, got {self.retarget!r}")
        if self.retarget:
            _require(self.at_step is None, "Fault.retarget needs an at_s or at_progress trigger (an at_step fault "
                     "names one incarnation's step); drop retarget or trigger it by time or progress")
            _require(not fault_kind(self.kind).per_run, f"Fault.retarget is for faults of an island or its node; "
                     f"{self.kind!r} hits the run itself, so drop retarget")
        fault_kind(self.kind).check(self)  # the kind's own rules: a slow fault's factor, a drain's deadline, ...
        for name, cast in (("island", int), ("incarnation", int), ("duration_s", float), ("factor", float)):
            object.__setattr__(self, name, cast(getattr(self, name)))

    def sort_key(self) -> tuple:
        """``(at_s or inf, at_progress or inf, at_step or inf, island, ...)``: time faults first, then progress
        faults, then step faults."""
        return (
            math.inf if self.at_s is None else self.at_s,
            math.inf if self.at_progress is None else self.at_progress,
            math.inf if self.at_step is None else self.at_step,
            self.island,
            self.incarnation,
            fault_kinds.index(self.kind),
            self.duration_s,
            self.factor,
            self.retarget,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict; the unset trigger is left out, and ``retarget`` when false (tapes without it read as before)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if not (k in _TRIGGERS and v is None) and not (k == "retarget" and not v)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fault:
        """Inverse of :meth:`to_dict`; an unknown key is a one-line ``ValueError`` naming it."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a fault must be a mapping with keys {_FAULT_FIELDS}, got {d!r}")
        for key in d:
            if key not in _FAULT_FIELDS:
                raise ValueError(f"unknown fault key {key!r}; valid keys are {', '.join(_FAULT_FIELDS)}")
        for key in ("island", "kind"):
            if key not in d:
                raise ValueError(f"fault {dict(d)!r} lacks required key {key!r}")
        return cls(**dict(d))


@dataclass(frozen=True)
class FaultTape:
    """An ordered, immutable schedule of faults.

    Faults are kept sorted by :meth:`Fault.sort_key`: ``(at_s or inf, at_step or inf, island)``
    and then the remaining fields, so equal tapes compare equal whatever order they were built in.
    """

    faults: tuple[Fault, ...] = ()

    def __post_init__(self) -> None:
        faults = tuple(self.faults)
        for i, f in enumerate(faults):
            if not isinstance(f, Fault):
                raise ValueError(f"FaultTape.faults[{i}] must be a Fault, got {type(f).__name__}; "
                                 "build it with Fault(...)")
        object.__setattr__(self, "faults", tuple(sorted(faults, key=Fault.sort_key)))

    def __len__(self) -> int:
        return len(self.faults)

    def __iter__(self):
        return iter(self.faults)

    def for_island(self, island: int) -> list[Fault]:
        """The faults of one island, in tape order."""
        return [f for f in self.faults if f.island == island]

    def count(self, kind: str | None = None) -> int:
        """Number of faults, optionally only of ``kind``."""
        return sum(1 for f in self.faults if kind is None or f.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        """``{"faults": [fault dicts]}``, YAML/JSON friendly."""
        return {"faults": [f.to_dict() for f in self.faults]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FaultTape:
        """Inverse of :meth:`to_dict`; unknown keys are a one-line ``ValueError`` naming the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a fault tape must be a mapping like {{faults: [...]}}, got {type(d).__name__}")
        for key in d:
            if key != "faults":
                raise ValueError(f"unknown fault tape key {key!r}; the only key is 'faults'")
        faults = d.get("faults") or []
        if not isinstance(faults, (list, tuple)):
            raise ValueError(f"fault tape 'faults' must be a list, got {type(faults).__name__}")
        out = []
        for i, fd in enumerate(faults):
            try:
                out.append(Fault.from_dict(fd))
            except (TypeError, ValueError) as e:
                raise ValueError(f"faults[{i}]: {e}") from None
        return cls(tuple(out))

    def to_yaml(self, path: str | Path) -> None:
        """Write the tape as YAML (floats round-trip exactly)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: str | Path) -> FaultTape:
        """Read a tape written by :meth:`to_yaml` or by hand (``yaml.safe_load``)."""
        d = yaml.safe_load(Path(path).read_text())
        if d is None:
            raise ValueError(f"fault tape {str(path)!r} is empty; write at least 'faults: []'")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"fault tape {str(path)!r}: {e}") from None


def _check_common(*, islands: int, horizon_s: float, start_s: float) -> None:
    _require(_is_int(islands) and islands >= 1, f"islands must be an int >= 1, got {islands!r}")
    _require(math.isfinite(start_s) and start_s >= 0,
             f"start_s must be finite and >= 0, got {start_s}; use seconds since run start")
    _require(math.isfinite(horizon_s) and horizon_s > start_s,
             f"horizon_s must be finite and > start_s={start_s}, got {horizon_s}; use the run length in seconds")


def _check_seed(seed: int) -> None:
    _require(_is_int(seed) and seed >= 0, f"seed must be an int >= 0, got {seed!r}")


def _check_kinds(kinds: Sequence[str], kind_weights: Sequence[float] | None) -> np.ndarray:
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError(f"kinds must name at least one of {fault_kinds.names()}, got none")
    for k in kinds:
        fault_kind(k)  # an unknown one is a one-line error naming the valid kinds
    if kind_weights is None:
        return np.full(len(kinds), 1.0 / len(kinds))
    w = np.asarray(kind_weights, dtype=float)
    if w.shape != (len(kinds),):
        raise ValueError(f"kind_weights needs one weight per kind ({len(kinds)}), got {w.size}; "
                         "or pass None for uniform")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"kind_weights must be finite, >= 0 and not all 0, got {list(kind_weights)}")
    return w / w.sum()


def poisson_tape(
    *,
    islands: int,
    horizon_s: float,
    mtbf_s: float,
    seed: int,
    kinds: Sequence[str] = ("kill_island",),
    kind_weights: Sequence[float] | None = None,
    recovery_delay_s: tuple[float, float] = (0.0, 0.0),
    min_gap_s: float = 0.0,
    start_s: float = 0.0,
    slow_factor: float = 4.0,
    slow_duration_s: float = 0.0,
    drain_deadline_s: float = DRAIN_DEADLINE_S,
    retarget: bool = False,
) -> FaultTape:
    """Independent Poisson failures per island over ``(start_s, horizon_s)``.

    For each island ``m`` a generator ``numpy.random.default_rng([seed, m])`` draws, fault after
    fault, ``t_{k+1} = t_k + min_gap_s + Exp(mtbf_s)`` (``t_0 = start_s``, no gap before the
    first fault) until ``t >= horizon_s``; each fault's kind is drawn with probabilities
    ``kind_weights`` (uniform when ``None``). With ``min_gap_s = 0`` the faults of an island are a
    Poisson process of rate ``1 / mtbf_s`` (expected count ``(horizon_s - start_s) / mtbf_s``).

    ``min_gap_s`` *shifts* (it does not resample): after each fault the island is not at risk for
    ``min_gap_s`` seconds (a renewal process with dead time), so successive faults on one island
    are at least ``min_gap_s`` apart and the mean gap becomes ``min_gap_s + mtbf_s``. Set it above
    the recovery delay plus restart time so an island can rejoin before it fails again.

    Per-island streams make the tape reproducible (same seed, same tape) and make island ``m``'s
    faults independent of how many islands there are.

    Run kinds (:data:`RUN_KINDS`: the outer optimizer's and the monitor's kills) hit the run once, not once per
    island: they come from one more stream, the run's (``default_rng([seed, _RUN_STREAM])``), drawn the same way.
    A draw of a kind that does not apply to a stream (a run kind on an island's, an island kind on the run's) is
    no fault (thinning), so with kinds of weights ``w`` (summing to 1) each island's faults are a Poisson process of
    rate ``sum(w of island kinds) / mtbf_s`` and the run's of rate ``sum(w of run kinds) / mtbf_s``: the expected
    count of all faults is ``(islands * w_island + w_run) * (horizon_s - start_s) / mtbf_s`` (``min_gap_s = 0``).
    Without run kinds nothing is thinned and the tape is what it always was.

    Args:
        islands: island slots, ``>= 1``.
        horizon_s: end of the window in seconds since run start, ``> start_s``.
        mtbf_s: mean time between draws of one island (and of the run) while at risk, ``> 0``: without run kinds,
            the mean time between failures of one island.
        seed: ``>= 0``.
        kinds: fault kinds to draw from.
        kind_weights: relative probability per kind, or ``None`` for uniform.
        recovery_delay_s: ``(lo, hi)``; kill faults get ``duration_s ~ Uniform(lo, hi)``, the delay
            the health monitor waits before restarting the island.
        min_gap_s: dead time after each fault, ``>= 0``.
        start_s: no fault at or before this time, ``>= 0``.
        slow_factor: ``factor`` of drawn ``slow`` faults, ``> 1``.
        slow_duration_s: ``duration_s`` of drawn ``slow`` faults (0 = until the incarnation dies).
        drain_deadline_s: ``duration_s`` of drawn ``drain_node`` faults: the drained node's deadline, ``> 0``.
            Drawn ``node_joins`` faults add a node that stays.
        retarget: set :attr:`Fault.retarget` on the islands' faults: one due while its island is down hits the next
            live island, so the faults fire at the tape's rate even when restarts are slow (the soak's tape).
    """
    _check_poisson(
        mtbf_s=mtbf_s, seed=seed, kinds=kinds, kind_weights=kind_weights, recovery_delay_s=recovery_delay_s,
        min_gap_s=min_gap_s, start_s=start_s, slow_factor=slow_factor, slow_duration_s=slow_duration_s,
        drain_deadline_s=drain_deadline_s, retarget=retarget,
    )
    _check_common(islands=islands, horizon_s=horizon_s, start_s=start_s)
    kinds = tuple(kinds)
    cum = np.cumsum(_check_kinds(kinds, kind_weights))  # kind k is drawn when u in [cum[k-1], cum[k])
    lo, hi = (float(x) for x in recovery_delay_s)
    faults = []
    # Each island's stream, then the run's (its own seed word, so island streams do not depend on it), when any
    # run kind is drawn at all.
    streams: list[tuple[int | None, list[int]]] = [(m, [seed, m]) for m in range(islands)]
    if any(fault_kind(k).per_run for k in kinds):
        streams.append((None, [seed, _RUN_STREAM]))
    for m, entropy in streams:
        rng = np.random.default_rng(entropy)
        t = float(start_s)
        gap = 0.0
        while True:
            t = t + gap + float(rng.exponential(mtbf_s))
            kind = kinds[min(int(np.searchsorted(cum, rng.random(), side="right")), len(kinds) - 1)]
            delay = float(rng.uniform(lo, hi))  # drawn for every kind: a stream's draws do not depend on the kinds
            if t >= horizon_s:
                break
            if t <= start_s:  # an exponential draw of exactly 0; keep the window open
                t = math.nextafter(start_s, math.inf)
            of_kind = fault_kind(kind)
            if of_kind.per_run != (m is None):  # thinning: this kind does not apply to this stream
                gap = 0.0  # no fault, so no dead time after it
                continue
            params = TapeParams(recovery_delay_s=delay, slow_factor=slow_factor, slow_duration_s=slow_duration_s,
                                drain_deadline_s=drain_deadline_s)
            faults.append(Fault(island=0 if m is None else m, kind=kind, at_s=t, retarget=retarget and m is not None,
                                **of_kind.drawn(params)))
            gap = float(min_gap_s)
    return FaultTape(tuple(faults))


def _check_poisson(
    *, mtbf_s, seed, kinds, kind_weights, recovery_delay_s, min_gap_s, start_s, slow_factor, slow_duration_s,
    drain_deadline_s=DRAIN_DEADLINE_S, retarget=False,
) -> None:
    _require(isinstance(retarget, bool), f"retarget must be true or false, got {retarget!r}")
    _require(_is_number(drain_deadline_s) and math.isfinite(drain_deadline_s) and drain_deadline_s > 0,
             f"drain_deadline_s must be a finite number > 0, got {drain_deadline_s!r}; use e.g. 20")
    _require(_is_number(mtbf_s) and math.isfinite(mtbf_s) and mtbf_s > 0,
             f"mtbf_s must be a finite number > 0, got {mtbf_s!r}; use e.g. mtbf_s=60")
    _check_seed(seed)
    _check_kinds(kinds, kind_weights)
    try:
        lo, hi = (float(x) for x in recovery_delay_s)
    except (TypeError, ValueError):
        raise ValueError(f"recovery_delay_s must be a pair (lo, hi), got {recovery_delay_s!r}") from None
    _require(0.0 <= lo <= hi < math.inf, f"recovery_delay_s must satisfy 0 <= lo <= hi < inf, got ({lo}, {hi})")
    _require(math.isfinite(min_gap_s) and min_gap_s >= 0, f"min_gap_s must be finite and >= 0, got {min_gap_s}")
    _require(math.isfinite(start_s) and start_s >= 0, f"start_s must be finite and >= 0, got {start_s}")
    _require(math.isfinite(slow_factor) and slow_factor > 1.0,
             f"slow_factor must be > 1, got {slow_factor}; use e.g. 4.0")
    _require(math.isfinite(slow_duration_s) and slow_duration_s >= 0,
             f"slow_duration_s must be finite and >= 0, got {slow_duration_s}; 0 = until killed")


def fixed_tape(
    *,
    islands: int,
    failures_per_island: int,
    horizon_s: float,
    kind: str = "kill_island",
    start_s: float = 0.0,
    seed: int = 0,
    slow_factor: float = 4.0,
) -> FaultTape:
    """Exactly ``failures_per_island`` faults per island, evenly spread, islands staggered.

    With ``n = failures_per_island``, ``period = (horizon_s - start_s) / n`` and ``M = islands``,
    fault ``j`` of island ``m`` is at ``start_s + (j + u_m) * period`` where
    ``u_m = (r_m + 0.5 + phase) / M``, ``r = rng.permutation(M)`` and ``phase ~ Uniform(-0.5, 0.5)``
    from ``numpy.random.default_rng(seed)``. So every ``u_m`` is in ``(0, 1)`` (all faults strictly
    inside the window), an island's faults are exactly ``period`` apart, and the faults of all
    islands together are exactly ``period / M`` apart: no two islands fail at the same moment.

    Kill faults get ``duration_s = 0`` (restart at once), ``slow`` faults ``factor=slow_factor``
    until the incarnation dies.
    A run kind (:data:`RUN_KINDS`) gets ``failures_per_island`` faults in all (island 0's times): the run is one
    target, not one per island.
    """
    _check_common(islands=islands, horizon_s=horizon_s, start_s=start_s)
    _check_seed(seed)
    if not _is_int(failures_per_island) or failures_per_island < 1:
        raise ValueError(f"failures_per_island must be an int >= 1, got {failures_per_island!r}; "
                         "for no faults use mode 'none'")
    fixed = fault_kind(kind)
    rng = np.random.default_rng(seed)
    rank = rng.permutation(islands)
    phase = float(rng.uniform(-0.5, 0.5))
    period = (horizon_s - start_s) / failures_per_island
    # Kills restart at once (no recovery delay), a slowdown lasts until the incarnation dies, a drain has the default
    # deadline: what the kind fills in from these (policies/fault_kinds.py).
    fields = fixed.drawn(TapeParams(recovery_delay_s=0.0, slow_factor=float(slow_factor), slow_duration_s=0.0,
                                    drain_deadline_s=DRAIN_DEADLINE_S))
    targets = 1 if fixed.per_run else islands  # a run kind hits the run, one target, not each island
    faults = []
    for m in range(targets):
        u = (int(rank[m]) + 0.5 + phase) / islands
        for j in range(failures_per_island):
            faults.append(Fault(island=m, kind=kind, at_s=start_s + (j + u) * period, **fields))
    return FaultTape(tuple(faults))


def fixed_budget_tape(
    *,
    islands: int,
    failures_per_island: int,
    kind: str = "kill_island",
    start: float = 0.0,
    until: float = 0.9,
    seed: int = 0,
    slow_factor: float = 4.0,
) -> FaultTape:
    """:func:`fixed_tape`'s schedule on the run's progress instead of its clock: chaos mode ``fixed``.

    Each fault triggers once the run has processed a fraction of its token budget (``Fault.at_progress``),
    spread over ``(start, until)`` as :func:`fixed_tape` spreads them over ``(start_s, horizon_s)``: an island's
    faults ``(until - start) / failures_per_island`` apart, all islands' ``1 / islands`` of that apart. So every
    fault falls inside the run however long it takes, and the last ``1 - until`` of the budget is left for the
    last restarted islands to train again.
    """
    _require(_is_number(start) and _is_number(until) and 0 <= start < until < 1,
             f"start and until must be fractions of the token budget with 0 <= start < until < 1, got start={start!r}, "
             f"until={until!r}; e.g. until=0.9")
    on_clock = fixed_tape(islands=islands, failures_per_island=failures_per_island, horizon_s=float(until),
                          kind=kind, start_s=float(start), seed=seed, slow_factor=slow_factor)
    return FaultTape(tuple(dataclasses.replace(f, at_s=None, at_progress=f.at_s) for f in on_clock))


# --- CLI shorthand ------------------------------------------------------------------------------

_VALID_SPECS = (
    "none | tape:PATH.yaml | PATH.yaml | poisson:mtbf_s=60[,seed=3,kinds=kill_island|hang,"
    "kind_weights=3|1,recovery_delay_s=0|5,min_gap_s=10,start_s=5,drain_deadline_s=20] | "
    "fixed:failures=3[,kind=kill_island,seed=0,start=0,until=0.9]"
)


def _floats(value: str) -> list[float]:
    return [float(v) for v in value.split("|")]


def _bool(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(value)
    return value.lower() == "true"


def _pair(value: str) -> list[float]:
    lo_hi = _floats(value)
    return lo_hi * 2 if len(lo_hi) == 1 else lo_hi


# Keys of each mode's spec and how their values parse; "|" separates the items of a list.
_SPEC_KEYS: dict[str, dict[str, Any]] = {
    "poisson": {
        "mtbf_s": float, "seed": int, "kinds": lambda v: [k.strip() for k in v.split("|")], "kind_weights": _floats,
        "recovery_delay_s": _pair, "min_gap_s": float, "start_s": float, "slow_factor": float,
        "slow_duration_s": float, "drain_deadline_s": float, "retarget": lambda v: _bool(v),
    },
    "fixed": {"failures_per_island": int, "kind": str, "start": float, "until": float, "seed": int, "slow_factor": float},
}
_SPEC_REQUIRED = {"poisson": "mtbf_s", "fixed": "failures_per_island"}
_SPEC_ALIASES = {"failures": "failures_per_island"}


def _spec_defaults(fn) -> dict[str, Any]:
    """Keyword defaults of ``fn`` except the run's ``islands``/``horizon_s``, tuples as lists."""
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name not in ("islands", "horizon_s") and p.default is not inspect.Parameter.empty:
            out[name] = list(p.default) if isinstance(p.default, tuple) else p.default
    return out


def parse_chaos_spec(spec: str) -> dict:
    """Parse the ``--chaos`` shorthand into the chaos config dict.

    - ``none`` -> ``{"mode": "none"}``
    - ``tape:runs/t.yaml`` or ``runs/t.yaml`` (ends in .yaml/.yml) -> ``{"mode": "tape", "path": "runs/t.yaml"}``
    - ``poisson:mtbf_s=60,seed=3,kinds=kill_island|hang`` -> ``{"mode": "poisson", "mtbf_s": 60.0, ...}``
    - ``fixed:failures=3`` -> ``{"mode": "fixed", "failures_per_island": 3, ...}``

    The poisson and fixed dicts hold every keyword of :func:`poisson_tape` / :func:`fixed_budget_tape`
    except ``islands`` and ``horizon_s`` (the run supplies those), defaults filled in (``seed`` 0),
    lists for sequences (``kinds``, ``kind_weights``, ``recovery_delay_s``; ``|`` separates items, and a single
    ``recovery_delay_s=5`` means ``[5, 5]``). ``failures`` is short for ``failures_per_island``.
    Values are validated here; anything else is a one-line ``ValueError`` listing the valid forms.
    """
    if not isinstance(spec, str):
        raise ValueError(f"chaos spec must be a string, got {type(spec).__name__}; valid forms: {_VALID_SPECS}")
    s = spec.strip()
    mode, colon, body = s.partition(":")
    if s.lower() == "none":
        return {"mode": "none"}
    if colon and mode == "tape":
        if not body.strip():
            raise ValueError(f"chaos spec {spec!r} names no tape file; use tape:PATH.yaml")
        return {"mode": "tape", "path": body.strip()}
    if colon and mode in _SPEC_KEYS:
        keys = _SPEC_KEYS[mode]
        out: dict[str, Any] = {"mode": mode, _SPEC_REQUIRED[mode]: None, "seed": 0}  # seed defaults to 0
        out.update(_spec_defaults(poisson_tape if mode == "poisson" else fixed_budget_tape))
        given: set[str] = set()
        for item in filter(None, (x.strip() for x in body.split(","))):
            key, eq, value = (x.strip() for x in item.partition("="))
            key = _SPEC_ALIASES.get(key, key)
            if not eq or not value:
                raise ValueError(f"chaos spec {spec!r}: {item!r} is not KEY=VALUE; valid forms: {_VALID_SPECS}")
            if key not in keys:
                raise ValueError(f"chaos spec {spec!r}: unknown {mode} key {key!r}; valid keys: {', '.join(keys)}")
            if key in given:
                raise ValueError(f"chaos spec {spec!r}: {key!r} given twice; give each key once")
            try:
                out[key] = keys[key](value)
            except ValueError:
                raise ValueError(f"chaos spec {spec!r}: {key}={value!r} does not parse") from None
            given.add(key)
        if _SPEC_REQUIRED[mode] not in given:
            raise ValueError(f"chaos spec {spec!r} needs {_SPEC_REQUIRED[mode]}; valid forms: {_VALID_SPECS}")
        params = {k: v for k, v in out.items() if k != "mode"}
        try:
            if mode == "poisson":
                _check_poisson(**params)
            else:  # a throwaway one-island tape validates every value
                fixed_budget_tape(islands=1, **params)
        except ValueError as e:
            raise ValueError(f"chaos spec {spec!r}: {e}") from None
        return out
    if s.endswith((".yaml", ".yml")):
        return {"mode": "tape", "path": s}
    raise ValueError(f"unknown chaos spec {spec!r}; valid forms: {_VALID_SPECS}")


def retarget_island(island: int, live: Collection[int]) -> int | None:
    """Where a retargeted fault (:attr:`Fault.retarget`) of a down ``island`` goes: the first live island after it in
    slot order, wrapping around (``island`` itself if it is live); ``None`` when no island is live (it waits).

    The next one, not a random one, so a replay of a tape against the same liveness hits the same islands."""
    if not live:
        return None
    ordered = sorted(live)
    return next((i for i in ordered if i >= island), ordered[0])


def tape_from_config(config: Mapping[str, Any], *, islands: int, horizon_s: float) -> FaultTape:
    """Build the tape a chaos config dict (as from :func:`parse_chaos_spec`) describes.

    ``none`` gives an empty tape, ``tape`` reads the YAML file, ``poisson`` / ``fixed`` call
    :func:`poisson_tape` with the run's ``islands`` and ``horizon_s``, ``fixed`` :func:`fixed_budget_tape` with its
    ``islands`` (its faults trigger on the token budget: no horizon; ``failures`` is accepted for
    ``failures_per_island``, as in the CLI shorthand).
    """
    params = {_SPEC_ALIASES.get(k, k) if _SPEC_ALIASES.get(k) not in config else k: v for k, v in config.items()}
    mode = params.pop("mode", None)
    if mode == "none" and not params:
        return FaultTape(())
    if mode == "tape" and set(params) == {"path"}:
        return FaultTape.from_yaml(params["path"])
    if mode in _SPEC_KEYS and set(params) <= set(_SPEC_KEYS[mode]):
        if mode == "poisson":
            if "recovery_delay_s" in params:
                params["recovery_delay_s"] = tuple(params["recovery_delay_s"])
            return poisson_tape(islands=islands, horizon_s=horizon_s, **params)
        return fixed_budget_tape(islands=islands, **params)
    if mode not in ("none", "tape", *_SPEC_KEYS):
        raise ValueError(f"chaos mode must be one of none, tape, poisson, fixed, got {mode!r}")
    valid = {"none": [], "tape": ["path"], **{m: list(k) for m, k in _SPEC_KEYS.items()}}[mode]
    raise ValueError(f"chaos mode {mode!r} takes {valid or 'no parameters'}, got {sorted(params)}")
