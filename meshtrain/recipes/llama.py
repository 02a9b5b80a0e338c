"""meshtrain's Llama (`models/llama.py`) as a recipe: its presets and the published Llama 2
and 3 shapes, Hugging Face's initialisation, its tensor-parallel and pipeline plans, what a
layout must divide, the planner's shape, and its Hugging Face name map and `config.json`
mapping (the folders themselves are `meshtrain.hf`'s). What the model cannot represent
(biases, other RoPE types, partial rotary) is refused in one line naming the key."""

from __future__ import annotations

from meshtrain.models.specs import LlamaSpec, RopeScaling
from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.styles import COLUMN, REGION, ROW, VOCAB, Heads, TensorPlan
from meshtrain.plan.shapes import Shape
from meshtrain.recipes.family import Family, HFError

ROPE_TYPES = ("default", "llama3", "linear")

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


def flops_per_step(spec: LlamaSpec, vocab_size: int, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step: 2 per weight and token forward (q, k, v, o; gate, up,
    down; the head), the attention core 2·2·s·(h·head_dim) per token and layer, backward
    twice the forward."""
    d, hd, s = spec.d_model, spec.head_size, seq_len
    per_layer = d * hd * (2 * spec.n_heads + 2 * spec.kv_heads) + 3 * d * spec.ffn_dim
    forward = 2.0 * batch * s * (spec.n_layers * per_layer + d * vocab_size) + \
        4.0 * batch * s * s * spec.n_layers * spec.n_heads * hd
    return 3.0 * forward


def init_rules(model) -> dict:
    """Hugging Face's Llama initialisation: every matrix N(0, 0.02) (its initializer_range),
    RMSNorm weights 1, the embedding's padding row 0. A tied head is the embedding (one
    parameter, one name)."""
    return with_padding_row({name: ("normal", 0.02) if p.dim() >= 2 else ("ones",)
                             for name, p in model.named_parameters()}, model)


def with_padding_row(rules: dict, model) -> dict:
    """`rules` with the embedding's padding row (the spec's `pad_token_id`) drawn as zero, as
    transformers' `_init_weights` (and `nn.Embedding` itself) leave it."""
    pad = model.embed_tokens.padding_idx  # nn.Embedding's: a negative id counted from the end already
    if pad is None:
        return rules
    return rules | {"embed_tokens.weight": (*rules["embed_tokens.weight"], pad)}


def hf_name(name: str) -> str:
    """Hugging Face's names are ours under `model.`, but the head's."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name.removeprefix("model.")


def spec_from_config(config: dict, where: str = "config.json") -> tuple[LlamaSpec, int]:
    """(spec, vocabulary size) of a Hugging Face Llama `config.json`, in both the current
    (`rope_parameters`) and the older (`rope_theta`, `rope_scaling`) spellings."""
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HFError(f"{where}: {key} is true; meshtrain's Llama has no biases")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act {config['hidden_act']!r}; meshtrain's Llama uses silu (SwiGLU)")
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        vocab = int(config["vocab_size"])
        spec = LlamaSpec(n_layers=int(config["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv, d_model=d,
                         head_dim=int(config.get("head_dim") or d // heads),
                         ffn_dim=int(config["intermediate_size"]),
                         max_seq_len=int(config.get("max_position_embeddings", 2048)),
                         rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                         pad_token_id=pad_from_config(config, vocab, where), **rope_from_config(config, where))
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]}") from None
    if heads % kv:
        raise HFError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    return spec, vocab


def pad_from_config(config: dict, vocab: int, where: str) -> int | None:
    """The spec's `pad_token_id`: config.json's, the row transformers' embedding gives no
    gradient (`nn.Embedding(vocab, d, padding_idx=pad_token_id)`, in every family meshtrain
    reads). A negative id counts from the end, as nn.Embedding counts it (some configs on the
    Hub say -1); one outside the vocabulary is refused in one line."""
    pad = config.get("pad_token_id")
    if pad is None:
        return None
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        raise HFError(f"{where}: pad_token_id {pad!r} is outside the vocabulary of {vocab:,} tokens (vocab_size); "
                      f"set it to a token id below {vocab:,}, or null")
    return pad


def rope_from_config(config: dict, where: str, theta: float = 10000.0) -> dict:
    """The spec's `rope_theta` and `rope_scaling` of a `config.json`, in either spelling (what
    every family with RoPE reads alike); `theta`: the architecture's default base."""
    params = dict(config.get("rope_parameters") or {})
    if not params:  # the older spelling
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFError(f"{where}: rope_type {kind!r}; meshtrain implements {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{where}: partial_rotary_factor {params['partial_rotary_factor']}; meshtrain rotates whole heads")
    scaling = None
    if kind == "linear":
        scaling = RopeScaling("linear", float(params["factor"]))
    elif kind == "llama3":
        scaling = RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    return {"rope_theta": float(params["rope_theta"]), "rope_scaling": scaling}


