"""Held-out evaluation of the global parameters: the same fixed windows every time."""

from __future__ import annotations

import math

import numpy as np
import torch

from islands.data import heldout_batches
from islands.model import ModelConfig, build_model
from islands.model_api import LossFn, default_loss


class Evaluator:
    """Loads global parameters into a private model and measures held-out loss and bits per byte."""

    def __init__(self, model_config: ModelConfig, heldout: np.ndarray, *, batches: int, batch_size: int,
                 loss_fn: LossFn = default_loss) -> None:
        """`loss_fn(model, (x, y))` is the loss measured (islands/model_api.py; default: cross-entropy)."""
        self.loss_fn = loss_fn
        self.model = build_model(model_config, seed=0)
        self.model.eval()
        self.batches = heldout_batches(heldout, seq_len=model_config.seq_len, batch_size=batch_size, num_batches=batches)

    @torch.no_grad()
    def evaluate(self, params: dict[str, torch.Tensor]) -> tuple[float, float]:
        """(mean cross-entropy in nats per token, bits per token) of `params` on the held-out windows.

        For the byte-level model a token is a byte, so the second number is bits per byte.
        """
        named = dict(self.model.named_parameters())
        missing = set(named) - set(params)
        if missing:
            raise ValueError(f"global parameters lack {sorted(missing)[:3]}; they do not belong to this model")
        for name, p in named.items():
            p.copy_(params[name])
        losses = [float(self.loss_fn(self.model, (x, y))) for x, y in self.batches]
        loss = sum(losses) / len(losses)
        return loss, loss / math.log(2)
