"""Data parallel inside one island: W workers, one torch.distributed process group, one failure domain.

Rank 0 is the island's leader (islands/island.py `LearnerIsland`, which keeps the whole control
interface); ranks 1..W-1 are followers (islands/follower.py `IslandFollower`) that mirror it step for
step. This module is the group and its collectives; it imports no trainer, so the trainer, the leader
and the follower all import it and nothing imports back:

- Rendezvous: the leader opens a `TCPStore` on its node on a free port (port 0, so no race for the
  port) and says where; followers join with their rank. One process group per island incarnation
  (every incarnation is new processes), gloo on CPU, NCCL on GPU, with a finite timeout so a hung
  peer fails the island instead of hanging it forever (a dead peer fails the next collective at once).
- Step boundary: the leader applies published fragments (its adoption policy: overwrite, rebase or
  mix), then broadcasts a small control tensor (stop, train this step, the run progress its learning
  rate follows, which fragments changed) and the changed fragments' parameters; followers copy them in. Adoption never touches optimizer state,
  so copying parameters is all a follower needs.
- Inner step: worker r trains on batch `cursor * W + r` of the island's shard; gradients (and the
  loss, for reporting) are averaged with one all_reduce; every worker applies the same AdamW step,
  so parameters and optimizer state stay identical. This equals one step on the W batches
  concatenated (mean loss), which tests/integration/test_multiworker.py checks against a
  single-process reference.

With `pools[].shard: fsdp` the workers instead each hold 1/W of the model (islands/fsdp.py); this
group is still their rendezvous and process group.

Torch only: the Ray side (actors, placement) is in orchestrator/actors/remote.py and launcher.py.
The NCCL path has run only up to NCCL's own refusal of two ranks on one card (one-GPU machine,
benchmarks/gpu_check.py); a two-worker NCCL island needs two GPUs and has not run.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
"""Rendezvous and collective timeout: generous for a cold start on a busy machine, finite so a hung
peer fails the island (the health monitor usually notices the missing progress sooner)."""


def island_device(accelerator: str) -> torch.device:
    """The device an island's workers compute on: CPU for accelerator 'cpu', else this process's GPU."""
    if accelerator == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"pool accelerator {accelerator!r} needs CUDA but torch.cuda.is_available() is False here; "
                           "set the pool's accelerator to 'cpu', or install a CUDA build of torch and give the pool "
                           "gpus_per_worker > 0")
    # Ray sets CUDA_VISIBLE_DEVICES to the worker's own GPU(s): the first visible one is ours.
    return torch.device("cuda", torch.cuda.current_device())


def describe_device(device: torch.device) -> str:
    """A device for reports: 'cpu', or 'cuda:0 (NVIDIA H200)' (which card an island actually trained on)."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def backend_for(accelerator: str) -> str:
    """The collective backend of an island: gloo on CPU, NCCL on GPU."""
    return "gloo" if accelerator == "cpu" else "nccl"


@dataclass(frozen=True)
class Control:
    """What the leader tells its followers at one step boundary."""

    stop: bool  # the island stops: leave the loop
    train: bool  # take an inner step now (False while the island is blocked or hung)
    changed: tuple[int, ...]  # fragments whose parameters follow, in this order
    progress: float = 0.0  # the run progress the leader's learning rate follows (bit for bit)


