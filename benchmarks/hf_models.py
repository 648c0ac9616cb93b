"""Hugging Face models the benchmarks train through the engine's model factory (import path
``benchmarks.hf_models:NAME``, e.g. ``--model benchmarks.hf_models:llama_small``).

Built from a config with random weights: nothing is downloaded. The vocabulary is the byte corpus's
(256) and the context the ``tiny`` preset's window (128 tokens), so the stdlib corpus trains them as
it is. Importable from Ray workers when the repository root is on PYTHONPATH (the benchmark scripts
put it there); ``transformers`` is the ``hf`` extra.
"""

from __future__ import annotations

VOCAB = 256  # the byte corpus
SEQ = 128  # the tiny preset's window (config model.seq_len)


def llama_small():
    """A ~3.0M-parameter ``LlamaForCausalLM``: 4 layers, width 256, 8 heads over 4 KV heads (grouped-query
    attention), SwiGLU MLP of 688, RMSNorm, rotary positions, untied output head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False))
