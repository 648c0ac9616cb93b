"""The plain values that define a model, an island's inner loop and an island slot: no torch here.

The control plane (the health monitor, the CLI, the config) handles these values without training
anything; keeping them in a module that does not import torch keeps those processes light (a Ray
worker that imports torch costs ~3 s of CPU to start on a 2-core machine). The modules that train
(islands.model, islands.trainer, islands.island) re-export them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from islands.cursor import DataCursor
from policies.fragments import FragmentPlan


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`ByteTransformer`. Frozen so one config can be shared by all islands."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    seq_len: int = 128
    """Context length in tokens: the largest T ``forward`` accepts (size of the position table)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"ModelConfig.{f.name}={value!r} must be a positive int; pass e.g. "
                    f"{f.name}={f.default}"
                )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig d_model={self.d_model} must be divisible by n_heads={self.n_heads}; "
                f"pick n_heads among the divisors of d_model"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_heads``)."""
        return self.d_model // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # Unit tests: builds and steps in milliseconds.
    "nano": ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2),
    # Default: about 0.48M parameters, trains at a useful rate on 2 CPU cores.
    "tiny": ModelConfig(seq_len=128, d_model=128, n_layers=2, n_heads=4),
    # About 3.4M parameters: a bigger CPU run or a small GPU run.
    "small": ModelConfig(seq_len=256, d_model=256, n_layers=4, n_heads=8),
    # About 50.9M parameters: the GPU-sized model.
    "50m": ModelConfig(seq_len=512, d_model=512, n_layers=16, n_heads=8),
}
"""Named model shapes. Read-only by convention: derive variants with :func:`model_config`."""


def model_config(preset: str, **overrides: int) -> ModelConfig:
    """Return preset ``preset`` with any fields in ``overrides`` replaced, validated again.

    Example: ``model_config("tiny", seq_len=256)``.
    """
    if preset not in PRESETS:
        raise ValueError(
            f"unknown model preset {preset!r}; valid presets are {sorted(PRESETS)}"
        )
    return dataclasses.replace(PRESETS[preset], **overrides)


@dataclass(frozen=True)
class ModelRecipe:
    """How every process of a run builds its model, loss and inner optimizer: the user's, or the built-in one.

    Each part is a callable (Ray pickles it into the island processes; one defined in a notebook travels
    by value) or an import path ``"package.module:function"``, which a restarted island, a resumed run
    and a Ray Job resolve without the process that started the run. islands.model_api resolves them
    where torch is imported; this module stays torch-free. No defaults: orchestrator.settings builds
    the recipe from the config, and the public API (orchestrator.api) from its arguments.
    """

    model: Any  # zero-argument factory returning a torch.nn.Module (built-in: islands.builtin.ByteTransformerFactory)
    loss: Any  # None: islands.model_api.default_loss; else loss(model, batch) -> scalar tensor
    optimizer: Any  # None: AdamW from InnerSettings; else optimizer(parameters) -> torch.optim.Optimizer
    seed: int  # torch's RNG is seeded with this before the factory runs: the same model in every process
    seq_len: int  # tokens per training window when the data is a token stream (config model.seq_len)

    @property
    def name(self) -> str:
        """How logs and messages name the model: its import path, or the factory's qualified name."""
        if isinstance(self.model, str):
            return self.model
        name: str | None = getattr(self.model, "name", None)
        if name:
            return name
        return getattr(self.model, "__qualname__", type(self.model).__name__)


@dataclass(frozen=True)
class InnerSettings:
    """Inner optimizer and pacing of one island, as plain values.

    No defaults: every field is declared once, in the config (`inner:`, `data.batch_size` and the pool's
    emulation), and orchestrator.settings.inner_settings builds this from it.
    """

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    warmup_steps: int
    lr_schedule: str  # policies.lr_schedule.LR_SCHEDULES; decay follows the run's global progress
    lr_final_ratio: float  # cosine: the rate at the token budget, as a fraction of lr
    grad_clip: float | None
    torch_threads: int  # applied to the whole process by the island's actor shell, not here
    precision: str  # fp32 | tf32 (GPU matmuls) | bf16 (autocast forward); weights and AdamW stay fp32
    batch_size: int
    emulated_slowdown: float  # EMULATION: stretch each step to this multiple of its compute time
    emulated_jitter: float  # EMULATION: uniform +- fraction on the stretch


