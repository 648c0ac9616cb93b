"""The outer optimizer's settings as plain values: no torch, no Ray, no defaults.

Every field is declared once, in the config (orchestrator/config.py, `outer:`, `run:` and `checkpoint:`);
these classes only carry the values. orchestrator/settings.py builds them from a RunConfig (`outer_settings`,
`outer_checkpoints`), so a field here never has a default of its own that could drift from the config's
(tests/engine/test_settings_once.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OuterSettings:
    """Outer-optimizer hyperparameters as plain values (built from RunConfig by orchestrator.settings)."""

    min_quorum: int  # K as a number ('all' resolved)
    grace_gamma: float
    grace_cap_s: float
    tau_steps: float  # outer.tau_steps, or H/P when unset
    tau_schedule: tuple[tuple[float, float], ...]  # (until progress, tau) pairs; tau_steps after the last
    weighting: str
    staleness_discount: float
    merge_rule: str
    lr: float
    momentum: float
    partial_momentum: float | None  # momentum of the clock rule's partial rounds; None = momentum
    optimizer: Any  # None: the built-in Nesterov SGD; else a factory params -> torch.optim.Optimizer or its import path
    max_staleness: int
    compression: str
    step_scale: str
    rda_across_rounds: bool  # lengthen partial rounds' outer gradients as RDA would over a full round
    downlink: str  # wire format of published fragments (the actor shell applies it)
    downlink_delta: str | None  # format of later versions as differences from an island's copy, or None
    publish_to: str  # all | participants: which islands a new version goes to (the actor shell sends it)
    compression_block_size: int  # elements per quantization scale block, both directions
    topk_density: float  # fraction of each chunk a topk difference keeps (downlink_delta topk)
    average_window: float | None  # served model: moving average over this fraction of merged tokens (None = raw)
    torch_threads: int  # torch intra-op threads of the actor's core thread
    elastic_slots: frozenset[int]  # island slots of elastic pools: K counts only those holding an island (quorum.py)
    fixed_slots: int  # island slots of fixed pools
    poison_guard: bool  # refuse finite, well-shaped outliers against the other islands' (policies/poison_guard.py)
    poison_restart_after: int  # restart an incarnation after this many poison refusals in a row (0: never)


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often the outer optimizer's actor saves its state (built from RunConfig by orchestrator.settings).

    `uri`: the run's checkpoint store (checkpoint.uri resolved against the run directory); `every_s`: seconds
    between two saves (checkpoint.every_s); `keep`: how many checkpoints the store retains (checkpoint.keep)."""

    uri: str
    every_s: float
    keep: int
