"""The per-fragment bookkeeping one island's inner loop, outbox, inbox and salvage shelf share.

Fragment p has live parameters `theta[p]` (the trainer's tensors, changed in place), the global copy
`base[p]` it last adopted with that copy's `version[p]` and sender `epoch[p]`, and counters of the
steps, tokens and compute since its previous cut. A plain record: the island's condition variable
guards it, and the collaborators that hold it (islands/outbox.py, islands/inbox.py,
islands/salvage_shelf.py) each change only the parts their docstrings name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FragmentState:
    """One island's view of its P fragments: parameters, adopted copies and progress since each cut."""

    theta: list[list[torch.Tensor]]  # the live parameter tensors of fragment p, in fragment order
    base: list[list[torch.Tensor]] = field(default_factory=list)  # global fragment p as last adopted (float32)
    version: list[int] = field(default_factory=list)
    epoch: list[int] = field(default_factory=list)  # epoch of the outer optimizer that sent each base (delta downlink)
    steps: list[int] = field(default_factory=list)  # inner steps since the previous cut of fragment p
    tokens: list[int] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)  # wall seconds of steps since the previous cut
    submitted: list[int] = field(default_factory=list)  # tokens cut into submissions (incl. dropped)
    discarded: list[int] = field(default_factory=list)  # tokens a resync dropped before they were cut
    overwritten: list[int] = field(default_factory=list)  # progress an overwrite adoption replaced (never merged)

    @classmethod
    def of(cls, theta: list[list[torch.Tensor]]) -> FragmentState:
        """Fresh bookkeeping for these fragments: nothing adopted (version -1), nothing counted."""
        P = len(theta)
        return cls(theta=theta, base=[[] for _ in range(P)], version=[-1] * P, epoch=[-1] * P, steps=[0] * P,
                   tokens=[0] * P, compute=[0.0] * P, submitted=[0] * P, discarded=[0] * P, overwritten=[0] * P)

    @property
    def num_fragments(self) -> int:
        """P, the number of fragments."""
        return len(self.theta)

    def count_step(self, tokens: int, wall_s: float) -> None:
        """One inner step changed every fragment: count it towards each one's next cut."""
        for p in range(self.num_fragments):
            self.steps[p] += 1
            self.tokens[p] += tokens
            self.compute[p] += wall_s

    def reset_progress(self, p: int) -> None:
        """Fragment p's progress since its last cut is cut, replaced or dropped: count from zero again."""
        self.tokens[p], self.steps[p], self.compute[p] = 0, 0, 0.0

    def has_progress(self, p: int) -> bool:
        """Fragment p has unsubmitted steps on top of an adopted base (something to cut or shelve)."""
        return self.steps[p] > 0 and bool(self.base[p])

    def adopted(self, p: int, global_: list[torch.Tensor], *, version: int, epoch: int) -> None:
        """Record `global_` as fragment p's base (a float32 copy: never keep the shared fetched tensors)."""
        self.base[p] = [g.detach().to(torch.float32).clone() for g in global_]
        self.version[p] = version
        self.epoch[p] = epoch
