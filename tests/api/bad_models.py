"""Model factories, losses and optimizers that are wrong on purpose, importable by path (tests.api.bad_models:NAME).

Each stands for a mistake a user makes with `diloco train --model/--loss/--optimizer` or the Python API;
tests/api/test_bad_input.py checks that each is refused in one line, before Ray starts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NOT_CALLABLE = 3
"""An import path that names a value, not a function."""


class TinyLM(nn.Module):
    """A small causal LM over `vocab` token ids: embedding then a linear head (logits (B, T, vocab))."""

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))  # (B, T, vocab)


def tiny_lm() -> TinyLM:
    """A model that trains on the byte corpus: the good factory the bad losses and optimizers go with."""
    return TinyLM()


def returns_dict() -> dict:
    """Returns the model's configuration instead of the model."""
    return {"vocab": 256, "d_model": 16}


def raises() -> nn.Module:
    """Fails while building, as a factory with a bug does."""
    raise RuntimeError("checkpoint weights.pt not found")


def needs_arguments(vocab: int) -> TinyLM:
    """Takes an argument the engine never passes (factories are called with none)."""
    return TinyLM(vocab)


def frozen() -> TinyLM:
    """Every parameter frozen: nothing to train."""
    model = TinyLM()
    model.requires_grad_(False)
    return model


def small_vocab() -> TinyLM:
    """An embedding of 100 rows: the byte corpus holds ids up to 255."""
    return TinyLM(vocab=100)


def image_model() -> nn.Module:
    """A model of images: token batches do not fit its input."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def vector_loss(model: nn.Module, batch) -> torch.Tensor:
    """Per-example losses, not reduced to one number."""
    inputs, targets = batch
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)  # (B,)


def float_loss(model: nn.Module, batch) -> float:
    """A Python float: no gradient can flow."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).item()


def not_an_optimizer(parameters) -> dict:
    """Returns optimizer settings instead of an optimizer."""
    return {"lr": 1e-3}


class ScaledLM(TinyLM):
    """TinyLM with a learned 0-dim output scale: FSDP cannot cut it along dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


def scaled_lm() -> ScaledLM:
    """A model with a 0-dim parameter, fine unsharded, refused for a pool with shard: fsdp."""
    return ScaledLM()
