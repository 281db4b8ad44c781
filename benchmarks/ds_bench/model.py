"""The benchmark's model and data: a small GPT-style transformer trained on synthetic tokens.

Only ``torch.nn`` is used, so the model needs no extra package. Every rank builds the same initial
weights (one seed) and draws its own micro-batches from a generator keyed by (rank, step, micro-batch),
so each way of driving the engine sees exactly the same data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """Shape of the transformer and of one micro-batch."""

    vocab: int = 2048
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    seq_len: int = 64
    micro_batch: int = 2

    def as_dict(self) -> dict:
        return asdict(self)


#: The size used by a full run: about 4.2 million parameters.
FULL = ModelSize()
#: The size used by ``--quick`` and by the tests: a few thousand parameters, milliseconds a step.
TINY = ModelSize(vocab=64, d_model=16, n_heads=2, n_layers=1, d_ff=32, seq_len=8, micro_batch=2)


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention.

    Attention is written with ``nn.Linear`` layers (not ``nn.MultiheadAttention``, whose forward reads
    ``out_proj.weight`` without calling ``out_proj``) so ZeRO-3 gathers every parameter through its
    module hooks.
    """

    def __init__(self, size: ModelSize):
        super().__init__()
        self.n_heads = size.n_heads
        self.ln1 = nn.LayerNorm(size.d_model)
        self.qkv = nn.Linear(size.d_model, 3 * size.d_model)
        self.proj = nn.Linear(size.d_model, size.d_model)
        self.ln2 = nn.LayerNorm(size.d_model)
        self.mlp = nn.Sequential(nn.Linear(size.d_model, size.d_ff), nn.GELU(), nn.Linear(size.d_ff, size.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(h.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A causal language model whose forward returns the mean cross-entropy of next-token prediction."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.size = size
        self.tok = nn.Embedding(size.vocab, size.d_model)
        self.pos = nn.Embedding(size.seq_len, size.d_model)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.n_layers))
        self.ln_f = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        length = inputs.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.tok(inputs) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_model(size: ModelSize, seed: int = 1234) -> TinyGPT:
    """The same initial weights on every rank and in every trial."""
    torch.manual_seed(seed)
    return TinyGPT(size)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def micro_batches(size: ModelSize, rank: int, steps: int, n_micro: int, seed: int = 4321) -> list:
    """``steps`` logical steps of ``n_micro`` token batches each, for one rank, as CPU tensors."""
    batches = []
    for step in range(steps):
        row = []
        for micro in range(n_micro):
            gen = torch.Generator().manual_seed(seed + 1_000_003 * rank + 10_007 * step + micro)
            row.append(torch.randint(0, size.vocab, (size.micro_batch, size.seq_len + 1), generator=gen))
        batches.append(row)
    return batches
