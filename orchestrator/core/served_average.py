"""The served model (run.average_window): a moving average of each fragment's global tensors.

After each round of fragment p the average moves toward the new global tensors by
`policies.averaging.average_weight(round tokens, merged tokens, window)`, so it spans about `window`
of the tokens merged so far. Evaluation reads it instead of the raw global parameters.
"""

from __future__ import annotations

import torch

from orchestrator.core.checkpoint import AVERAGE_PREFIX
from policies.averaging import average_weight


class ServedAverage:
    """Per fragment, a moving average of the global tensors over `window` of the merged tokens."""

    def __init__(self, params: list[list[torch.Tensor]], window: float) -> None:
        self.window = window
        self.fragments = [[t.clone() for t in frag] for frag in params]  # starts at the initial global model

    def update(self, p: int, params: list[torch.Tensor], tokens: int, tokens_merged: int) -> None:
        """Move fragment p toward its new global tensors after a round of `tokens` (`tokens_merged` so far)."""
        w = average_weight(tokens, tokens_merged, self.window)
        with torch.no_grad():
            for a, t in zip(self.fragments[p], params):
                a.lerp_(t, w)

    def save(self, p: int, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
        """Add fragment p's averages to a checkpoint's `tensors`, by parameter name."""
        for name, a in zip(names, self.fragments[p]):
            tensors[AVERAGE_PREFIX + name] = a.clone()

    def load(self, p: int, names: list[str], tensors: dict[str, torch.Tensor], params: list[torch.Tensor]) -> None:
        """Restore fragment p from a checkpoint; one written without averaging starts it at `params`."""
        self.fragments[p] = [tensors.get(AVERAGE_PREFIX + n, t).clone() for n, t in zip(names, params)]
