"""Sampling token ids from a trained causal language model: the built-in ByteTransformer or a user's.

The quickest look at what a run learned: feed a prompt, draw the next token from the model's
distribution (optionally sharpened by a temperature below 1 or cut to the ``top_k`` likeliest), append
it, repeat. The context slides: once it is longer than the model's context window
(:func:`context_window`) only the newest ids condition the next draw, as in training. Draws come from
a local ``torch.Generator``, so a seed gives the same text every time and the global torch RNG is left
alone.

Any causal LM works: ``model(ids)`` (ids ``(1, T)``) must give ``(1, T, V)`` logits, as a tensor or as
the ``logits`` field of its output (a Hugging Face ``ModelOutput``; islands.model_api.logits_of).
:func:`check_causal_lm` refuses anything else in one line (an image classifier, say). Text goes in
and out through an encoder with ``encode(str) -> list[int]`` and ``decode(ids) -> str``:
:class:`ByteText` (UTF-8 bytes, vocabulary 256) unless the run used a tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from islands.model_api import ModelError, logits_of

__all__ = ["ByteText", "TextCodec", "check_causal_lm", "context_window", "generate", "sample_text", "vocab_size"]


class TextCodec(Protocol):
    """What sampling needs of a tokenizer: text to ids and back (islands.tokenizer's encoders fit)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteText:
    """Text as UTF-8 bytes, token id i being byte i (vocabulary 256): the byte corpora's encoding, the default."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of byte ids; an invalid UTF-8 sequence (a cut multi-byte character) becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")


def _config_int(model: nn.Module, *names: str) -> int | None:
    """The first positive int among `names` on the model's built-in `cfg` or its Hugging Face `config`."""
    for holder in (getattr(model, "cfg", None), getattr(model, "config", None)):
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_window(model: nn.Module, default: int | None = None) -> int:
    """How many ids the model can condition on: the built-in model's ``cfg.seq_len``, a Hugging Face
    config's ``n_positions`` or ``max_position_embeddings``, else `default` (the run's ``model.seq_len``)."""
    found = _config_int(model, "seq_len", "n_positions", "max_position_embeddings")
    if found is None and default is None:
        raise ValueError(f"cannot tell the context window of a {type(model).__name__}; pass context=N "
                         "(the run's model.seq_len)")
    return found if found is not None else int(default)  # type: ignore[arg-type]


def vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary from its built-in ``cfg`` or Hugging Face ``config``; None when it has neither."""
    return _config_int(model, "vocab_size")


@torch.no_grad()
def check_causal_lm(model: nn.Module) -> int:
    """The size of the logits' last dimension if `model` maps token ids (1, T) to (1, T, V) logits; else a
    one-line ModelError (the model is not a causal language model, so it cannot continue text)."""
    device = next(model.parameters()).device
    probe = torch.zeros((1, 2), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        logits = logits_of(model(probe))
    except Exception as err:  # noqa: BLE001 - whatever a non-LM raises on token ids, the answer is one line
        raise ModelError(f"{type(model).__name__} is not a causal language model (on token ids (1, T) it raised "
                         f"{type(err).__name__}); only a model that maps ids to (1, T, vocab) logits can "
                         "continue text") from None
    finally:
        model.train(was_training)
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (1, 2):
        raise ModelError(f"{type(model).__name__} is not a causal language model (on token ids (1, 2) it gave "
                         f"logits of shape {tuple(logits.shape)}, not (1, 2, vocab)); only such a model can "
                         "continue text")
    return int(logits.shape[-1])


@torch.no_grad()
def generate(model: nn.Module, prompt: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, context: int | None = None) -> list[int]:
    """Continue ``prompt`` by ``max_new_tokens`` ids drawn from ``model``; return only the new ids.

    Args:
        model: a causal language model: ``model(ids)`` with ids ``(1, T)`` gives ``(1, T, V)`` logits, as a
            tensor (the built-in :class:`~islands.model.ByteTransformer`) or as its output's ``logits``
            (Hugging Face). Anything else is refused (:func:`check_causal_lm`). Evaluated in eval mode;
            its training flag is restored afterwards.
        prompt: at least one token id in ``[0, vocab_size)`` (for the byte model, ``list(text.encode())``).
        max_new_tokens: how many ids to draw, ``>= 0``.
        temperature: ``> 0`` divides the logits before the softmax (below 1 is sharper); ``0`` takes the
            likeliest id every time (greedy).
        top_k: draw only among the ``top_k`` likeliest ids (``1 <= top_k <= vocab_size``); None = all.
        seed: seed of the local generator the draws come from.
        context: the context window where the model does not say (:func:`context_window`): the run's
            ``model.seq_len``; the model's own ``seq_len``/``n_positions``/``max_position_embeddings`` win.
    """
    window = context_window(model, context)
    # The logits' width is the vocabulary actually sampled from; the config's value, where there is one,
    # is what the prompt is checked against (a Hugging Face head may be padded wider).
    width = check_causal_lm(model)
    vocab = vocab_size(model) or width
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise ValueError("prompt is empty; give at least one token id (for text, e.g. list('def '.encode()))")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt holds id {bad[0]} outside [0, {vocab}); the model knows only those ids")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 0")
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy, 1 = the model's own distribution)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k={top_k!r} must be None or an int in [1, {vocab}]")

    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            # (V,): the next id's logits; a head wider than the vocabulary never draws past it
            logits = logits_of(model(ids[-window:][None]))[0, -1, :vocab].float().cpu()
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


def sample_text(model: nn.Module, prompt: str, *, max_new_tokens: int, codec: Any = None, **kwargs: Any) -> str:
    """The prompt and its continuation as text: `prompt` encoded by `codec` (None: :class:`ByteText`),
    :func:`generate` with `kwargs` (temperature, top_k, seed, context), the whole decoded at once (so a
    character whose bytes straddle the prompt's end comes out whole)."""
    codec = codec if codec is not None else ByteText()
    ids = list(codec.encode(prompt))
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text to continue, e.g. 'def '")
    return codec.decode(ids + generate(model, ids, max_new_tokens=max_new_tokens, **kwargs))
