"""The byte-level GPT that the demo and the experiment train: small enough for hundreds to
thousands of steps on CPU cores in minutes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """A GPT over bytes (vocabulary 256) reading ``context`` bytes at a time.

    The head is not tied to the embedding: safetensors refuses to save shared tensors.
    """

    def __init__(self, dim: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, sequences: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) over sequences of ``context + 1`` bytes."""
    logits = model(sequences[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), sequences[:, 1:].reshape(-1))
