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


@dataclass(frozen=True)
class LlamaSpec:
    """A Llama-architecture decoder: RMSNorm, SwiGLU, rotary positions, grouped-query
    attention. `n_kv_heads` divides `n_heads` (None: as many); `head_dim` defaults to
    d_model / n_heads; `ffn_dim` is the SwiGLU width."""
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
    kind: str = "llama"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class MLPSpec:
    hidden: tuple[int, ...]
    kind: str = "mlp"
