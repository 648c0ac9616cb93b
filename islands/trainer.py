"""The inner loop of one island: AdamW steps on its own shard, with optional speed emulation.

Kept apart from the island's synchronization bookkeeping (islands/island.py) so it can be benchmarked
against a bare PyTorch loop with the same model, batch and threads (benchmarks/island_overhead.py).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from islands.data import ShardSampler
from islands.model import ModelConfig, build_model
from islands.model_api import LossFn, default_loss
from islands.spec import InnerSettings  # noqa: F401 - re-exported: the settings live in islands.spec
from policies.lr_schedule import lr_factor

if TYPE_CHECKING:
    from islands.distributed import WorkerGroup


PRECISIONS = ("fp32", "tf32", "bf16")
"""Inner-step arithmetic modes (config field inner.precision)."""


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    # torch's TF32 switches are process-wide: set them for this step only, so nothing else in the
    # process (evaluation, another trainer in a test) inherits them.
    if not enabled:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, precision: str = "fp32",
                     loss_fn: LossFn = default_loss) -> torch.Tensor:
    """The batch's loss `loss_fn(model, (x, y))`, with its gradients accumulated into the (fp32) parameters, in `precision`.

    'fp32': plain. 'tf32': GPU matmuls in TF32 (no effect on CPU). 'bf16': the forward pass under
    bfloat16 autocast, except the output head and the loss, which stay fp32 (islands/model.py);
    backward follows the forward's dtypes, and gradients land in the fp32 parameters. Islands and
    the data-parallel baseline both step through here, so a comparison runs both in one arithmetic.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; use one of {', '.join(PRECISIONS)}")
    with _tf32(precision == "tf32" and x.device.type == "cuda"):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model, (x, y))
        loss.backward()
    return loss


@dataclass(frozen=True)
class StepResult:
    """What one inner step did."""

    loss: float  # mean cross-entropy of the batch, nats per token
    tokens: int
    compute_s: float  # forward + backward + optimizer step
    wall_s: float  # compute plus emulated slowdown


class InnerTrainer:
    """A model replica, its AdamW inner optimizer and its data shard sampler.

    The model is built from `seed` only to get its shapes; the island overwrites every parameter with
    the global ones before the first step.

    With a `group` (islands/distributed.py) this is one worker of a data-parallel island: island step
    c reads batch `c * W + rank` of the shard, gradients are averaged over the W workers before the
    clip and the AdamW step, and a step counts the tokens of all W batches. The sampler's cursor
    still counts island steps, so resuming from a cursor works as with one worker.

    `loss_fn(model, (x, y))` is the loss it steps on (islands/model_api.py; default: cross-entropy).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        data: np.ndarray,
        *,
        settings: InnerSettings,
        shard_index: int,
        num_shards: int,
        seed: int,
        group: WorkerGroup | None = None,
        device: torch.device | str = "cpu",
        loss_fn: LossFn = default_loss,
    ) -> None:
        self.settings = settings
        self.loss_fn = loss_fn
        self.group = group
        self.world = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        self.device = torch.device(device)
        self.model = build_model(model_config, seed=seed)
        if self.device.type != "cpu":
            self.model.to(self.device)  # before the optimizer is built, so its state lives there too
        self.params: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.lr,
            betas=(settings.beta1, settings.beta2),
            weight_decay=settings.weight_decay,
        )
        self.sampler = ShardSampler(
            data,
            shard_index=shard_index,
            num_shards=num_shards,
            seq_len=model_config.seq_len,
            batch_size=settings.batch_size,
            seed=seed,
        )
        # Jitter draws are seeded per island so an emulated run replays the same pacing.
        self._jitter_rng = random.Random(seed * 1_000_003 + shard_index)
        self.steps = 0
        # The run's tokens processed / token budget, as last heard (islands: from published fragments;
        # followers: from their leader). Only a decaying lr schedule reads it.
        self.progress = 0.0

    def lr_at(self, step: int) -> float:
        """The learning rate of inner step `step` at the run progress this trainer was last told (`progress`)."""
        s = self.settings
        return s.lr * lr_factor(s.lr_schedule, step=step, warmup_steps=s.warmup_steps, progress=self.progress,
                                final_ratio=s.lr_final_ratio)

    def step(self) -> StepResult:
        """Run one AdamW step on the next batch of this island's shard, then the emulated slowdown."""
        t0 = time.perf_counter()
        x, y = self.next_batch()  # [B, T], [B, T]
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.steps)
        loss = forward_backward(self.model, x, y, precision=self.settings.precision, loss_fn=self.loss_fn)
        mean_loss = loss.detach()
        if self.group is not None:  # every worker now holds the island's mean gradient (and loss)
            mean_loss = self.group.average_gradients(self.model.parameters(), mean_loss)
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Reading the loss waits for the step: on a GPU the calls above only queue kernels, so timing
        # before it would report launch time as compute (and stretch emulated slowdowns by too little).
        value = float(mean_loss)
        compute = time.perf_counter() - t0
        self.steps += 1
        stretch = self.settings.emulated_slowdown
        if self.settings.emulated_jitter > 0:
            stretch *= 1.0 + self._jitter_rng.uniform(-1.0, 1.0) * self.settings.emulated_jitter
        if stretch > 1.0:
            time.sleep(compute * (stretch - 1.0))
        return StepResult(
            loss=value if math.isfinite(value) else math.nan,
            tokens=int(x.numel()) * self.world,
            compute_s=compute,
            wall_s=time.perf_counter() - t0,
        )

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's next (inputs, targets) of its shard, [B, T] each, on the trainer's device."""
        if self.world == 1:
            x, y = self.sampler.next_batch()
        else:  # island step c: batches c*W .. c*W+W-1 of the shard, one per worker; the cursor counts island steps
            c = self.sampler.cursor
            x, y = self.sampler.batch_at(c * self.world + self.rank)
            self.sampler.load_state_dict({**self.sampler.state_dict(), "cursor": c + 1})
        if self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y
