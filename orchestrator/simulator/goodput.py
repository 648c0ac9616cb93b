"""Goodput simulator: a training job on N chips under per-chip failures, for three methods.

Model (docs/simulator.md has the full list of assumptions and the calibration):

* Chips are grouped into slices of ``slice_chips`` (the failure domain). Slice interruptions are
  drawn exactly for per-chip Poisson failures (:mod:`policies.interruptions`); a slice is down for a
  lognormal recovery time ``R`` (mean ``recovery_mean_s``), the time until its capacity is back.
* A *group* is a set of slices that steps synchronously. ``dp`` and ``elastic-dp`` are one group of
  all slices; ``decoupled`` is ``learners`` groups of about N/M chips each that never wait for each
  other. A group's state is a piecewise-constant timeline (live chips, blocked or not), built by one
  sort and one cumulative sum over all its events, never a Python object per chip.
* ``stall`` groups (``dp``): failure i stalls every chip for ``D_i = R_i + restart_s`` (the failed
  slice is replaced by a spare, then the job restarts). The spare takes the model state from an intact
  data-parallel replica, so the job loses only the step in flight: the work since its last completed
  step (steps of ``step_time_s``). A failure during a stall does not extend it: the recovery under way
  replaces its slice too. Exact closed form (renewal): ``goodput = k / (1 + lambda E[D])``,
  ``lambda = chips / mtbi_chip_s``, ``k = lambda s / (exp(lambda s) - 1)`` the share of completed steps.
* ``elastic`` groups (``elastic-dp``, each decoupled learner): a failed slice is out on
  ``[t_i, t_i + R_i)`` while the group steps on its other slices; dropping it and re-adding it are
  reconfigurations that pause the group for ``P = reconfig_s`` each, and a change during a running
  reconfiguration is handled by it without extending it. Closed form when the changes are close to
  Poisson: ``goodput ~ (1 - slice_chips E[R] / mtbi_chip_s) / (1 + 2 lambda_g P)`` for a group of
  ``lambda_g`` failures per second. Only when every slice of the group is down at once is its state
  lost back to the last durable point (never at the paper's scales; for elastic-dp, with no replica
  left, the last completed step is an optimistic stand-in for a checkpoint in storage).
* Durable points: dp/elastic-dp every completed step (what an intact replica holds); decoupled learner
  submissions every ``sync_period_s`` of stepping, merged by the outer optimizer with minimum quorum K
  and the adaptive grace window (:func:`policies.quorum.decide_round`,
  :func:`policies.quorum.grace_window_s`). The run keeps its work at the horizon (dp, elastic-dp) or
  closes a final round.
* Optional stragglers: per-step lognormal jitter of sigma ``step_jitter_sigma`` per slice; a
  synchronous group of n slices steps at the pace of its slowest slice, so its chips are busy a
  fraction ``E[X] / E[max(X_1..X_n)]`` of the time. Decoupled learners wait only for their own slices.
* Optional elastic capacity (``capacity_mean_up_s`` finite): the fleet comes and goes in ``learners``
  slots (decoupled's learners; the same slices for dp and elastic-dp), each present and absent for
  exponential periods. Absent chips do not fail; capacity comes back healthy. A decoupled learner is out
  while its slot is, and rejoins after a reconfiguration ``P``; elastic-dp drops and re-adds the slot's
  slices like failed ones; dp, a fixed-size job, runs only while every slot is present and restarts
  (``restart_s``) once all are back. A reclaim with notice (default) loses no work; without, it loses
  what a failure would.

Goodput = productive chip-time / allocated chip-time (``chips * horizon_s``, or the chip-time present
under elastic capacity), where productive means the work reached the final model. Uptime = fraction of
wall time in which the global model advances: the kept stepping time of the group (dp, elastic-dp), the
time with at least K learners stepping (decoupled). No Ray here; time and the seed are arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from policies import interruptions
from policies.quorum import decide_round, grace_window_s

log = logging.getLogger(__name__)

METHODS = ("dp", "elastic-dp", "decoupled")

# Calibrated once, jointly, so that 1.2M chips at 1 chip-year give dp ~0.27 and decoupled (8 learners)
# ~0.88 (docs/simulator.md, "Calibration"); every other cell, dp at 150k and 2.4M chips included, follows
# from the mechanism.
RECOVERY_MEAN_S = 55.0  # a failed slice's capacity is back: hot spare swapped in, or fault cleared
RECONFIG_S = 14.3  # rebuild the job's mesh on a new set of slices: elastic drop / re-add of a slice
RESTART_S = RECONFIG_S  # dp's restart onto a spare is the same rebuild, plus the rollback below
SALVAGED = -1  # the learner id run_rounds gets for a salvaged submission


class ConfigError(ValueError):
    """A bad simulator setting: ``field``, ``value``, the rule broken and how to fix it."""

    def __init__(self, field: str, value: object, rule: str, fix: str) -> None:
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        super().__init__(f"{field}={value!r}: {rule}; {fix}")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One simulated job. Times in seconds unless the name says otherwise."""

    method: str = "decoupled"
    chips: int = 1_200_000
    learners: int = 8
    mtbi_chip_years: float = 1.0
    horizon_days: float = 7.0
    slice_chips: int = 256
    recovery_mean_s: float = RECOVERY_MEAN_S
    recovery_sigma: float = 0.5
    restart_s: float = RESTART_S
    reconfig_s: float = RECONFIG_S
    sync_period_s: float = 100.0
    # decoupled: stepping seconds between a learner's progress snapshots (health.salvage_every_steps in the
    # engine), held outside the learner; a learner that loses every slice then loses only the work since its
    # last snapshot, and the rest is merged at the loss. 0 = off: the paper's model and the calibration.
    salvage_period_s: float = 0.0
    min_quorum: int = 1
    grace_gamma: float = 0.5
    grace_cap_s: float = 30.0
    tau_steps: float = 5.0
    # One inner step. dp / elastic-dp recover from an intact replica (data parallel keeps the model state on
    # every replica), so a failure loses the step in flight: the work since the last completed step. The
    # grace window (decoupled) uses it too. Not fitted (docs/simulator.md, "Calibration").
    step_time_s: float = 1.0
    sync_time_s: float = 1.0
    step_jitter_sigma: float = 0.0
    # Elastic capacity: mean seconds a capacity slot (one of `learners` shares of the fleet, for every method)
    # stays present, exponential. inf = a fixed pool, always present: the paper's model and the calibration.
    capacity_mean_up_s: float = math.inf
    # Mean seconds a slot stays absent once reclaimed, exponential; > 0 with a finite capacity_mean_up_s, else 0.
    capacity_mean_down_s: float = 0.0
    # A reclaim comes with notice: learners drain (submit their progress) and dp / elastic-dp keep their step, so
    # it loses no work. False: it loses what a failure would (the work since the last durable point).
    capacity_notice: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", self.method, "unknown method", f"use one of {', '.join(METHODS)}")
        for name in ("chips", "learners", "slice_chips", "min_quorum"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be >= 1", "pass a positive integer")
        for name in ("mtbi_chip_years", "horizon_days", "step_time_s", "sync_period_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0", "pass a positive number")
        for name in ("recovery_mean_s", "recovery_sigma", "restart_s", "reconfig_s", "grace_gamma",
                     "grace_cap_s", "tau_steps", "sync_time_s", "step_jitter_sigma"):
            value = getattr(self, name)
            if math.isnan(value) or value < 0 or (math.isinf(value) and name != "grace_cap_s"):
                raise ConfigError(name, value, "must be a finite number >= 0", "pass e.g. 0 or a positive value")
        if math.isnan(self.salvage_period_s) or not 0 <= self.salvage_period_s < math.inf:
            raise ConfigError("salvage_period_s", self.salvage_period_s, "must be a finite number >= 0",
                              "pass 0 (off) or the stepping seconds between a learner's snapshots")
        if self.salvage_period_s > 0 and self.method != "decoupled":
            raise ConfigError("salvage_period_s", self.salvage_period_s, f"salvage applies to decoupled learners, "
                              f"not {self.method}", "pass 0 or use --method decoupled")
        if math.isnan(self.capacity_mean_up_s) or not self.capacity_mean_up_s > 0:
            raise ConfigError("capacity_mean_up_s", self.capacity_mean_up_s, "must be > 0",
                              "pass the mean seconds a slot stays present, or inf for a fixed pool")
        down, elastic = self.capacity_mean_down_s, self.elastic_capacity
        if math.isnan(down) or not 0 <= down < math.inf:
            raise ConfigError("capacity_mean_down_s", down, "must be a finite number >= 0",
                              "pass the mean seconds a slot stays absent, e.g. 3600, or 0 for a fixed pool")
        if elastic and down == 0:
            raise ConfigError("capacity_mean_down_s", down, "must be > 0 when capacity_mean_up_s is finite",
                              "pass the mean seconds a slot stays absent, e.g. 3600")
        if not elastic and down > 0:
            raise ConfigError("capacity_mean_down_s", down, "has no effect with capacity_mean_up_s=inf (a fixed "
                              "pool)", "pass a finite capacity_mean_up_s too, or 0")
        if not isinstance(self.capacity_notice, bool):
            raise ConfigError("capacity_notice", self.capacity_notice, "must be a bool",
                              "pass True (reclaims drain, losing nothing) or False (they lose like failures)")
        n_slices = math.ceil(self.chips / self.slice_chips)
        if (self.method == "decoupled" or elastic) and self.learners > n_slices:
            raise ConfigError("learners", self.learners, f"more learners than the {n_slices} slices of "
                              f"{self.slice_chips} chips", f"use --learners <= {n_slices} or a smaller --slice-chips")
        if self.method == "decoupled" and self.min_quorum > self.learners:
            raise ConfigError("min_quorum", self.min_quorum, f"larger than --learners {self.learners}",
                              "use a quorum between 1 and the number of learners")

    @property
    def horizon_s(self) -> float:
        return self.horizon_days * 86400.0

    @property
    def mtbi_chip_s(self) -> float:
        return self.mtbi_chip_years * interruptions.SECONDS_PER_YEAR

    @property
    def elastic_capacity(self) -> bool:
        """Capacity comes and goes (a finite ``capacity_mean_up_s``); False is a fixed pool."""
        return math.isfinite(self.capacity_mean_up_s)

    @property
    def capacity_up_fraction(self) -> float:
        """Share of the time a slot is present: ``up / (up + down)`` (1 for a fixed pool)."""
        return self.capacity_mean_up_s / (self.capacity_mean_up_s + self.capacity_mean_down_s) if self.elastic_capacity else 1.0


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of one run; ``details`` holds the per-method accounting (all plain numbers/lists)."""

    method: str
    chips: int
    learners: int
    slices: int
    slice_chips: int
    horizon_s: float
    failures: int
    goodput: float
    uptime: float
    productive_chip_s: float
    allocated_chip_s: float  # chip-seconds the run had: chips * horizon, or those present under elastic capacity
    available_fraction: float  # allocated_chip_s / (chips * horizon): 1 for a fixed pool
    seed: int
    details: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def straggler_efficiency(n_slices: int, sigma: float) -> float:
    """``E[X] / E[max(X_1..X_n)]`` for iid ``X ~ LogNormal(0, sigma)``: busy fraction of a
    synchronous group whose step waits for its slowest slice. ``E[max] = int_0^inf 1 - F(x)^n dx``,
    integrated on a log grid (deterministic, no sampling)."""
    if sigma == 0 or n_slices <= 1:
        return 1.0
    z = np.linspace(-8 * sigma, 12 * sigma, 8001)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / (sigma * math.sqrt(2))))
    e_max = math.exp(z[0]) + np.trapezoid((1 - cdf**n_slices) * np.exp(z), z)
    return math.exp(sigma**2 / 2) / e_max


def dp_closed_form(cfg: SimConfig, chips: float | None = None) -> float:
    """Exact goodput of a ``dp`` job of ``chips`` (default ``cfg.chips``), without stragglers.

    Renewal cycle: up for ``U ~ Exp(lambda)``, then a stall of mean ``E[D] = recovery_mean_s +
    restart_s`` that no failure extends. Recovery from an intact replica keeps the completed steps of
    ``s = step_time_s``, ``E[floor(U / s) s] = s / (exp(lambda s) - 1)`` of each up period, so
    ``goodput = (lambda s / (exp(lambda s) - 1)) / (1 + lambda E[D])``.
    """
    lam = (cfg.chips if chips is None else chips) / cfg.mtbi_chip_s
    return _kept_share(lam * cfg.step_time_s) / (1.0 + lam * (cfg.recovery_mean_s + cfg.restart_s))


def _kept_share(x: float) -> float:
    """``E[floor(U / s) s] / E[U]`` for ``U ~ Exp`` of mean ``s / x``: the share of stepping kept by durable
    points every ``s`` when the stepping ends at a memoryless time, ``x / (exp(x) - 1)``."""
    return 1.0 if x == 0 else x / math.expm1(x)


def dp_fit_recovery_mean_s(cfg: SimConfig, goodput: float, chips: float) -> float:
    """The ``recovery_mean_s`` at which :func:`dp_closed_form` gives ``goodput`` at ``chips``, other
    settings as in ``cfg``: the dp half of the calibration, solved exactly instead of bisected on runs
    (``benchmarks/simulate_sweep.py --sensitivity`` redoes it for other step times)."""
    lam = chips / cfg.mtbi_chip_s
    return (_kept_share(lam * cfg.step_time_s) / goodput - 1.0) / lam - cfg.restart_s


def elastic_closed_form(cfg: SimConfig, chips: float | None = None) -> float:
    """Approximate goodput of one elastic group of ``chips`` (default ``cfg.chips``), no stragglers.

    Drops and re-adds are two change streams of ``lambda_g`` each; treated as one Poisson stream of
    ``2 lambda_g``, the paused fraction of a non-extending pause ``P`` is ``2 lambda_g P / (1 + 2
    lambda_g P)``. While stepping, a slice's chips are out for ``E[R]`` per failure, so the live
    share is ``1 - slice_chips E[R] / mtbi_chip_s`` (independent of the group's size). Wipes are
    ignored (a group of many slices never loses all of them).
    """
    lam = (cfg.chips if chips is None else chips) / cfg.mtbi_chip_s
    return _elastic_share(cfg, 2.0 * lam)


def _elastic_share(cfg: SimConfig, changes_per_s: float) -> float:
    live = 1.0 - cfg.slice_chips * cfg.recovery_mean_s / cfg.mtbi_chip_s
    return live / (1.0 + changes_per_s * cfg.reconfig_s)


def capacity_closed_form(cfg: SimConfig) -> float:
    """Goodput over the chip-time present under elastic capacity (= :func:`closed_form_goodput`).

    Slots present a share ``a = up / (up + down)`` of the time, M = ``learners`` of them, periods exponential.
    dp runs while all M are present, ``a^M`` of the time in exponential spells of mean ``up / M``, each begun by a restart
    ``r`` (memoryless: a share ``exp(-M r / up)`` remains), over the ``a`` present: ``a^(M-1) exp(-M r / up)``
    times the fixed pool's form; without notice, times ``kept(M step / up)`` for the step lost per reclaim.
    A decoupled learner rejoins after ``P`` (share ``exp(-P / up)`` of its present time left); without notice it
    loses its work since its last submission, ``kept(sync_period / up)``. Both exact without failures.
    elastic-dp: failures at ``a lambda`` (absent chips do not fail) and ``2 M / (up + down)`` more changes per
    second, as one Poisson stream of pauses (approximate).
    """
    a, up, m = cfg.capacity_up_fraction, cfg.capacity_mean_up_s, cfg.learners
    if cfg.method == "dp":
        lost = 1.0 if cfg.capacity_notice else _kept_share(m * cfg.step_time_s / up)
        return dp_closed_form(cfg) * a ** (m - 1) * math.exp(-m * cfg.restart_s / up) * lost
    if cfg.method == "elastic-dp":
        return _elastic_share(cfg, 2.0 * a * cfg.chips / cfg.mtbi_chip_s + 2.0 * m / (up + cfg.capacity_mean_down_s))
    lost = 1.0 if cfg.capacity_notice else _kept_share(cfg.sync_period_s / up)
    return closed_form_goodput(dataclasses.replace(cfg, capacity_mean_up_s=math.inf, capacity_mean_down_s=0.0)) \
        * math.exp(-cfg.reconfig_s / up) * lost


def closed_form_goodput(cfg: SimConfig) -> float:
    """The closed form for ``cfg.method``: dp exact, elastic-dp approximate, decoupled as M elastic
    groups whose work all merges (K = 1 over a long horizon), weighted by their chips; under elastic
    capacity, :func:`capacity_closed_form`."""
    if cfg.elastic_capacity:
        return capacity_closed_form(cfg)
    if cfg.method == "dp":
        return dp_closed_form(cfg)
    if cfg.method == "elastic-dp":
        return elastic_closed_form(cfg)
    sizes = interruptions.slice_sizes(chips=cfg.chips, slice_chips=cfg.slice_chips)
    chips = np.array([sizes[g].sum() for g in np.array_split(np.arange(len(sizes)), cfg.learners)], float)
    return float(sum(c * elastic_closed_form(cfg, c) for c in chips) / chips.sum())


def quorum_met(stepping_learners: np.ndarray, min_quorum: int) -> np.ndarray:
    """Vectorized quorum rule: the global model advances while >= K learners are contributing
    (the condition under which :func:`policies.quorum.decide_round` can close a round)."""
    return np.asarray(stepping_learners) >= min_quorum


def _count_over_time(groups_edges, groups_state, horizon_s):
    """Number of groups whose ``state`` holds, as ``(edges, count)`` over the union of their edges."""
    times, deltas = [np.array([0.0, horizon_s])], [np.zeros(2)]
    for edges, state in zip(groups_edges, groups_state):
        d = np.diff(np.r_[0, state.astype(np.int64), 0])
        nz = np.flatnonzero(d[:-1])  # transitions at edges[0..n-1]; the final fall at T is implied
        times.append(edges[nz])
        deltas.append(d[nz].astype(np.float64))
    t, d = np.concatenate(times), np.concatenate(deltas)
    order = np.argsort(t, kind="stable")
    return np.r_[t[order], horizon_s], np.cumsum(d[order])


def run_rounds(sub_t, sub_learner, sub_chip_s, *, live_at, min_quorum, grace_s, horizon_s):
    """Outer optimizer rounds over submissions sorted by time, closed by ``decide_round``.

    A round merges every pending submission; pending counts distinct learners (a learner id of
    ``SALVAGED`` marks a salvaged submission: merged with the round, counted toward no quorum).
    ``live_at(t)`` gives the live learners. At the horizon the last round closes without grace if it
    has quorum.
    Returns ``(merged_chip_s, merge_times)``.
    """
    merged, merge_times = 0.0, []
    pending: dict[int, float] = {}
    reached, deadline = None, math.inf

    def close(at):
        nonlocal merged, reached, deadline
        merged += sum(pending.values())
        merge_times.append(at)
        pending.clear()
        reached, deadline = None, math.inf

    def voters() -> int:  # distinct learners pending; salvaged submissions vote in no quorum
        return len(pending) - (SALVAGED in pending)

    lives = live_at(sub_t)
    for t, m, c, live in zip(sub_t.tolist(), sub_learner.tolist(), sub_chip_s.tolist(), lives.tolist()):
        if deadline <= t:
            close(deadline)
        pending[m] = pending.get(m, 0.0) + c
        if reached is None and voters() >= min_quorum:
            reached = t
        d = decide_round(now=t, pending=voters(), min_quorum=min_quorum, live_islands=live,
                         quorum_reached_at=reached, grace_s=grace_s)
        if d.close:
            close(t)
        elif reached is not None:
            deadline = t + d.wait_s
    if voters() >= min_quorum:  # the run's final round: close now, or at a grace deadline before T
        close(min(deadline, horizon_s))
    return merged, np.asarray(merge_times)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Slot ``m`` holds slices ``slots[m]`` (decoupled's learner m) and is absent on ``[starts[m][i], ends[m][i])``,
    ends clipped to the horizon. A fixed pool has no absences."""

    slots: list[np.ndarray]
    starts: list[np.ndarray]
    ends: list[np.ndarray]

    def absent_s(self, m: int) -> float:
        return float((self.ends[m] - self.starts[m]).sum())


def draw_capacity(cfg: SimConfig, n_slices: int) -> Capacity:
    """Each slot alternates ``Exp(capacity_mean_up_s)`` present and ``Exp(capacity_mean_down_s)`` absent periods,
    started in its stationary state (absent at 0 with probability ``down / (up + down)``; exponential periods are
    memoryless, so the first needs no correction). Its own random stream: the failures are the fixed pool's."""
    slots = np.array_split(np.arange(n_slices), cfg.learners)
    if not cfg.elastic_capacity:
        return Capacity(slots, [np.zeros(0)] * len(slots), [np.zeros(0)] * len(slots))
    rng = np.random.default_rng([cfg.seed, 1])
    up, down, T = cfg.capacity_mean_up_s, cfg.capacity_mean_down_s, cfg.horizon_s
    n = int(T / (up + down)) + 8  # cycles per draw, drawn again until the horizon is covered
    starts, ends = [], []
    for _ in slots:
        absent_first = bool(rng.random() < down / (up + down))
        means = (down, up) if absent_first else (up, down)
        chunks, total = [], 0.0
        while total < T:
            first, second = rng.exponential(means[0], n), rng.exponential(means[1], n)
            chunks.append(np.column_stack((first, second)).ravel())
            total += float(chunks[-1].sum())
        b = np.r_[0.0, np.cumsum(np.concatenate(chunks))]  # period k is [b[k], b[k + 1])
        a0, a1 = (b[0:-1:2], b[1::2]) if absent_first else (b[1:-1:2], b[2::2])
        keep = a0 < T
        starts.append(a0[keep])
        ends.append(np.minimum(a1[keep], T))
    return Capacity(slots, starts, ends)


def _draw(cfg: SimConfig):
    """All slice interruptions of the horizon (sizes, times, slices, recoveries; absorbed ones dropped) and the
    capacity. A failure of an absent slot's chips does not happen; a recovery ends when its slot is reclaimed
    (the capacity comes back healthy)."""
    rng = np.random.default_rng(cfg.seed)
    sizes = interruptions.slice_sizes(chips=cfg.chips, slice_chips=cfg.slice_chips)
    t, s = interruptions.draw_interruptions(sizes=sizes, mtbi_chip_s=cfg.mtbi_chip_s,
                                            horizon_s=cfg.horizon_s, rng=rng)
    r = interruptions.draw_recoveries(len(t), mean_s=cfg.recovery_mean_s, sigma=cfg.recovery_sigma, rng=rng)
    cap = draw_capacity(cfg, len(sizes))
    if cfg.elastic_capacity:
        slot = np.repeat(np.arange(len(cap.slots)), [len(g) for g in cap.slots])[s]
        present = np.ones(len(t), dtype=bool)
        for m, (a0, a1) in enumerate(zip(cap.starts, cap.ends)):
            idx = np.flatnonzero(slot == m)
            j = np.searchsorted(a0, t[idx], side="right") - 1
            present[idx] = t[idx] >= np.r_[a1, -np.inf][j]  # j = -1 (before any absence) reads the sentinel
            r[idx] = np.minimum(r[idx], np.r_[a0, np.inf][j + 1] - t[idx])
        t, s, r = t[present], s[present], r[present]
    keep = interruptions.absorb_while_down(t, s, r)
    return sizes, t[keep], s[keep], r[keep], cap


def _drained(tl, reclaims, notice: bool):
    """With notice a reclaim loses no work: its wipes are dropped, so the epoch's progress carries on."""
    if not notice or len(tl.wipes) == 0:
        return tl
    return dataclasses.replace(tl, wipes=tl.wipes[~np.isin(tl.edges[tl.wipes], reclaims)])


def _union(starts, rec, restart_s):
    """Union of stalls ``[start, start + rec + restart_s)``, as ``(starts, rec)``; a stall that overlaps no other
    keeps its own values (so that without absences dp's timeline is the fixed pool's, bit for bit)."""
    if len(starts) == 0:
        return starts, rec
    o = np.argsort(starts, kind="stable")
    starts, rec = starts[o], rec[o]
    ends = starts + rec + restart_s
    first = np.flatnonzero(np.r_[True, starts[1:] >= np.maximum.accumulate(ends)[:-1]])
    alone = np.diff(np.r_[first, len(starts)]) == 1
    return starts[first], np.where(alone, rec[first], np.maximum.reduceat(ends, first) - starts[first] - restart_s)


def _dp_timeline(cfg, t, r, cap, chips):
    """dp, a fixed-size synchronous job: stopped from any slot's reclaim until every slot is back and it has
    restarted; failures stall it as on a fixed pool, and one during a capacity stop is absorbed by it."""
    T, restart = cfg.horizon_s, cfg.restart_s
    if not cfg.elastic_capacity:
        return interruptions.stall_timeline(t, r, chips=chips, restart_s=restart, horizon_s=T)
    a0, a1 = np.concatenate(cap.starts), np.concatenate(cap.ends)
    b0, b_rec = _union(a0, a1 - a0, restart)
    j = np.searchsorted(b0, t, side="right") - 1
    inside = (j >= 0) & (t < np.r_[b0 + b_rec + restart, -np.inf][j])  # j = -1 reads the sentinel
    t, r = t[~inside], r[~inside]
    k = interruptions.pause_starts(t, r + restart)
    s0, s_rec = _union(np.r_[b0, t[k]], np.r_[b_rec, r[k]], restart)
    tl = interruptions.stall_timeline(s0, s_rec, chips=chips, restart_s=restart, horizon_s=T)
    return _drained(tl, a0, cfg.capacity_notice)


def _single_group(cfg, sizes, t, s, r, cap) -> tuple[float, float, dict]:
    """dp and elastic-dp: one group of every slice; productive chip-s, uptime and details."""
    T, chips = cfg.horizon_s, int(sizes.sum())
    if cfg.method == "dp":
        tl = _dp_timeline(cfg, t, r, cap, chips)
    else:  # a reclaimed slot's slices are out like failed ones; a drop and a re-add are reconfigurations
        slot_chips = [np.full(len(a0), float(sizes[g].sum())) for g, a0 in zip(cap.slots, cap.starts)]
        a0, a1 = np.concatenate(cap.starts), np.concatenate(cap.ends)
        tl = interruptions.elastic_timeline(np.r_[t, a0], np.r_[r, a1 - a0], np.concatenate([sizes[s], *slot_chips]),
                                            chips=chips, reconfig_s=cfg.reconfig_s, horizon_s=T)
        tl = _drained(tl, a0, cfg.capacity_notice)
    _, chip_s = interruptions.durable_points(tl, cfg.step_time_s)  # completed steps survive a failure
    eff = straggler_efficiency(len(sizes), cfg.step_jitter_sigma)
    productive = float(chip_s.sum()) * eff
    details = {
        "blocked_s": float(T - tl.S[-1]),
        "rollback_lost_chip_s": float(tl.Q[-1] - chip_s.sum()),
        "wipes": int(len(tl.wipes)),
        "straggler_efficiency": eff,
        "failure_rate_per_s": chips / cfg.mtbi_chip_s,
    }
    details["closed_form_goodput"] = closed_form_goodput(cfg)
    if cfg.method != "dp":
        step = np.diff(tl.edges) * tl.stepping
        details["mean_live_fraction_when_stepping"] = float((step * tl.live).sum() / max(step.sum(), 1e-300) / chips)
    return productive, interruptions.kept_stepping_s(tl, cfg.step_time_s) / T, details


def _decoupled(cfg, sizes, t, s, r, cap) -> tuple[float, float, dict]:
    """M elastic learners; their submissions reach the global model through quorum rounds. A learner is out
    while its capacity slot is, and rejoins with a reconfiguration."""
    T, M = cfg.horizon_s, cfg.learners
    groups = cap.slots  # contiguous slices per learner
    learner_of_slice = np.repeat(np.arange(M), [len(g) for g in groups])
    ev_learner = learner_of_slice[s]
    order = np.argsort(ev_learner, kind="stable")  # stays time-sorted within each learner
    bounds = np.searchsorted(ev_learner[order], np.arange(M + 1))
    timelines, subs, salvaged = [], [], []
    for m, g in enumerate(groups):
        idx = order[bounds[m]:bounds[m + 1]]
        a0, a1, c_m = cap.starts[m], cap.ends[m], float(sizes[g].sum())
        tl = interruptions.elastic_timeline(np.r_[t[idx], a0], np.r_[r[idx], a1 - a0], np.r_[sizes[s[idx]], np.full(len(a0), c_m)],
                                            chips=int(c_m), reconfig_s=cfg.reconfig_s, horizon_s=T)
        tl = _drained(tl, a0, cfg.capacity_notice)
        eff = straggler_efficiency(len(g), cfg.step_jitter_sigma)
        sub_t, chip_s = interruptions.durable_points(tl, cfg.sync_period_s)
        who = np.full(len(sub_t), m)
        if cfg.salvage_period_s > 0:
            # Merged when the learner is lost; like the engine's, they do not count toward a round's quorum.
            salv_t, salv_c = interruptions.salvage_points(tl, cfg.sync_period_s, cfg.salvage_period_s)
            salvaged.append(salv_c * eff)
            sub_t, chip_s, who = np.r_[sub_t, salv_t], np.r_[chip_s, salv_c], np.r_[who, np.full(len(salv_t), SALVAGED)]
        chip_s = chip_s * eff
        timelines.append(tl)
        subs.append((sub_t, who, chip_s))
    sub_t, sub_m, sub_c = (np.concatenate(a) for a in zip(*subs))
    order = np.argsort(sub_t, kind="stable")

    alive_edges, alive = _count_over_time([tl.edges for tl in timelines], [tl.live > 0 for tl in timelines], T)
    grace = grace_window_s(gamma=cfg.grace_gamma, tau_steps=cfg.tau_steps, step_time_s=cfg.step_time_s,
                           quorum_time_s=0.0, sync_time_s=cfg.sync_time_s, cap_s=cfg.grace_cap_s)

    def live_at(x):
        return alive[np.clip(np.searchsorted(alive_edges, x, side="right") - 1, 0, len(alive) - 1)].astype(int)

    merged, merge_times = run_rounds(sub_t[order], sub_m[order], sub_c[order], live_at=live_at,
                                     min_quorum=cfg.min_quorum, grace_s=grace, horizon_s=T)
    step_edges, stepping = _count_over_time([tl.edges for tl in timelines], [tl.stepping for tl in timelines], T)
    uptime = float((np.diff(step_edges) * quorum_met(stepping, cfg.min_quorum)).sum() / T)
    gaps = np.diff(np.r_[0.0, merge_times, T])
    allocated = [float(sizes[g].sum()) * (T - cap.absent_s(m)) for m, g in enumerate(groups)]
    per_learner = [float(c.sum()) / max(a, 1e-300) for (_, _, c), a in zip(subs, allocated)]
    details = {
        "rounds": int(len(merge_times)),
        "submissions": int(len(sub_t)),
        "grace_s": grace,
        "min_quorum": cfg.min_quorum,
        "max_merge_gap_s": float(gaps.max()),
        "unmerged_chip_s": max(float(sub_c.sum() - merged), 0.0),  # clip summation round-off
        "wipes": int(sum(len(tl.wipes) for tl in timelines)),
        "salvages": int(sum(len(c) for c in salvaged)),
        "salvaged_chip_s": float(sum(c.sum() for c in salvaged)),
        "straggler_efficiency": straggler_efficiency(len(groups[0]), cfg.step_jitter_sigma),
        "per_learner_goodput_before_merge": per_learner,
        "closed_form_goodput": closed_form_goodput(cfg),
    }
    return merged, uptime, details


def simulate(cfg: SimConfig) -> SimResult:
    """Simulate one job (see the module docstring for the model) and return its goodput over the chip-time it had."""
    sizes, t, s, r, cap = _draw(cfg)
    run = _decoupled if cfg.method == "decoupled" else _single_group
    productive, uptime, details = run(cfg, sizes, t, s, r, cap)
    present = sum(float(sizes[g].sum()) * (cfg.horizon_s - cap.absent_s(m)) for m, g in enumerate(cap.slots))
    allocated = present if cfg.elastic_capacity else float(cfg.chips) * cfg.horizon_s
    if cfg.elastic_capacity:
        details["capacity"] = {"slots": len(cap.slots), "reclaims": int(sum(len(a) for a in cap.starts)),
                               "up_fraction": cfg.capacity_up_fraction, "notice": cfg.capacity_notice}
    result = SimResult(
        method=cfg.method, chips=cfg.chips, learners=cfg.learners if cfg.method == "decoupled" else 1,
        slices=len(sizes), slice_chips=cfg.slice_chips, horizon_s=cfg.horizon_s, failures=len(t),
        goodput=productive / allocated, uptime=uptime, productive_chip_s=productive, allocated_chip_s=allocated,
        available_fraction=allocated / (float(cfg.chips) * cfg.horizon_s), seed=cfg.seed, details=details,
    )
    log.info("simulate %s chips=%d learners=%d failures=%d available=%.4f: goodput=%.4f uptime=%.4f", result.method,
             result.chips, result.learners, result.failures, result.available_fraction, result.goodput, result.uptime)
    return result
