"""FSDP islands: each of an island's W workers holds 1/W of its parameters and inner-optimizer state.

With `pools[].shard: fsdp` the island's model is sharded with torch's FSDP2 (`fully_shard`): every
parameter is a DTensor cut in W pieces along dim 0 (rank r holds the r-th of `torch.chunk(t, W)`),
AdamW's moments live beside each piece, and a forward or backward all-gathers the units' parameters
in turn (each element of every `nn.ModuleList`, e.g. the transformer blocks, then the rest of the model).
Buffers are not sharded: every worker holds them whole, and rank 0's count (as the data-parallel
island's leader's do).

The island's own bookkeeping (islands/fragment_state.py, outbox.py, inbox.py) is elementwise, so every
worker keeps a replica of it over its own pieces: its part of theta, of each fragment's base and of
each cut in flight. The leader decides and its workers follow (`Boundary`, `Order`); only two things
need the whole fragment, and they meet it one fragment at a time (docs/islands.md, FSDP islands):

- a cut: each worker's part of `anchor - theta` is gathered to rank 0, which encodes the fragment
  into the submission (`ShardLink.gather`);
- an adoption: rank 0 fetches the published fragment when it applies it and sends each worker its
  part (`ShardLink.scatter`); every worker then adopts its part with the island's policy.

Torch only; the group itself (rendezvous, backend) is islands/distributed.py's `WorkerGroup`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from islands.distributed import WorkerGroup
from islands.messages import FragmentUpdate


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own: each element of every `nn.ModuleList`, deepest first.

    A unit's parameters are all-gathered for its forward and its backward and freed after each, so
    the units are whole in turn (FSDP may prefetch the next), not all at once. An element that shares a
    parameter with anything outside it (a tied weight) is left to its parent's unit: FSDP shards a
    tensor once.
    """
    registered: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        registered.setdefault(id(p), []).append(name)
    units = []
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for i, child in enumerate(module):
            path = f"{prefix}.{i}." if prefix else f"{i}."
            if all(n.startswith(path) for p in child.parameters() for n in registered[id(p)]):
                units.append(child)
    return units[::-1]  # named_modules is pre-order: reversed, every unit comes before the units that hold it


def shard_model(model: nn.Module, *, device: torch.device, world: int) -> nn.Module:
    """Shard `model` in place over the `world` workers of the current process group (FSDP2); returns it.

    Call it after the group is up (islands/distributed.py `WorkerGroup.connect`) and before building
    the optimizer, which must see the sharded parameters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if any(p.dim() == 0 for p in model.parameters()):
        names = [n for n, p in model.named_parameters() if p.dim() == 0]
        raise ValueError(f"the model has 0-dim parameters {names[:3]}, which FSDP cannot cut along dim 0; "
                         "give them shape [1], or set the pool's shard: none")
    mesh = init_device_mesh(device.type, (world,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This worker's part of a state tensor: its piece of a sharded parameter (the storage the optimizer
    steps, so writing it writes the parameter), or a buffer itself."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


@dataclass(frozen=True)
class Layout:
    """Where one state tensor lives on the island's workers: cut along dim 0 (a parameter), or whole on each."""

    shape: tuple[int, ...]  # the whole tensor's
    sharded: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        """The layout of a state tensor of a sharded model (a DTensor parameter is cut, anything else is whole)."""
        from torch.distributed.tensor import DTensor

        return cls(tuple(t.shape), isinstance(t, DTensor))

    def rows(self, rank: int, world: int) -> tuple[int, int]:
        """[start, stop) of dim 0 that `rank` holds of a sharded tensor: the rank-th of torch.chunk(t, world),
        empty past the last."""
        n = self.shape[0]
        size = math.ceil(n / world)
        return min(rank * size, n), min((rank + 1) * size, n)


@dataclass(frozen=True)
class Boundary:
    """What the leader tells its workers at a step boundary, before any of them adopts anything.

    The updates carry no tensors (each worker gets its part by `ShardLink.scatter`, in this order).
    `forced` is a resync: whole fragments adopted over everything, after every cut is forgotten.
    At the stop the leader sends the final flush's `cuts` (fragment, dropped by an injected fault), one
    boundary each and nothing else, then `stop`, which ends the loop.
    """

    forced: tuple[FragmentUpdate, ...] = ()
    updates: tuple[FragmentUpdate, ...] = ()
    stop: bool = False
    cuts: tuple[tuple[int, bool], ...] = ()


