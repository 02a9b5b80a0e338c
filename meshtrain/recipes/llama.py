"""meshtrain's Llama (`models/llama.py`) as a recipe: its presets and the published Llama 2
and 3 shapes, Hugging Face's initialisation, its tensor-parallel and pipeline plans, what a
layout must divide, and the planner's shape. (Its Hugging Face name map and config mapping
are still `models/hf.py`'s.)"""

from __future__ import annotations

from meshtrain.models.specs import LlamaSpec
from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.styles import COLUMN, REGION, ROW, VOCAB, Heads, TensorPlan
from meshtrain.plan.shapes import Shape
from meshtrain.recipes.family import Family

PRESETS = {
    # The suite's (8 blocks to cut, 4 query heads sharing 2 key/value heads, a head size other
    # than d/h; ~0.1M parameters with the byte tokenizer) and one trainable here (~7M at the
    # default 2048-token vocabulary, gpt-small's size).
    "llama-test": LlamaSpec(n_layers=8, n_heads=4, n_kv_heads=2, d_model=32, head_dim=12, ffn_dim=64, max_seq_len=64),
    "llama-small": LlamaSpec(n_layers=8, n_heads=8, n_kv_heads=4, d_model=256, ffn_dim=704, max_seq_len=512),
}


def _published(layers, hidden, heads, vocab, seq_len, kv_heads, ffn, rope_theta=10000.0):
    return LlamaSpec(n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, d_model=hidden, ffn_dim=ffn,
                     max_seq_len=seq_len, rope_theta=rope_theta), vocab


# The released checkpoints' config files: Llama 2's RoPE base 10,000, Llama 3's 500,000 (3.1's
# llama3 scaling is left to the weights' own config.json).
PUBLISHED = {
    "llama2-7b": _published(32, 4096, 32, 32000, 4096, kv_heads=32, ffn=11008),
    "llama2-13b": _published(40, 5120, 40, 32000, 4096, kv_heads=40, ffn=13824),
    "llama2-70b": _published(80, 8192, 64, 32000, 4096, kv_heads=8, ffn=28672),
    "llama3-8b": _published(32, 4096, 32, 128256, 8192, kv_heads=8, ffn=14336, rope_theta=500000.0),
    "llama3-70b": _published(80, 8192, 64, 128256, 8192, kv_heads=8, ffn=28672, rope_theta=500000.0),
    "llama3-405b": _published(126, 16384, 128, 128256, 8192, kv_heads=8, ffn=53248, rope_theta=500000.0),
}



def published_llamas() -> list[str]:
    return list(PUBLISHED)


def published_llama(name: str) -> tuple[LlamaSpec, int]:
    """(spec, vocabulary) of a published Llama shape."""
    return PUBLISHED[name]


# q, k and v by columns (whole key/value heads per rank, so each rank's query heads find their
# group's keys: n_kv_heads divisible by tp), o by rows; gate and up by columns, down by rows;
# the embedding and the head by vocabulary. Under SP the attention region gathers the whole
# sequence, so rotary positions are the global ones.
TP_PLAN = TensorPlan({
    "embed_tokens": VOCAB,
    "layers.*.self_attn": (REGION, Heads("n_heads", "n_kv_heads")),
    "layers.*.self_attn.[qkv]_proj": COLUMN,
    "layers.*.self_attn.o_proj": ROW,
    "layers.*.mlp": REGION,
    "layers.*.mlp.gate_proj": COLUMN,
    "layers.*.mlp.up_proj": COLUMN,
    "layers.*.mlp.down_proj": ROW,
    "lm_head": (REGION, COLUMN),
}, vocab_parallel_loss=True)


def pipeline_plan(d_model: int) -> PipelinePlan:
    """The token embedding on the first stage, the final norm and head on the last."""
    return PipelinePlan(("embed_tokens",), "layers", ("norm", "lm_head"), lambda b, s: (b, s, d_model))


def init_rules(model) -> dict:
    """Hugging Face's Llama initialisation: every matrix N(0, 0.02) (its initializer_range),
    RMSNorm weights 1. A tied head is the embedding (one parameter, one name)."""
    return {name: ("normal", 0.02) if p.dim() >= 2 else ("ones",) for name, p in model.named_parameters()}


class LlamaFamily(Family):
    name, spec_type, presets, published, hf_folders = "llama", LlamaSpec, PRESETS, PUBLISHED, True

    def build(self, spec: LlamaSpec, *, vocab_size: int = 256, **_):
        from meshtrain.models.llama import Llama  # torch: only when a model is built
        return Llama(spec, vocab_size)

    def owns(self, model) -> bool:
        from meshtrain.models.llama import Llama  # torch: only for a built model
        return isinstance(model, Llama)

    def init_rules(self, model) -> dict:
        return init_rules(model)

    def tp_plan(self, spec: LlamaSpec) -> TensorPlan:
        return TP_PLAN

    def pipeline_plan(self, spec: LlamaSpec) -> PipelinePlan:
        return pipeline_plan(spec.d_model)

    def blocks(self, spec: LlamaSpec) -> int:
        return spec.n_layers

    def tp_splits(self, spec: LlamaSpec, vocab_size: int) -> list[tuple[int, str]]:
        # whole key/value heads per rank, so every query head finds its group's
        return [(spec.n_heads, "query heads"), (spec.kv_heads, "key/value heads"), (spec.ffn_dim, "MLP width"),
                (vocab_size, "vocabulary (--vocab-size)")]

    def attention_heads(self, spec: LlamaSpec) -> list[tuple[str, int]]:
        return [("heads", spec.n_heads), ("kv heads", spec.kv_heads)]

    def pipeline_problem(self, spec: LlamaSpec) -> str | None:
        if spec.tie_embeddings:
            return "ties its head to its embedding, which pp would put on two stages; use --pp 1"
        return None

    def shape(self, spec: LlamaSpec, vocab_size: int) -> Shape:
        head_dim = spec.head_size if spec.head_size * spec.n_heads != spec.d_model else None
        return Shape(spec.n_layers, spec.d_model, spec.n_heads, vocab_size, spec.max_seq_len, "llama",
                     kv_heads=spec.kv_heads, ffn=spec.ffn_dim, head_dim=head_dim)


FAMILY = LlamaFamily()
