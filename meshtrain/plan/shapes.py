"""Transformer shapes the planner reasons about, and their exact parameter counts: pure
arithmetic, no torch, so that a 405B model is planned in microseconds.

Three families. `gpt`: learned positions, LayerNorm with biases, a 4h MLP with GELU — as
meshtrain's own GPT builds it (a key projection without bias, an untied head) or as the
Megatron papers count it (biased projections, the head tied to the embedding, `paper=True`
in `megatron_params`). `llama`: RMSNorm without bias, SwiGLU with three matrices of width
`ffn`, grouped-query attention (`kv_heads` key/value heads of h/heads each), no biases,
rotary positions (no parameters), untied embeddings. `moe`: the Llama's block (with
Qwen3's per-head or OLMoE's whole-projection RMSNorm on queries and keys, `qk_norm`) whose
MLP is, in every layer but `dense_layers` (a SwiGLU of `ffn`), a mixture of experts — a
router [E, h], E SwiGLU experts of width `expert_ffn` of which each token takes `top_k`,
and optionally a shared SwiGLU of width `shared_ffn` every token passes through."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int  # the positions a GPT learns; the default sequence length of a plan
    kind: str = "gpt"  # or "llama", "moe"
    kv_heads: int | None = None  # llama, moe: grouped-query attention; None: as many as heads
    ffn: int | None = None  # MLP width (a MoE's dense layers'); None: 4·hidden
    head_dim: int | None = None  # llama, moe: a head size other than hidden/heads
    # moe: the experts of each MoE layer, the k each token takes and their SwiGLU width; the
    # layers that keep a dense MLP; a shared expert's width (0: none); "head" | "projection"
    # | "none" RMSNorm on queries and keys; the top-k weights renormalised; the rows each
    # auxiliary balancing loss is taken over (0: no auxiliary loss, as under bias balancing)
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    dense_layers: tuple[int, ...] = ()
    shared_ffn: int = 0
    qk_norm: str = "none"
    norm_topk: bool = True
    aux_rows: int = 1
    capacity: float | None = None  # moe: each expert's capacity factor per sequence (None: dropless)
    tied: bool = False  # llama, moe: the head is the embedding (one matrix)

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of the query projection (and the attention's output): heads × head dimension."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of the key (and value) projection: kv_heads × head dimension."""
        return (self.kv_heads or self.heads) * self.head_size

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has a mixture of experts (else a dense MLP)."""
        flags = self._moe_flags
        return flags[layer] if 0 <= layer < len(flags) else self._has_experts(layer)

    def _has_experts(self, layer: int) -> bool:
        return self.kind == "moe" and layer not in self.dense_layers

    @cached_property
    def first_moe_layer(self) -> int:
        """The first block with a mixture of experts (0 where none has one): a MoE's repeated block."""
        return next((i for i, moe in enumerate(self._moe_flags) if moe), 0)

    @cached_property  # the sums over layers are kept: a search asks for them per layout and stage
    def moe_layers(self) -> int:
        return sum(self._moe_flags)

    @cached_property  # asked for millions of times in a search
    def _moe_flags(self) -> tuple[bool, ...]:
        return tuple(map(self._has_experts, range(self.layers)))

    @cached_property
    def first_dense_layer(self) -> int | None:
        """The first block with a dense MLP (None where every block has experts)."""
        return next((i for i, moe in enumerate(self._moe_flags) if not moe), None)

    def moe_in(self, layers) -> int:
        """How many of the blocks `layers` (indices) have a mixture of experts."""
        return sum(map(self._moe_flags.__getitem__, layers))

    def qk_norm_params(self) -> int:
        """The q/k RMSNorms' weights: per head (head_dim each) or per projection."""
        if self.kind != "moe" or self.qk_norm == "none":
            return 0
        return 2 * self.head_size if self.qk_norm == "head" else self.q_width + self.kv_width

    def attention_params(self) -> int:
        """A Llama-kind block's attention and its two RMSNorms: q, o; k, v; q/k norms."""
        h = self.hidden
        return 2 * h * self.q_width + 2 * h * self.kv_width + 2 * h + self.qk_norm_params()

    def expert_params(self) -> int:
        """One MoE layer's experts: E SwiGLUs, 3·E·h·I (the router and shared expert apart)."""
        return 3 * self.experts * self.hidden * self.expert_ffn

    def mlp_params(self, layer: int) -> int:
        """Block `layer`'s MLP: a SwiGLU of `ffn` (dense), or the router, the experts and the
        shared expert (MoE)."""
        h = self.hidden
        if self.is_moe(layer):
            return self.experts * h + self.expert_params() + 3 * h * self.shared_ffn
        return 3 * h * self.ffn_width

    def block_params(self, layer: int) -> int:
        """Block `layer`'s parameters."""
        if self.kind == "moe":
            return self.attention_params() + self.mlp_params(layer)
        return self.layer_params()

    def layer_params(self) -> int:
        """One block's parameters (a MoE's: a MoE layer's, the repeated block)."""
        return self._layer_params

    @cached_property
    def _layer_params(self) -> int:
        h, f, kv = self.hidden, self.ffn_width, self.kv_width
        if self.kind == "moe":
            return self.block_params(self.first_moe_layer)
        if self.kind == "llama":
            q = self.heads * (self.head_dim or h // self.heads)
            return 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
        # meshtrain's GPT: q, v, proj with bias, k without; fc and proj with bias; two LayerNorms
        return 4 * h * h + 3 * h + 2 * h * f + f + h + 4 * h

    def layer_tensors(self, layer: int | None = None) -> int:
        """Block `layer`'s parameter tensors (each a tensor the optimizer steps on its own;
        None: a repeated block's, a MoE layer for the moe kind)."""
        if self.kind == "moe":
            moe = self.is_moe(layer) if layer is not None else self.moe_layers > 0
            mlp = (3 + (3 if self.shared_ffn else 0)) if moe else 3  # router, gate_up, down; shared's three
            return 6 + (2 if self.qk_norm != "none" else 0) + mlp  # q k v o, two norms
        return 9 if self.kind == "llama" else 15  # GPT: 2 norms × 2, q v proj fc proj × 2, k

    def outside_tensors(self, first: bool, last: bool) -> int:
        """Parameter tensors outside the blocks on a pipeline stage: the embedding (a GPT's
        token and position tables) on the first, the final norm and the head on the last."""
        embed, final = (1, 2) if self.kind != "gpt" else (2, 3)
        if self.tied and self.kind != "gpt":
            final = 1
        return (embed if first else 0) + (final if last else 0)

    def n_params(self) -> int:
        """Exactly what the model holds (meshtrain's GPT for `gpt`; Meta's checkpoints for
        `llama`; meshtrain's MoE, as Mixtral's, Qwen3-MoE's and OLMoE's checkpoints, for `moe`)."""
        return self._n_params

    @cached_property
    def _n_params(self) -> int:
        h, v = self.hidden, self.vocab
        if self.kind == "moe":
            blocks = sum(self.block_params(i) for i in range(self.layers))
            return blocks + (1 if self.tied else 2) * v * h + h  # embedding, head, final norm
        if self.kind == "llama":
            return self.layers * self.layer_params() + (1 if self.tied else 2) * v * h + h
        return self.layers * self.layer_params() + v * h + self.seq_len * h + 2 * h + v * h  # + untied head

    def active_params(self) -> int:
        """The parameters one token passes through: all of them, but in each MoE layer only
        its k experts of E (the router and the shared expert are every token's)."""
        idle = (self.experts - self.top_k) * 3 * self.hidden * self.expert_ffn
        return self.n_params() - self.moe_layers * idle


def megatron_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. (2021), §5.1: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) — biased
    projections, a 4h MLP, learned positions, the head tied to the embedding."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
