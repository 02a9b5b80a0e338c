"""A plain Llama-architecture decoder in Hugging Face's conventions, so that importing and
exporting weights is a rename and never a permutation: RMSNorm (computed in fp32), SwiGLU
MLP (gate, up, down), rotary positions in the rotate-half convention (the two halves of each
head rotate together), grouped-query attention (each key/value head serves n_heads/n_kv_heads
query heads), a head size independent of d_model/n_heads, no biases, optionally tied
embeddings. Module names are HF's without its `model.` prefix (`embed_tokens`, `layers.N.
self_attn.q_proj`, ..., `norm`, `lm_head`)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.specs import LlamaSpec, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE's per-pair frequencies, scaled as `llama3` or `linear` say (Hugging Face's formulas)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"rope scaling {scaling.kind!r}: use llama3 or linear")
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """cos and sin of each position's angles, [seq, head_dim] (both halves alike), built once
    per (positions, dtype, device) and kept in a plain dict, not a buffer: nothing for a
    meta-device build, a pipeline cut or a checkpoint to carry, and no host-to-device copy
    per call. The model's layers share one dict (`tables`), so a rank holds one table per
    length, not one per layer (2·s·head_dim elements each: 64 MiB a layer for Llama-3 8B at
    128k tokens in bf16). Under `torch.compile` the tables are traced and fused instead."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, tables: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {} if tables is None else tables

    def forward(self, n: int, device: torch.device, dtype: torch.dtype, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of the n tokens at `positions(n, device)` (a module's own `positions`:
        context parallelism replaces it, so the function is part of the key)."""
        if torch.compiler.is_compiling():
            return self._table(positions(n, device), dtype)
        key = (self.head_dim, self.theta, self.scaling, n, dtype, device, getattr(positions, "__func__", positions))
        if key not in self._tables:
            self._tables[key] = self._table(positions(n, device), dtype)
        return self._tables[key]

    def _table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(positions.device)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [seq, head_dim]."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention with rotary positions. It takes its positions from the
    sequence it sees (0..s-1: under sequence parallelism the attention region sees the whole
    sequence), so a block is a function of one tensor, as the strategies drive blocks."""

    def __init__(self, spec: LlamaSpec, rope_tables: dict | None = None):
        super().__init__()
        d, hd = spec.d_model, spec.head_size
        self.head_dim = hd
        self.n_heads, self.n_kv_heads = spec.n_heads, spec.kv_heads
        self.rotary = Rotary(hd, spec.rope_theta, spec.rope_scaling, rope_tables)
        self.q_proj = nn.Linear(d, spec.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, spec.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, spec.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(spec.n_heads * hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cos, sin = self.rotary(s, x.device, x.dtype, self.positions)
        # However many heads the projections give (a tensor-parallel plan keeps whole groups).
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                      self.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def positions(self, n: int, device) -> torch.Tensor:
        """The positions of the n tokens this attention sees: 0..n−1 (context parallelism
        gives each rank's tokens their global ones)."""
        return torch.arange(n, device=device)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core (what selective recomputation recomputes, and context
        parallelism replaces): q [batch, heads, seq, head_dim], k and v with their own
        (fewer) key/value heads, each serving consecutive query heads."""
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.d_model, spec.ffn_dim, bias=False)
        self.up_proj = nn.Linear(spec.d_model, spec.ffn_dim, bias=False)
        self.down_proj = nn.Linear(spec.ffn_dim, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: LlamaSpec, rope_tables: dict | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.self_attn = Attention(spec, rope_tables)
        self.post_attention_layernorm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Token ids [batch, seq] in, logits [batch, seq, vocab] out."""

    def __init__(self, spec: LlamaSpec, vocab_size: int):
        super().__init__()
        if spec.n_heads % spec.kv_heads:
            raise ValueError(f"n_kv_heads {spec.kv_heads} does not divide n_heads {spec.n_heads}")
        self.spec, self.vocab_size = spec, vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, spec.d_model, padding_idx=spec.pad_token_id)
        rope_tables: dict = {}  # one RoPE table per length for every layer (`Rotary`)
        self.layers = nn.ModuleList(Block(spec, rope_tables) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.d_model, vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))
