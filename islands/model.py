"""Byte-level decoder-only transformer language model, the model every island trains.

A GPT-2 shaped network small enough for CPUs: learned token and position embeddings,
pre-LayerNorm blocks (causal self-attention, then a GELU MLP), a final LayerNorm and an
untied output head. No dropout, so a forward pass is a pure function of parameters and input.

``build_model(cfg, seed=...)`` is the only constructor callers should use: it initializes every
parameter from a local ``torch.Generator``, so the same seed gives bitwise-equal replicas on every
island and the global torch RNG is neither read nor advanced.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from islands.model_api import default_loss, embedding_parameter_names
from islands.spec import PRESETS, ModelConfig, model_config

# PRESETS and model_config are re-exported: the shapes live in islands.spec (no torch), the model here.
__all__ = ["PRESETS", "Block", "ByteTransformer", "CausalSelfAttention", "MLP", "ModelConfig", "build_model",
           "count_parameters", "model_config"]

# GPT-2's init scale for weights; residual projections are scaled down further by depth.
INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v for all heads at once
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over ``x`` of shape (B, T, C); returns (B, T, C)."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads: (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear, GELU, Linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        return self.proj(F.gelu(self.fc(x)))  # (B, T, mlp_ratio*C) in between


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map (B, T, C) to (B, T, C)."""
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class ByteTransformer(nn.Module):
    """Decoder-only transformer LM over ``cfg.vocab_size`` token ids (bytes by default).

    Construct it with :func:`build_model`; ``__init__`` leaves PyTorch's default init, which
    draws from the global RNG.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Untied from tok_emb so every parameter tensor is its own fragment-able unit.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of shape (B, T, V) for token ids ``idx`` of shape (B, T)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"input length T={T} exceeds the model's seq_len={self.cfg.seq_len}; "
                f"crop the input or build the model with seq_len>={T}"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C) + (T, C) -> (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        # The output head runs in fp32 even under bf16 autocast (inner.precision): logits rounded to bf16
        # (8 bits of mantissa, steps of 0.125 at 16) blur low losses (tiny, 3000 steps on an H200: +0.41%
        # held-out loss against fp32 with a bf16 head, -0.25% with this one). Outside autocast: no change.
        with torch.autocast(x.device.type, enabled=False):
            return self.lm_head(x.float())  # (B, T, V)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar mean cross-entropy in nats of ``targets`` (B, T) given ``idx`` (B, T): the engine's default loss."""
        return default_loss(self, (idx, targets))

    def embedding_parameter_names(self) -> frozenset[str]:
        """Names (as in ``named_parameters()``) of the token and position embedding tables (both ``nn.Embedding``)."""
        return embedding_parameter_names(self)


def _init_parameters(model: ByteTransformer, generator: torch.Generator) -> None:
    """GPT-2 init, module by module in a fixed order, drawing only from ``generator``."""
    residual_std = INIT_STD / math.sqrt(2 * model.cfg.n_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, INIT_STD, generator=generator)
            elif isinstance(module, nn.Linear):
                # Each block adds two projections into the residual stream; scaling them keeps
                # the stream's variance from growing with depth (GPT-2).
                std = residual_std if name.endswith(".proj") else INIT_STD
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, *, seed: int) -> ByteTransformer:
    """Build a :class:`ByteTransformer` on CPU whose parameters depend only on ``cfg`` and ``seed``.

    Every parameter is then filled from a local ``torch.Generator`` seeded with ``seed``; the global
    torch RNG is left as it was. Move the result with ``.to(device)``.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"build_model seed={seed!r} must be a non-negative int; pass e.g. seed=0")
    # Built on the CPU, its default init thrown away, rather than on the meta device: meta-device init
    # runs through torch._refs, whose first call imports torch._dynamo (~1.5 s of CPU), which a driver
    # or a notebook kernel that never steps an optimizer would otherwise pay on every start.
    with torch.random.fork_rng(devices=[]):
        model = ByteTransformer(cfg)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    _init_parameters(model, generator)
    return model


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements in ``model`` (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters())
