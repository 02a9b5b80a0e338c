"""Named model sizes. Pure data (no torch import) so that the command line can validate a
layout against the model before any process starts."""

from dataclasses import dataclass, replace


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


PRESETS: dict[str, GPTSpec | LlamaSpec | MLPSpec] = {
    # ~0.1M parameters with the byte tokenizer: for tests and quick checks.
    "gpt-tiny": GPTSpec(n_layers=2, n_heads=4, d_model=64, max_seq_len=256),
    # The strategies' test preset: 8 blocks to cut into pipeline stages, 4 heads to split, tiny
    # widths (~0.1M parameters with the byte tokenizer), so a multi-rank test runs in seconds.
    "gpt-test": GPTSpec(n_layers=8, n_heads=4, d_model=32, max_seq_len=64),
    # ~6.8M parameters with the default 2048-token BPE vocabulary: the default model.
    "gpt-small": GPTSpec(n_layers=8, n_heads=8, d_model=256, max_seq_len=512),
    # GPT-2 small's shape, sized for a GPU: 124M parameters at GPT-2's 50257-token vocabulary
    # (with an untied head, 163M); 89M at the default 2048-token BPE vocabulary.
    "gpt2": GPTSpec(n_layers=12, n_heads=12, d_model=768, max_seq_len=1024),
    # Llama-shaped: the suite's (8 blocks to cut, 4 query heads sharing 2 key/value heads, a head
    # size other than d/h; ~0.1M parameters with the byte tokenizer) and one trainable here
    # (~7M at the default 2048-token vocabulary, gpt-small's size).
    "llama-test": LlamaSpec(n_layers=8, n_heads=4, n_kv_heads=2, d_model=32, head_dim=12, ffn_dim=64, max_seq_len=64),
    "llama-small": LlamaSpec(n_layers=8, n_heads=8, n_kv_heads=4, d_model=256, ffn_dim=704, max_seq_len=512),
    # The classic data-parallel example: Linear+ReLU layers on 8x8 digits.
    "mlp": MLPSpec(hidden=(128, 128, 128)),
}


def parse_widths(text: str) -> tuple[int, ...]:
    """'1024,1024' -> (1024, 1024); ValueError unless positive integers."""
    widths = tuple(int(w) for w in text.split(","))
    if not widths or min(widths) < 1:
        raise ValueError(text)
    return widths


def spec_of(name: str, mlp_hidden: str = "") -> GPTSpec | MLPSpec:
    """The preset `name`, with the MLP's hidden widths replaced when `mlp_hidden` gives them."""
    spec = PRESETS[name]
    return replace(spec, hidden=parse_widths(mlp_hidden)) if mlp_hidden else spec
