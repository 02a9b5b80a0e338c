"""Transformer shapes the planner reasons about, and their exact parameter counts: pure
arithmetic, no torch, so that a 405B model is planned in microseconds.

Two families. `gpt`: learned positions, LayerNorm with biases, a 4h MLP with GELU — as
meshtrain's own GPT builds it (a key projection without bias, an untied head) or as the
Megatron papers count it (biased projections, the head tied to the embedding, `paper=True`
in `megatron_params`). `llama`: RMSNorm without bias, SwiGLU with three matrices of width
`ffn`, grouped-query attention (`kv_heads` key/value heads of h/heads each), no biases,
rotary positions (no parameters), untied embeddings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int  # the positions a GPT learns; the default sequence length of a plan
    kind: str = "gpt"  # or "llama"
    kv_heads: int | None = None  # llama: grouped-query attention; None: as many as heads
    ffn: int | None = None  # MLP width; None: 4·hidden
    head_dim: int | None = None  # llama: a head size other than hidden/heads

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and value) projection: kv_heads × head dimension."""
        return (self.kv_heads or self.heads) * self.head_size

    def layer_params(self) -> int:
        """One block's parameters."""
        h, f, kv = self.hidden, self.ffn_width, self.kv_width
        if self.kind == "llama":
            q = self.heads * (self.head_dim or h // self.heads)
            return 2 * h * q + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
        # meshtrain's GPT: q, v, proj with bias, k without; fc and proj with bias; two LayerNorms
        return 4 * h * h + 3 * h + 2 * h * f + f + h + 4 * h

    def layer_tensors(self) -> int:
        """One block's parameter tensors (each a tensor the optimizer steps on its own)."""
        return 9 if self.kind == "llama" else 15  # GPT: 2 norms × 2, q v proj fc proj × 2, k

    def outside_tensors(self, first: bool, last: bool) -> int:
        """Parameter tensors outside the blocks on a pipeline stage: the embedding (a GPT's
        token and position tables) on the first, the final norm and the head on the last."""
        embed, final = (1, 2) if self.kind == "llama" else (2, 3)
        return (embed if first else 0) + (final if last else 0)

    def n_params(self) -> int:
        """Exactly what the model holds (meshtrain's GPT for `gpt`, Meta's checkpoints for `llama`)."""
        h, v = self.hidden, self.vocab
        if self.kind == "llama":
            return self.layers * self.layer_params() + 2 * v * h + h  # embedding, head, final norm
        return self.layers * self.layer_params() + v * h + self.seq_len * h + 2 * h + v * h  # + untied head


def megatron_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. (2021), §5.1: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) — biased
    projections, a 4h MLP, learned positions, the head tied to the embedding."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def __getattr__(name: str):
    """Old import paths: the published shapes and the presets' shapes are the model families'
    recipes' (`meshtrain.recipes`): one registry of model shapes."""
    if name in ("PUBLISHED", "shape_of"):
        import meshtrain.recipes as recipes
        return recipes.published_shapes() if name == "PUBLISHED" else recipes.shape_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