class WorkerGroup:
    """This process's place in its island's process group; rank 0 (the leader) hosts the rendezvous.

    Construct rank 0 first (it binds the store and learns its port), hand `(addr, port)` to the
    followers, then every rank calls `connect()`, which blocks until all `world_size` ranks joined
    (at most `timeout_s`). Collectives are called from one thread per process.
    """

    def __init__(self, *, rank: int, world_size: int, addr: str, port: int = 0, backend: str = "gloo",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: a worker group needs at least 2 workers; run W=1 islands without one")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        if rank > 0 and port <= 0:
            raise ValueError(f"rank {rank} needs the leader's port (got {port}); ask rank 0 for `port` after it is built")
        self.rank, self.world_size, self.addr, self.backend = rank, world_size, addr, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cpu") if backend == "gloo" else island_device("cuda")
        self._store: Any = None
        if rank == 0:  # port 0: the OS picks a free port while the store binds it, so nobody can take it first
            self._store = dist.TCPStore(addr, port, world_size, True, timeout=self.timeout, wait_for_workers=False)
            port = self._store.port
        self.port = port
        self.connected = False

    def connect(self) -> None:
        """Join the island's process group; blocks until every rank is in (raises after the timeout). Idempotent."""
        if self.connected:
            return
        if self._store is None:
            self._store = dist.TCPStore(self.addr, self.port, self.world_size, False, timeout=self.timeout)
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group; an island worker is one process per "
                               "island incarnation (start a new process for a new incarnation)")
        kwargs: dict[str, Any] = {"device_id": self.device} if self.backend == "nccl" else {}
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.backend, store=self._store, rank=self.rank, world_size=self.world_size,
                                timeout=self.timeout, **kwargs)
        self.connected = True
        log.info("worker %d/%d joined its island's %s group at %s:%d", self.rank, self.world_size, self.backend,
                 self.addr, self.port)

    def close(self) -> None:
        """Leave the process group (after a clean stop; a failed island's processes are killed instead)."""
        if self.connected and dist.is_initialized():
            dist.destroy_process_group()
        self.connected = False

    # ------------------------------------------------------------ collectives

    def average_gradients(self, params: Iterable[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Replace every parameter's gradient by its mean over the workers (one all_reduce); returns the mean loss.

        With equal batches per worker this is the gradient of the mean loss over all the workers'
        batches together. A parameter without a gradient counts as zero (so buffers line up).
        """
        params = list(params)
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32) for p in params]
        flat = torch.cat(parts + [loss.detach().reshape(1).to(device=self.device, dtype=torch.float32)])  # [N + 1]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.world_size
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                mean = flat[offset:offset + n].view_as(p).to(p.dtype)
                if p.grad is None:
                    p.grad = mean.clone()
                else:
                    p.grad.copy_(mean)
                offset += n
        return flat[-1]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over the workers (one all_reduce): an FSDP island's reported loss, whose
        gradients FSDP has already averaged."""
        flat = value.detach().reshape(1).to(device=self.device, dtype=torch.float32)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        return flat[0] / self.world_size

    def broadcast_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's values of `tensors` into every rank's tensors, in place (one broadcast per dtype)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])  # [sum of numels]
                dist.broadcast(flat, src=0)
                if self.rank != 0:
                    offset = 0
                    for t in group:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    def share_cursor(self, cursor: Sequence[int]) -> tuple[int, ...]:
        """Rank 0's data cursor (islands.cursor.DataCursor, as ints) on every rank: a restarted island's workers
        resume where its leader does, not at the start of the stream."""
        values = torch.tensor(list(cursor), dtype=torch.int64, device=self.device)
        dist.broadcast(values, src=0)
        return tuple(int(v) for v in values.tolist())

    def lead(self, fragments: Sequence[Sequence[torch.Tensor]], *, changed: Iterable[int], train: bool,
             stop: bool = False, progress: float = 0.0) -> None:
        """Leader, at a step boundary: send the control tensor, then the changed fragments' parameters."""
        changed = sorted(set(changed))
        ctrl = torch.zeros(3 + len(fragments), dtype=torch.int64, device=self.device)  # [stop, train, progress, changed...]
        ctrl[0], ctrl[1] = int(stop), int(train)
        # The float64's bits, so every worker computes exactly the leader's learning rate.
        ctrl[2] = torch.tensor([progress], dtype=torch.float64).view(torch.int64)[0]
        for p in changed:
            ctrl[3 + p] = 1
        dist.broadcast(ctrl, src=0)
        if changed and not stop:
            self.broadcast_([t for p in changed for t in fragments[p]])

    def follow(self, fragments: Sequence[Sequence[torch.Tensor]]) -> Control:
        """Follower, at a step boundary: receive the control tensor and copy in the changed fragments."""
        ctrl = torch.zeros(3 + len(fragments), dtype=torch.int64, device=self.device)
        dist.broadcast(ctrl, src=0)
        progress = float(ctrl[2:3].cpu().view(torch.float64)[0])
        flags = ctrl.tolist()
        control = Control(stop=bool(flags[0]), train=bool(flags[1]), progress=progress,
                          changed=tuple(p for p, f in enumerate(flags[3:]) if f))
        if control.changed and not control.stop:
            self.broadcast_([t for p in control.changed for t in fragments[p]])
        return control
