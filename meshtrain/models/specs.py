"""The models' constructor arguments: plain frozen dataclasses (no torch), so that the
command line and the planner read a model's shape before torch is loaded. The named sizes
(presets) live in each family's recipe (`meshtrain.recipes`)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTSpec:
    n_layers: int
    n_heads: int
    d_model: int
    max_seq_len: int
    dropout: float = 0.0
    attention: str = "sdpa"  # or "math": the score matrix materialised, as in the papers
    kind: str = "gpt"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `llama3` (Llama 3.1-3.3: long wavelengths divided by `factor`,
    short ones kept, a smooth blend between) or `linear` (every frequency divided by `factor`)."""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class GroupedHeads:
    """The head sizes of grouped-query attention, for a spec with `n_heads`, `n_kv_heads`
    (None: as many), `head_dim` (None: d_model / n_heads) and `d_model`."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class LlamaSpec(GroupedHeads):
    """A Llama-architecture decoder: RMSNorm, SwiGLU, rotary positions, grouped-query
    attention. `n_kv_heads` divides `n_heads` (None: as many); `head_dim` defaults to
    d_model / n_heads; `ffn_dim` is the SwiGLU width. `pad_token_id`: the embedding row the
    lookup gives no gradient (`nn.Embedding`'s `padding_idx`, as transformers builds it from
    config.json; negative counts from the end; None: none)."""
    n_layers: int
    n_heads: int
    d_model: int
    max_seq_len: int
    ffn_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    pad_token_id: int | None = None
    kind: str = "llama"


@dataclass(frozen=True)
class MLPSpec:
    hidden: tuple[int, ...]
    kind: str = "mlp"


@dataclass(frozen=True)
class MoESpec(GroupedHeads):
    """A Llama-shaped decoder whose MLP is a mixture of experts in every layer but
    `dense_layers` (those keep a SwiGLU MLP of `ffn_dim`): a linear router scoring
    `n_experts` experts (`score`: "softmax" or "sigmoid", in fp32), each token sent to its
    `top_k` best (dropless), their outputs weighted by the scores (renormalised over the
    top-k when `norm_topk`); each expert a SwiGLU of `expert_ffn_dim`; `shared_ffn_dim` > 0
    adds a SwiGLU every token passes through (DeepSeek's shared experts, fused).
    `qk_norm`: RMSNorm on queries and keys, "head" (Qwen3: per head) or "projection" (OLMoE:
    over the whole projection), or "none". `routing`: "learned", or "balanced" (token i of
    a forward sent to experts i·k .. i·k+k−1 mod E, its weights still the router's: a
    deterministic load for benchmarks and planner checks). `balance`: how the load is
    balanced — "sequence" (DeepSeek-V3's sequence-wise auxiliary loss, per row), "batch"
    (Switch/GShard's, per group of `balance_rows` rows), "bias" (DeepSeek-V3's
    auxiliary-loss-free bias, moved by `bias_rate` after each optimizer step) or "none";
    `aux_coef` weighs the auxiliary loss (per token, as the cross-entropy is). `experts`:
    "grouped" (`torch.nn.functional.grouped_mm`, where its 16-byte stride rule allows) or
    "loop" (one matmul per expert). `capacity`: F, each expert taking at most ⌈F·s·k/E⌉
    of a sequence's s·k choices (the highest-weighted first; the others dropped, as
    Megatron's and DeepSpeed's capacity factor drops them); None: dropless.
    `pad_token_id`: the embedding row the lookup gives no gradient, as `LlamaSpec`'s."""
    n_layers: int
    n_heads: int
    d_model: int
    max_seq_len: int
    ffn_dim: int
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    pad_token_id: int | None = None
    dense_layers: tuple[int, ...] = ()
    shared_ffn_dim: int = 0
    score: str = "softmax"
    norm_topk: bool = True
    qk_norm: str = "none"
    routing: str = "learned"
    balance: str = "sequence"
    aux_coef: float = 1e-3
    balance_rows: int = 1
    bias_rate: float = 1e-3
    experts: str = "grouped"
    capacity: float | None = None
    kind: str = "moe"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)
