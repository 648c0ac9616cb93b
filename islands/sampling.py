"""Sampling token ids from a trained :class:`~islands.model.ByteTransformer`.

The quickest look at what a run learned: feed a prompt, draw the next byte from the model's
distribution (optionally sharpened by a temperature below 1 or cut to the ``top_k`` likeliest), append
it, repeat. The context slides: once it is longer than the model's ``seq_len`` only the newest
``seq_len`` ids condition the next draw, as in training. Draws come from a local ``torch.Generator``,
so a seed gives the same text every time and the global torch RNG is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` ids drawn from ``model``; return only the new ids.

    Args:
        model: a :class:`~islands.model.ByteTransformer` (anything with ``cfg.seq_len``,
            ``cfg.vocab_size`` and ``forward(idx) -> logits (B, T, V)``). Evaluated in eval mode; its
            training flag is restored afterwards.
        prompt: at least one token id in ``[0, vocab_size)`` (for the byte model, ``list(text.encode())``).
        max_new_tokens: how many ids to draw, ``>= 0``.
        temperature: ``> 0`` divides the logits before the softmax (below 1 is sharper); ``0`` takes the
            likeliest id every time (greedy).
        top_k: draw only among the ``top_k`` likeliest ids (``1 <= top_k <= vocab_size``); None = all.
        seed: seed of the local generator the draws come from.
    """
    cfg = model.cfg
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("prompt is empty; give at least one token id (for text, e.g. list('def '.encode()))")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt holds id {bad[0]} outside [0, {cfg.vocab_size}); the model knows only those ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy, 1 = the model's own distribution)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= cfg.vocab_size):
        raise ValueError(f"top_k={top_k!r} must be None or an int in [1, {cfg.vocab_size}]")

    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(ids[-cfg.seq_len:][None])[0, -1].float().cpu()  # (V,): the next id's logits
            if temperature == 0 or top_k == 1:
                nxt = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, -math.inf)
                nxt = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
            ids = torch.cat([ids, torch.tensor([nxt], dtype=torch.long, device=device)])
    finally:
        model.train(was_training)
    return ids[len(prompt):].tolist()
