"""Small models of the kinds users bring, importable by path from island processes (tests.api.zoo:NAME).

Built from configs with random weights: nothing is downloaded. The Hugging Face models need the `hf` extra
(transformers); the CNN is plain torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256  # the byte corpus
SEQ = 32  # the nano preset's window


def tiny_gpt2(vocab: int = VOCAB):
    """GPT-2 with its output head tied to the token embedding (one Parameter, two names)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


BPE_VOCAB = 512  # a tokenizer trained on the corpus (data.tokenizer: train)


def tiny_gpt2_bpe():
    """tiny_gpt2 for a run whose text goes through a BPE of BPE_VOCAB ids; by path, so sample and resume rebuild it."""
    return tiny_gpt2(BPE_VOCAB)


def tiny_llama():
    """Llama (RMSNorm, rotary positions held in a non-persistent buffer, grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=0))


class SmallCNN(nn.Module):
    """A classifier with BatchNorm: running statistics are buffers the engine must carry (docs/models.md)."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(images)))  # (B, 8, H, W)
        return self.head(x.mean(dim=(2, 3)))  # (B, classes)


def small_cnn() -> SmallCNN:
    return SmallCNN()


def cnn_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """The user's own loss: cross-entropy of the class logits against the labels of a dict batch."""
    return F.cross_entropy(model(batch["image"]), batch["label"])


class Shapes(torch.utils.data.Dataset):
    """A map-style dataset of 8x8 images of four classes (which quadrant is bright), each example with its id."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.noise = torch.randn(n, 1, 8, 8, generator=g) * 0.3

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        label = int(self.labels[i])
        image = self.noise[i].clone()
        r, c = divmod(label, 2)
        image[:, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] += 1.5
        return {"image": image, "label": torch.tensor(label), "id": torch.tensor(i)}


class IdLog:
    """A loss that also writes the ids of every batch it trains on, one line per step, to DIR/ids-<pid>.log.

    The id log is the ground truth an exact-resume test checks the engine's data cursors against: each
    island process (each incarnation) writes its own file, in step order.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, model: nn.Module, batch: dict) -> torch.Tensor:
        import os

        if model.training:  # evaluation batches are not training data
            with open(os.path.join(self.directory, f"ids-{os.getpid()}.log"), "a") as f:
                f.write(" ".join(str(int(i)) for i in batch["id"]) + "\n")
        return cnn_loss(model, batch)
