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

Goodput = productive chip-time / allocated chip-time (``chips * horizon_s``), where productive means
the work reached the final model. Uptime = fraction of wall time in which the global model advances:
the kept stepping time of the group (dp, elastic-dp), the time with at least K learners stepping
(decoupled). No Ray here; time and the seed are arguments.
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
        n_slices = math.ceil(self.chips / self.slice_chips)
        if self.method == "decoupled" and self.learners > n_slices:
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
    allocated_chip_s: float
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
    x = lam * cfg.step_time_s
    kept = 1.0 if x == 0 else x / math.expm1(x)
    return kept / (1.0 + lam * (cfg.recovery_mean_s + cfg.restart_s))


def dp_fit_recovery_mean_s(cfg: SimConfig, goodput: float, chips: float) -> float:
    """The ``recovery_mean_s`` at which :func:`dp_closed_form` gives ``goodput`` at ``chips``, other
    settings as in ``cfg``: the dp half of the calibration, solved exactly instead of bisected on runs
    (``benchmarks/simulate_sweep.py --sensitivity`` redoes it for other step times)."""
    lam = chips / cfg.mtbi_chip_s
    x = lam * cfg.step_time_s
    kept = 1.0 if x == 0 else x / math.expm1(x)
    return (kept / goodput - 1.0) / lam - cfg.restart_s


def elastic_closed_form(cfg: SimConfig, chips: float | None = None) -> float:
    """Approximate goodput of one elastic group of ``chips`` (default ``cfg.chips``), no stragglers.

    Drops and re-adds are two change streams of ``lambda_g`` each; treated as one Poisson stream of
    ``2 lambda_g``, the paused fraction of a non-extending pause ``P`` is ``2 lambda_g P / (1 + 2
    lambda_g P)``. While stepping, a slice's chips are out for ``E[R]`` per failure, so the live
    share is ``1 - slice_chips E[R] / mtbi_chip_s`` (independent of the group's size). Wipes are
    ignored (a group of many slices never loses all of them).
    """
    lam = (cfg.chips if chips is None else chips) / cfg.mtbi_chip_s
    live = 1.0 - cfg.slice_chips * cfg.recovery_mean_s / cfg.mtbi_chip_s
    return live / (1.0 + 2.0 * lam * cfg.reconfig_s)


def closed_form_goodput(cfg: SimConfig) -> float:
    """The closed form for ``cfg.method``: dp exact, elastic-dp approximate, decoupled as M elastic
    groups whose work all merges (K = 1 over a long horizon), weighted by their chips."""
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


def _draw(cfg: SimConfig):
    """All slice interruptions of the horizon: sizes, times, slices, recoveries (absorbed ones dropped)."""
    rng = np.random.default_rng(cfg.seed)
    sizes = interruptions.slice_sizes(chips=cfg.chips, slice_chips=cfg.slice_chips)
    t, s = interruptions.draw_interruptions(sizes=sizes, mtbi_chip_s=cfg.mtbi_chip_s,
                                            horizon_s=cfg.horizon_s, rng=rng)
    r = interruptions.draw_recoveries(len(t), mean_s=cfg.recovery_mean_s, sigma=cfg.recovery_sigma, rng=rng)
    keep = interruptions.absorb_while_down(t, s, r)
    return sizes, t[keep], s[keep], r[keep]


def _single_group(cfg, sizes, t, s, r) -> tuple[float, float, dict]:
    """dp and elastic-dp: one group of every slice; productive chip-s, uptime and details."""
    T, chips = cfg.horizon_s, int(sizes.sum())
    if cfg.method == "dp":
        tl = interruptions.stall_timeline(t, r, chips=chips, restart_s=cfg.restart_s, horizon_s=T)
    else:
        tl = interruptions.elastic_timeline(t, r, sizes[s], chips=chips, reconfig_s=cfg.reconfig_s, horizon_s=T)
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


def _decoupled(cfg, sizes, t, s, r) -> tuple[float, float, dict]:
    """M elastic learners; their submissions reach the global model through quorum rounds."""
    T, M = cfg.horizon_s, cfg.learners
    groups = np.array_split(np.arange(len(sizes)), M)  # contiguous slices per learner
    learner_of_slice = np.repeat(np.arange(M), [len(g) for g in groups])
    ev_learner = learner_of_slice[s]
    order = np.argsort(ev_learner, kind="stable")  # stays time-sorted within each learner
    bounds = np.searchsorted(ev_learner[order], np.arange(M + 1))
    timelines, subs, salvaged = [], [], []
    for m, g in enumerate(groups):
        idx = order[bounds[m]:bounds[m + 1]]
        tl = interruptions.elastic_timeline(t[idx], r[idx], sizes[s[idx]], chips=int(sizes[g].sum()),
                              reconfig_s=cfg.reconfig_s, horizon_s=T)
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
    allocated = [float(sizes[g].sum()) * T for g in groups]
    per_learner = [float(c.sum()) / a for (_, _, c), a in zip(subs, allocated)]
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
    """Simulate one job (see the module docstring for the model) and return its goodput."""
    sizes, t, s, r = _draw(cfg)
    run = _decoupled if cfg.method == "decoupled" else _single_group
    productive, uptime, details = run(cfg, sizes, t, s, r)
    allocated = float(cfg.chips) * cfg.horizon_s
    result = SimResult(
        method=cfg.method, chips=cfg.chips, learners=cfg.learners if cfg.method == "decoupled" else 1,
        slices=len(sizes), slice_chips=cfg.slice_chips, horizon_s=cfg.horizon_s, failures=len(t),
        goodput=productive / allocated, uptime=uptime, productive_chip_s=productive,
        allocated_chip_s=allocated, seed=cfg.seed, details=details,
    )
    log.info("simulate %s chips=%d learners=%d failures=%d: goodput=%.4f uptime=%.4f", result.method,
             result.chips, result.learners, result.failures, result.goodput, result.uptime)
    return result
