"""FSDP islands: each of an island's W workers holds 1/W of its parameters and inner-optimizer state.

With `pools[].shard: fsdp` the island's model is sharded with torch's FSDP2 (`fully_shard`): every
parameter is a DTensor cut in W pieces along dim 0 (rank r holds the r-th of `torch.chunk(t, W)`),
AdamW's moments live beside each piece, and a forward all-gathers one unit's parameters at a time
(each element of every `nn.ModuleList`, e.g. the transformer blocks, then the rest of the model).
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

SHARDS = ("none", "fsdp")
"""How an island's workers split its model (config field pools[].shard)."""


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own: each element of every `nn.ModuleList`, deepest first.

    A unit's parameters are all-gathered for its forward and freed after it, so at most one unit is
    whole at a time (plus the root's own parameters). An element that shares a parameter with
    anything outside it (a tied weight) is left to its parent's unit: FSDP shards a tensor once.
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
                         "make them 1-element tensors (shape [1]) or set the pool's shard: none")
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
        """[start, stop) of dim 0 that `rank` holds: the rank-th of torch.chunk(t, world), empty past the last."""
        if not self.sharded:
            return 0, self.shape[0] if self.shape else 1
        n = self.shape[0]
        size = math.ceil(n / world)
        return min(rank * size, n), min((rank + 1) * size, n)

    def part_shape(self, rank: int, world: int) -> tuple[int, ...]:
        """The shape of `rank`'s part."""
        if not self.sharded:
            return self.shape
        start, stop = self.rows(rank, world)
        return (stop - start, *self.shape[1:])

    def part(self, whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """`rank`'s part of the whole tensor (a view)."""
        if not self.sharded:
            return whole
        start, stop = self.rows(rank, world)
        return whole[start:stop]


@dataclass(frozen=True)
class Boundary:
    """What the leader tells its workers at a step boundary, before any of them adopts anything.

    The updates carry no tensors (each worker gets its part by `ShardLink.scatter`, in this order).
    `forced` is a resync: whole fragments adopted over everything, after every cut is forgotten.
    `stop` ends the loop, after the final flush's `cuts` (fragment, dropped by an injected fault).
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

    def _numel(self, p: int, rank: int, *, whole: bool) -> int:
        """Elements of fragment p that travel to or from `rank`: its parts, and the whole tensors if `whole`."""
        return sum(math.prod(lay.part_shape(rank, self.world)) for lay in self.layouts[p] if lay.sharded or whole)

    def gather(self, p: int, parts: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """Every worker's parts of fragment p's tensors, put together on rank 0 (float32, CPU); None elsewhere.

        `parts` are this worker's parts in fragment order (a cut's `anchor - theta`). Rank 0 holds the whole
        fragment once, the other workers never.
        """
        layouts, device = self.layouts[p], self.group.device
        # A whole (unsharded) tensor comes from rank 0 only: every worker holds the same one.
        size = max(self._numel(p, r, whole=r == 0) for r in range(self.world))
        mine = [t.reshape(-1) for t, lay in zip(parts, layouts) if lay.sharded or self.rank == 0]
        flat = torch.zeros(size, dtype=torch.float32, device=device)
        if mine:
            joined = torch.cat([t.to(device=device, dtype=torch.float32) for t in mine])
            flat[:joined.numel()] = joined
        if self.rank != 0:
            dist.gather(flat, None, dst=0)
            return None
        bufs = [torch.empty(size, dtype=torch.float32, device=device) for _ in range(self.world)]
        dist.gather(flat, bufs, dst=0)
        offsets = [0] * self.world
        whole = []
        for lay in layouts:
            pieces = []
            for r in range(self.world if lay.sharded else 1):
                shape = lay.part_shape(r, self.world)
                n = math.prod(shape)
                pieces.append(bufs[r][offsets[r]:offsets[r] + n].view(shape))
                offsets[r] += n
            whole.append((torch.cat(pieces) if len(pieces) > 1 else pieces[0]).cpu().clone())
        return whole

    def scatter(self, p: int, whole: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Rank 0's whole tensors of fragment p (float32; None on the other workers), as each worker's parts.

        Returns this worker's parts (float32, on its device), new tensors: `whole` may be the shared
        fetched copy and is never written to.
        """
        layouts, device = self.layouts[p], self.group.device
        size = max(self._numel(p, r, whole=True) for r in range(self.world))
        out = torch.empty(size, dtype=torch.float32, device=device)
        if self.rank == 0:
            assert whole is not None, "rank 0 scatters the whole fragment"
            sends = []
            for r in range(self.world):
                flat = torch.zeros(size, dtype=torch.float32, device=device)
                parts = [lay.part(t.to(device=device, dtype=torch.float32), r, self.world).reshape(-1)
                         for t, lay in zip(whole, layouts)]
                if parts:
                    joined = torch.cat(parts)
                    flat[:joined.numel()] = joined
                sends.append(flat)
            dist.scatter(out, sends, src=0)
        else:
            dist.scatter(out, None, src=0)
        mine, offset = [], 0
        for lay in layouts:
            shape = lay.part_shape(self.rank, self.world)
            n = math.prod(shape)
            mine.append(out[offset:offset + n].view(shape).clone())
            offset += n
        return mine