@dataclass(frozen=True)
class IslandSpec:
    """Everything that defines one island slot and incarnation, as plain values.

    No defaults: the settings come from the config (orchestrator.settings.island_specs builds every
    slot's spec), the rest (slot, incarnation, keeper) from the run.
    """

    island: int
    incarnation: int
    pool: str
    num_islands: int  # number of data shards; the island reads shard `island`
    model: ModelRecipe
    plan: FragmentPlan
    inner: InnerSettings
    sync_every_steps: int  # H
    sync_every_schedule: tuple[tuple[float, int], ...]  # (until progress, H) pairs before H (policies/sync_schedule.py)
    adoption: str
    compression: str
    compression_block_size: int
    topk_density: float  # fraction of each chunk a topk outer gradient keeps
    feedback_decay: float  # int2, sign, topk: decay of the error-feedback accumulator (policies/error_feedback.py)
    wait_for_round: bool  # synchronous DiLoCo: block until every in-flight submission resolves
    seed: int
    workers: int  # workers in this island (rank 0 is this LearnerIsland)
    shard: str  # 'none': every worker holds the whole model (data parallel); 'fsdp': each holds 1/workers (islands/fsdp.py)
    accelerator: str  # 'cpu' trains on CPU with gloo; anything else on the worker's GPU with NCCL
    salvage_every_steps: int  # leave unsubmitted progress with the keeper every n steps (0: never)
    keeper: tuple[str, str] | None  # (namespace, actor name) of the pool's progress keeper; None: no keeper


@dataclass
class IslandStatus:
    """A snapshot of one island for heartbeats, progress and token accounting."""

    island: int
    incarnation: int
    pool: str
    state: str  # one of policies/island_states.py REPORTED (an IslandState)
    steps: int
    tokens: int
    train_loss: float | None
    step_time_s: float | None
    versions: list[int]  # fragment versions this island has adopted
    unsubmitted_tokens: list[int]  # per fragment: tokens not yet cut into a submission
    outbox_tokens: list[int]  # per fragment: submitted, not yet taken by the outer optimizer
    inflight: int  # submissions taken by the outer, not yet merged or refused
    cursor: DataCursor  # where the island's data stands: batches drawn, and the block's unit and token
    skipped_units: dict[str, int] = field(default_factory=dict)  # units skipped as unreadable: "name/epoch" -> est. tokens
    data_root: str | None = None  # the corpus copy this island reads (None: data handed over whole, not streamed)
    data_read_bytes: int = 0  # token ids this incarnation has read from its units (after tokenizing)
    submitted_tokens: list[int] = field(default_factory=list)  # per fragment: cut into submissions (incl. dropped)
    discarded_tokens: list[int] = field(default_factory=list)  # per fragment: never submitted, dropped by a resync
    overwritten_tokens: list[int] = field(default_factory=list)  # per fragment: progress replaced by an overwrite adoption
    blocked_s: float = 0.0  # time spent waiting for rounds (synchronous modes)
    faults: int = 0  # faults injected into this incarnation
    shelve_s: float = 0.0  # inner-loop time spent taking progress snapshots (pickling and sending run beside it)
    shelved_bytes: int = 0  # bytes of those snapshots (in-pool traffic, not over the WAN)
    epochs: list[int] = field(default_factory=list)  # per fragment: outer-optimizer epoch that sent the version held
    lr: float | None = None  # the inner learning rate of the next step (policies/lr_schedule.py)
    device: str = "cpu"  # where the island's leader computes, e.g. 'cpu' or 'cuda:0 (NVIDIA H200)'
    error: str | None = None
    at: float = field(default_factory=time.time)
