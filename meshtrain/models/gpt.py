"""A plain decoder-only transformer (GPT-2 shape): pre-LayerNorm blocks, causal attention
through `scaled_dot_product_attention`, GELU MLP, learned positions. Its structure is what
the strategies act on from outside: `embed`, `blocks`, `norm`, `head`. q, k and v are
separate linears so that a tensor-parallel plan can split them by heads."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.specs import GPTSpec


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, max_seq_len: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(idx) + self.pos(self.positions(idx.shape[1], idx.device)))

    def positions(self, n: int, device) -> torch.Tensor:
        """The positions of the n tokens: 0..n−1 (context parallelism gives each rank's
        tokens their global ones)."""
        return torch.arange(n, device=device)


class Attention(nn.Module):
    """Causal self-attention. `math` computes the score matrix, its softmax and dropout in
    plain operations (what the papers' activation counts assume); `sdpa` calls the fused
    `scaled_dot_product_attention`, which keeps only a log-sum-exp for backward. The fused
    kernel's own dropout draws from the global generator, which no layout can reproduce, so
    attention-probability dropout is applied on the `math` path only; the dropout of the
    attention's output (`drop`) applies on both."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, attention: str = "sdpa"):
        super().__init__()
        self.head_dim, self.attention, self.n_heads = d_model // n_heads, attention, n_heads
        self.q = nn.Linear(d_model, d_model)
        # No key bias: it adds the same amount to every score of a query, which softmax
        # ignores, so its gradient is zero up to rounding and Adam would amplify the rounding.
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # However many heads the projections give (a tensor-parallel plan keeps some of them).
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = self.core(q, k, v)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core, [batch, heads, seq, head_dim] in and out: what selective
        recomputation recomputes."""
        if self.attention == "math":
            T = q.shape[2]
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            return self.attn_drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1)) @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, spec: GPTSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.attn = Attention(spec.d_model, spec.n_heads, spec.dropout, spec.attention)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.mlp = MLP(spec.d_model, spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, spec: GPTSpec, vocab_size: int):
        super().__init__()
        self.spec, self.vocab_size = spec, vocab_size
        self.embed = Embedding(vocab_size, spec.d_model, spec.max_seq_len, spec.dropout)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.d_model)
        self.head = nn.Linear(spec.d_model, vocab_size, bias=False)
        # Its initial weights (GPT-2's) are drawn per parameter name by `build_model`:
        # meshtrain/recipes/gpt.py, `init_rules`.

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
