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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from islands.builtin import as_recipe
from islands.data import ShardSampler
from islands.examples import ExampleSampler, batch_tokens
from islands.model import ModelConfig
from islands.model_api import (
    LossFn,
    build_optimizer,
    check_loss,
    instantiate,
    move_batch,
    resolve_callable,
    state_tensors,
)
from islands.spec import InnerSettings, ModelRecipe
from islands.stream import StreamSampler, TokenStream
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


def forward_backward(model: torch.nn.Module, batch: Any, *, precision: str,
                     loss_fn: LossFn | None = None) -> torch.Tensor:
    """The batch's loss `loss_fn(model, batch)`, with its gradients accumulated into the (fp32) parameters, in `precision`.

    `loss_fn` None is islands.model_api.default_loss; the loss must be a scalar float tensor with a
    gradient (else a one-line ModelError naming the fix).

    'fp32': plain. 'tf32': GPU matmuls in TF32 (no effect on CPU). 'bf16': the forward pass under
    bfloat16 autocast, except the output head and the loss, which stay fp32 (islands/model.py);
    backward follows the forward's dtypes, and gradients land in the fp32 parameters. Islands and
    the data-parallel baseline both step through here, so a comparison runs both in one arithmetic.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; use one of {', '.join(PRECISIONS)}")
    loss_fn = resolve_loss(loss_fn)
    device = next(model.parameters()).device
    with _tf32(precision == "tf32" and device.type == "cuda"):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = check_loss(loss_fn(model, batch), f"the loss {getattr(loss_fn, '__qualname__', loss_fn)!r}")
        loss.backward()
    return loss


def resolve_loss(spec: Any) -> LossFn:
    """The loss a spec names: None is the default (islands.model_api.default_loss), else a callable or import path."""
    from islands.model_api import default_loss

    return resolve_callable(spec, "loss") or default_loss


def make_sampler(data: Any, *, shard_index: int, num_shards: int, seq_len: int, batch_size: int, seed: int,
                 pool: str | None = None, world: int = 1, rank: int = 0) -> Any:
    """The sampler of one island's shard: its own units of a corpus, streamed (islands.stream.StreamSampler,
    from pool `pool`'s copy; worker `rank` of `world`), token windows of a 1-D token array
    (islands.data.ShardSampler), else batches of a map-style dataset's examples
    (islands.examples.ExampleSampler). All resume exactly from a cursor."""
    if isinstance(data, TokenStream):
        if data.num_islands != num_shards:
            raise ValueError(f"the data plan is for {data.num_islands} islands but this run has {num_shards}")
        return StreamSampler(data, island=shard_index, seq_len=seq_len, batch_size=batch_size, seed=seed, pool=pool,
                             world=world, rank=rank)
    if isinstance(data, np.ndarray):
        return ShardSampler(data, shard_index=shard_index, num_shards=num_shards, seq_len=seq_len,
                            batch_size=batch_size, seed=seed)
    return ExampleSampler(data, shard_index=shard_index, num_shards=num_shards, batch_size=batch_size, seed=seed)


@dataclass(frozen=True)
class StepResult:
    """What one inner step did."""

    loss: float  # mean cross-entropy of the batch, nats per token
    tokens: int
    compute_s: float  # forward + backward + optimizer step
    wall_s: float  # compute plus emulated slowdown


class InnerTrainer:
    """A model replica, its inner optimizer (AdamW by default) and its data shard sampler.

    `model` is the run's ModelRecipe (factory, loss, optimizer; islands/spec.py), or a built-in shape
    (a ModelConfig: the byte transformer with `loss_fn`, AdamW and `seed`). The model is built only to get
    its shapes; the island overwrites every state tensor with the global ones before the first step.
    `data` is a 1-D token array or a map-style dataset (:func:`make_sampler`).

    With a `group` (islands/distributed.py) this is one worker of a data-parallel island: island step
    c reads batch `c * W + rank` of the shard, gradients are averaged over the W workers before the
    clip and the AdamW step, and a step counts the tokens of all W batches. The sampler's cursor
    still counts island steps, so resuming from a cursor works as with one worker.

    With `shard` too (an FSDP island, islands/fsdp.py) the model is built only by `materialize`, once
    the group is up, and sharded there: `params` are then DTensors of which this worker holds 1/W,
    FSDP averages the gradients, and the optimizer steps this worker's pieces.
    """

    def __init__(
        self,
        model: ModelRecipe | ModelConfig,
        data: Any,
        *,
        settings: InnerSettings,
        shard_index: int,
        num_shards: int,
        seed: int,
        group: WorkerGroup | None = None,
        device: torch.device | str = "cpu",
        loss_fn: LossFn | None = None,
        shard: bool = False,
        pool: str | None = None,
    ) -> None:
        recipe = as_recipe(model, seed=seed, loss=loss_fn)
        if shard and group is None:
            raise ValueError("a sharded trainer is one worker of an FSDP island; pass its WorkerGroup")
        self.recipe = recipe
        self.settings = settings
        self.loss_fn = resolve_loss(recipe.loss)
        self.group = group
        self.sharded = shard
        self.world = group.world_size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        self.device = torch.device(device)
        self.model: torch.nn.Module | None = None
        # Parameters and trained buffers (islands/model_api.py state_tensors): what fragments carry.
        self.params: dict[str, torch.Tensor] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._peak_lrs = [settings.lr]  # until the optimizer is built (a user's may set its own)
        if not shard:  # a sharded model needs the group up: `materialize` builds it then
            self.materialize()
        self.sampler = make_sampler(data, shard_index=shard_index, num_shards=num_shards, seq_len=recipe.seq_len,
                                    batch_size=settings.batch_size, seed=seed, pool=pool, world=self.world, rank=self.rank)
        # Jitter draws are seeded per island so an emulated run replays the same pacing.
        self._jitter_rng = random.Random(seed * 1_000_003 + shard_index)
        self.steps = 0
        # The run's tokens processed / token budget, as last heard (islands: from published fragments;
        # followers: from their leader). Only a decaying lr schedule reads it.
        self.progress = 0.0

    def materialize(self) -> None:
        """Build the model and its optimizer (in the constructor, or for a sharded trainer once its group is up)."""
        if self.model is not None:
            return
        model = instantiate(self.recipe.model, self.recipe.seed)
        if self.device.type != "cpu":
            model.to(self.device)  # before the optimizer is built, so its state lives there too
        model.train()
        if self.sharded:
            from islands.fsdp import shard_model

            shard_model(model, device=self.device, world=self.world)
        self.model = model
        self.params = state_tensors(model)
        s = self.settings
        self.optimizer = build_optimizer(self.recipe.optimizer, model, lr=s.lr, betas=(s.beta1, s.beta2),
                                         weight_decay=s.weight_decay)
        # Each group's own lr is its peak; the schedule scales it (a user's optimizer may set several).
        self._peak_lrs = [group["lr"] for group in self.optimizer.param_groups]

    def lr_factor_at(self, step: int) -> float:
        """The schedule's factor on every group's peak lr at inner step `step` and the run progress last told."""
        s = self.settings
        return lr_factor(s.lr_schedule, step=step, warmup_steps=s.warmup_steps, progress=self.progress,
                         final_ratio=s.lr_final_ratio)

    def lr_at(self, step: int) -> float:
        """The learning rate of inner step `step` (of the first parameter group) at the run progress last told."""
        return self._peak_lrs[0] * self.lr_factor_at(step)

    def step(self) -> StepResult:
        """Run one inner-optimizer step on the next batch of this island's shard, then the emulated slowdown."""
        model, optimizer, worker_group = self.model, self.optimizer, self.group
        assert model is not None and optimizer is not None, "materialize() before step()"
        t0 = time.perf_counter()
        batch = self.next_batch()
        factor = self.lr_factor_at(self.steps)
        for group, peak in zip(optimizer.param_groups, self._peak_lrs):
            group["lr"] = peak * factor
        loss = forward_backward(model, batch, precision=self.settings.precision, loss_fn=self.loss_fn)
        mean_loss = loss.detach()
        if self.sharded:  # FSDP has averaged the gradients into each worker's pieces; the loss is reported
            assert worker_group is not None  # a sharded trainer has its group (checked in __init__)
            mean_loss = worker_group.mean(mean_loss)
        elif worker_group is not None:  # every worker now holds the island's mean gradient (and loss)
            mean_loss = worker_group.average_gradients(model.parameters(), mean_loss)
        if self.settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
            tokens=batch_tokens(batch) * self.world,
            compute_s=compute,
            wall_s=time.perf_counter() - t0,
        )

    def next_batch(self) -> Any:
        """This worker's next batch of its shard on the trainer's device: (inputs, targets) [B, T] each
        for a token stream, the collated examples for a dataset."""
        if self.world == 1 or isinstance(self.sampler, StreamSampler):  # a stream takes its worker's batch itself
            batch = self.sampler.next_batch()
        else:  # island step c: batches c*W .. c*W+W-1 of the shard, one per worker; the cursor counts island steps
            c = self.sampler.cursor
            batch = self.sampler.batch_at(c * self.world + self.rank)
            self.sampler.load_state_dict({**self.sampler.state_dict(), "cursor": c + 1})
        return batch if self.device.type == "cpu" else move_batch(batch, self.device)
