"""Error feedback for lossy outer gradients: what a submission did not carry goes into the next one.

Top-k compression (``policies/compression.py``) sends a few percent of each fragment's outer gradient, and
int2 and sign send every element at 2 bits or 1, losing 12% and 36% of a Gaussian block's energy
(``FEEDBACK_SCHEMES``; any compressor whose ``needs_feedback`` is set). An island keeps the rest in an
accumulator ``e`` per fragment and adds it to its next outer gradient of that fragment, so progress is
delayed, never dropped (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD"; in DiLoCo-style training, SparseLoCo, arXiv:2508.15706)::

    a = decay * e + delta       what is owed: the new progress and everything not sent before
    sent = decode(encode(a))    what the submission carries
    e = a - sent                what stays owed

With ``decay = 1`` the sum of everything sent plus ``e`` equals the sum of every ``delta``, exactly up to float
rounding. SparseLoCo uses ``decay < 1`` so that the accumulator doubles as outer momentum; that is a choice for the
run (``outer.feedback_decay``), measured in the README.

What ``e`` holds is progress the island made but the global model does not have yet. It is lost when the island
dies (a progress snapshot carries ``a`` without settling it, so a salvage delivers it) and at the end of a run
after the final flush.

Pure (torch only): islands hold one :class:`ErrorFeedback`; tests drive it without Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Per-fragment accumulators of what an island's submissions have not carried yet.

    Args:
        num_fragments: fragments of the model.
        decay: factor on the accumulator each time new progress is added, in [0, 1].

    Memory: one float32 copy of the model once every fragment has been sent.
    """

    def __init__(self, num_fragments: int, decay: float = 1.0) -> None:
        if num_fragments < 1:
            raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in [0, 1], got {decay}; use 1.0 to keep everything not yet sent")
        self.decay = decay
        self._owed: list[list[Tensor] | None] = [None] * num_fragments

    def owed(self, fragment: int, delta: Sequence[Tensor]) -> list[Tensor]:
        """``decay * e + delta`` for ``fragment``: what a submission of it should carry (new tensors; nothing
        changes until :meth:`settle`)."""
        held = self._owed[fragment]
        if held is None:
            return [d.detach().to(torch.float32).clone() for d in delta]
        if len(held) != len(delta):
            raise ValueError(f"fragment {fragment} has {len(held)} accumulated tensors but the new progress has {len(delta)}")
        return [self.decay * e + d.detach().to(torch.float32) for e, d in zip(held, delta)]

    def settle(self, fragment: int, owed: Sequence[Tensor], sent: Sequence[Tensor]) -> None:
        """Record that a submission of ``fragment`` carried ``sent`` (decoded) of ``owed``: ``e = owed - sent``."""
        if len(owed) != len(sent):
            raise ValueError(f"fragment {fragment}: {len(sent)} sent tensors for {len(owed)} owed")
        self._owed[fragment] = [o - s.to(torch.float32) for o, s in zip(owed, sent)]

    def residual(self, fragment: int) -> list[Tensor] | None:
        """What ``fragment``'s submissions still owe, or None before its first settle."""
        return self._owed[fragment]

    def norm(self) -> float:
        """L2 norm of everything still owed, over all fragments (for logs and tests)."""
        total = sum(float(e.pow(2).sum()) for held in self._owed if held is not None for e in held)
        return total ** 0.5