def rope_config(spec) -> dict:
    """A spec's rope as `config.json` says it to the current transformers and the older one
    (`rope_parameters`; `rope_scaling` without the theta, and `rope_theta`, which transformers
    5 also reads, the scaling first)."""
    scaling = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        scaling = {"rope_type": s.kind, "type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position_embeddings)
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if scaling is not None:
        rope = {k: v for k, v in scaling.items() if k != "type"} | {"rope_theta": spec.rope_theta}
    return {"rope_parameters": rope, "rope_scaling": scaling, "rope_theta": spec.rope_theta}


def config_from_spec(spec: LlamaSpec, vocab_size: int, dtype: str, special_ids: dict | None = None) -> dict:
    """A `config.json` the current transformers reads, and for the rope the older one too
    (`rope_config`). `special_ids`: the bos/eos/pad ids (by "bos", "eos", "pad"; an eos may
    be a list), written null where unknown rather than left to LlamaConfig's defaults (1, 2)."""
    ids = special_ids or {}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype, "torch_dtype": dtype,
            "vocab_size": vocab_size, "hidden_size": spec.d_model, "intermediate_size": spec.ffn_dim,
            "num_hidden_layers": spec.n_layers, "num_attention_heads": spec.n_heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size, "hidden_act": "silu",
            "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.rms_norm_eps,
            "tie_word_embeddings": spec.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            **rope_config(spec), **{f"{k}_token_id": ids.get(k) for k in ("bos", "eos", "pad")}}


class LlamaFamily(Family):
    name, spec_type, presets, published, hf_folders = "llama", LlamaSpec, PRESETS, PUBLISHED, True
    hf_types = ("llama",)

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

    def flops_per_step(self, spec: LlamaSpec, batch: int, seq_len: int, *, vocab_size: int = 256, **_) -> float:
        return flops_per_step(spec, vocab_size, batch, seq_len)

    def hf_reads(self, config: dict) -> bool:
        return super().hf_reads(config) or "LlamaForCausalLM" in (config.get("architectures") or [])

    def spec_from_hf(self, config: dict, where: str) -> tuple[LlamaSpec, int]:
        return spec_from_config(config, where)

    def hf_config(self, spec: LlamaSpec, vocab_size: int, dtype: str, special_ids: dict) -> dict:
        return config_from_spec(spec, vocab_size, dtype, special_ids)

    def hf_name(self, name: str) -> str:
        return hf_name(name)

    def our_name(self, hf_name: str) -> str:
        return our_name(hf_name)

    def shape(self, spec: LlamaSpec, vocab_size: int) -> Shape:
        head_dim = spec.head_size if spec.head_size * spec.n_heads != spec.d_model else None
        return Shape(spec.n_layers, spec.d_model, spec.n_heads, vocab_size, spec.max_seq_len, "llama",
                     kv_heads=spec.kv_heads, ffn=spec.ffn_dim, head_dim=head_dim)


FAMILY = LlamaFamily()