@dataclass(frozen=True)
class Order:
    """What the leader tells its workers once every update is adopted: step or not, and the cut after the step."""

    train: bool
    cut: tuple[int, bool] | None = None  # (fragment, dropped by an injected fault) to cut after this step


def without_tensors(update: FragmentUpdate) -> FragmentUpdate:
    """An update's metadata, for the workers: what it adopts reaches them as their parts."""
    from dataclasses import replace

    return replace(update, tensors=[])


class ShardLink:
    """The collectives of an FSDP island beyond FSDP's own: messages from the leader, and whole fragments
    to and from parts. Called from one thread per worker, in the same order on every worker."""

    def __init__(self, group: WorkerGroup, layouts: Sequence[Sequence[Layout]]) -> None:
        """`layouts[p]`: the layout of each tensor of fragment p, in fragment order."""
        self.group = group
        self.rank, self.world = group.rank, group.world_size
        self.layouts = [list(frag) for frag in layouts]

    def send(self, message: Any) -> None:
        """Leader: send a small picklable message to every worker."""
        dist.broadcast_object_list([message], src=0, device=self._object_device())

    def receive(self) -> Any:
        """Worker: the leader's next message."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def _object_device(self) -> torch.device | None:
        # NCCL moves pickled messages through the GPU; gloo through the CPU.
        return self.group.device if self.group.backend == "nccl" else None

    def gather(self, p: int, parts: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Every worker's parts of fragment p's tensors, put together on rank 0 (float32, CPU); None elsewhere.

        `parts` are this worker's parts in fragment order (a cut's `anchor - theta`). One tensor at a time,
        each gathered straight into its whole (padded by under a row per worker), so rank 0 holds the
        fragment once and the other workers never.
        """
        whole: list[torch.Tensor] = []
        for t, lay in zip(parts, self.layouts[p]):
            if not lay.sharded:  # every worker holds it: rank 0's counts
                if self.rank == 0:
                    whole.append(t.detach().to(torch.float32).cpu())
                continue
            rows = _rows_per_part(lay, self.world)
            mine = torch.zeros((rows, *lay.shape[1:]), dtype=torch.float32, device=self.group.device)
            mine[:t.shape[0]] = t
            if self.rank == 0:
                out = torch.empty((self.world * rows, *lay.shape[1:]), dtype=torch.float32, device=self.group.device)
                dist.gather(mine, list(out.chunk(self.world)), dst=0)
                whole.append(out[:lay.shape[0]].cpu())
            else:
                dist.gather(mine, None, dst=0)
        return whole if self.rank == 0 else None

    def scatter(self, p: int, whole: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Rank 0's whole tensors of fragment p (None on the other workers), as this worker's parts.

        One tensor at a time; returns new float32 tensors on this worker's device (`whole` may be the
        shared fetched copy and is never written to).
        """
        if self.rank == 0:
            assert whole is not None and len(whole) == len(self.layouts[p]), "rank 0 scatters the whole fragment"
        mine = []
        for i, lay in enumerate(self.layouts[p]):
            src = whole[i].to(device=self.group.device, dtype=torch.float32) if whole is not None else None
            if not lay.sharded:  # every worker holds it whole
                buf = src.clone() if src is not None else torch.empty(lay.shape, dtype=torch.float32,
                                                                      device=self.group.device)
                dist.broadcast(buf, src=0)
                mine.append(buf)
                continue
            rows = _rows_per_part(lay, self.world)
            out = torch.empty((rows, *lay.shape[1:]), dtype=torch.float32, device=self.group.device)
            if src is not None:
                pad = self.world * rows - lay.shape[0]
                if pad:  # the last parts are short (torch.chunk): send them padded
                    src = torch.cat([src, src.new_zeros((pad, *lay.shape[1:]))])
                dist.scatter(out, list(src.chunk(self.world)), src=0)
            else:
                dist.scatter(out, None, src=0)
            start, stop = lay.rows(self.rank, self.world)
            mine.append(out[:stop - start])
        return mine


def _rows_per_part(lay: Layout, world: int) -> int:
    """Rows of dim 0 in each part, the last ones padded up to it: torch.chunk's part size."""
    return math.ceil(lay.shape[0] / world)
