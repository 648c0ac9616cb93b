"""Held-out evaluation of the global state: the same fixed batches every time."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from islands.builtin import as_recipe
from islands.data import heldout_batches
from islands.model_api import instantiate, load_state_tensors
from islands.spec import ModelConfig, ModelRecipe


def example_batches(dataset: Any, *, batch_size: int, num_batches: int) -> list[Any]:
    """Up to `num_batches` collated batches of `batch_size` examples at evenly spaced indices of `dataset`.

    No randomness: every evaluation sees the same examples. A dataset smaller than the batches asked
    for gives each of its examples once, in fewer or smaller batches.
    """
    from torch.utils.data import default_collate

    n = len(dataset)
    count = min(n, batch_size * num_batches)
    indices = np.linspace(0, n - 1, num=count).round().astype(np.int64).tolist()
    return [default_collate([dataset[i] for i in indices[k:k + batch_size]]) for k in range(0, count, batch_size)]


class Evaluator:
    """Loads global state tensors into a private model (eval mode) and measures the held-out loss.

    `heldout` is a 1-D token array (windows of `recipe.seq_len` tokens) or a map-style dataset of
    examples (:func:`example_batches`); the loss is the recipe's (islands.model_api; default: cross-entropy).
    """

    def __init__(self, recipe: ModelRecipe | ModelConfig, heldout: Any, *, batches: int, batch_size: int,
                 loss_fn: Any = None, threads: int | None = None) -> None:
        """A built-in shape (ModelConfig) evaluates the byte transformer with `loss_fn` (None: the default).

        `threads`: torch threads while evaluating (None: the process's). The driver passes the islands'
        count: with torch's default of one per core, evaluation beside busy islands took 2.0 s for 8 batches
        on a loaded 2-core machine against 0.15 s on one thread, stalling the driver's loop meanwhile."""
        self.threads = threads
        from islands.trainer import resolve_loss

        recipe = as_recipe(recipe, seed=0, loss=loss_fn)
        self.loss_fn = resolve_loss(recipe.loss)
        self.model = instantiate(recipe.model, recipe.seed)
        self.model.eval()
        if isinstance(heldout, np.ndarray):
            self.batches: list[Any] = heldout_batches(heldout, seq_len=recipe.seq_len, batch_size=batch_size,
                                                      num_batches=batches)
        else:
            self.batches = example_batches(heldout, batch_size=batch_size, num_batches=batches)

    @torch.no_grad()
    def evaluate(self, params: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(mean loss in nats per token, bits per token) of the state tensors `params` on the held-out batches.

        For the byte-level model a token is a byte, so the second number is bits per byte.
        """
        load_state_tensors(self.model, params)
        saved = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            losses = [float(self.loss_fn(self.model, batch)) for batch in self.batches]
        finally:
            torch.set_num_threads(saved)
        loss = sum(losses) / len(losses)
        return loss, loss / math.log(2)
