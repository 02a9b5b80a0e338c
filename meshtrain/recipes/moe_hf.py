"""Mixtral, Qwen3-MoE and OLMoE folders as meshtrain's MoE (`models/moe.py`): their
`config.json` both ways, which of the three a spec is written as, and where each stacked
expert tensor lies in the files. transformers 5 fuses the experts in memory (our names and
shapes) but reads and writes them one per expert on disk, and so does this module:
Mixtral's `model.layers.N.block_sparse_moe.gate.weight` and `...block_sparse_moe.experts.M.
{w1,w3,w2}.weight` (gate [I, d], up [I, d], down [d, I]); Qwen3-MoE's and OLMoE's
`model.layers.N.mlp.gate.weight` and `...mlp.experts.M.{gate,up,down}_proj.weight`.

What meshtrain's MoE cannot represent (biases, sliding windows, jitter, clipped q/k/v,
grouped routing, quantized weights, gated shared experts, another activation) is refused in
one line naming the key. No torch at import: the recipes registry is torch-free."""

from __future__ import annotations

import re

from meshtrain.models.specs import MoESpec
from meshtrain.recipes.family import HFError
from meshtrain.recipes.llama import pad_from_config, rope_config, rope_from_config

READS = ("mixtral", "qwen3_moe", "olmoe")
# Read only to say in one line what they have that meshtrain's MoE lacks.
REFUSED = ("qwen2_moe", "deepseek_v2", "deepseek_v3")
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
TITLES = "Mixtral, Qwen3-MoE and OLMoE"
BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "olmoe": "mlp"}  # the MoE block on disk
EXPERT = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
          "olmoe": ("gate_proj", "up_proj", "down_proj")}  # one expert's gate, up and down on disk
# transformers' defaults where a hand-written config.json leaves a key out
DEFAULTS = {"mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "router_aux_loss_coef": 0.001,
                        "max_position_embeddings": 131072},
            "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "router_aux_loss_coef": 0.001,
                          "max_position_embeddings": 32768},
            "olmoe": {"rms_norm_eps": 1e-5, "rope_theta": 1e4, "router_aux_loss_coef": 0.01,
                      "max_position_embeddings": 4096}}
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")


def aux_coef_from_hf(coef: float, top_k: int, moe_layers: int) -> float:
    """meshtrain's `aux_coef` for transformers' `router_aux_loss_coef`. transformers pools the
    router scores of all layers and adds coef · E·Σ_i f_i·P_i, whose f_i (the share of the
    tokens' k choices) sums to k: the loss is k when balanced. meshtrain adds aux_coef times
    each layer's own loss, 1 when balanced; so coef · k / (MoE layers) weighs balancing
    alike. meshtrain's is per row (`balance="sequence"`), transformers' over the whole batch
    (and only with output_router_logits): the same when every row is balanced."""
    return coef * top_k / max(moe_layers, 1)


def _refuse(config: dict, where: str) -> None:
    """One line for the first thing of a config.json meshtrain's MoE cannot represent."""
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "quantized")
        raise HFError(f"{where}: quantization_config ({method}); meshtrain reads unquantized weights, dequantize "
                      f"the folder first")
    for key in ("n_group", "topk_group"):
        if config.get(key) not in (None, 1):
            raise HFError(f"{where}: {key} {config[key]} (DeepSeek's grouped routing); meshtrain's router takes "
                          f"the top-k of all experts")
    if config.get("shared_expert_intermediate_size"):
        raise HFError(f"{where}: shared_expert_intermediate_size {config['shared_expert_intermediate_size']} "
                      f"with its shared_expert_gate (Qwen2-MoE); meshtrain's shared experts have no gate")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HFError(f"{where}: {key} is true; meshtrain's MoE has no biases")
    window = config.get("use_sliding_window") if "use_sliding_window" in config else config.get("sliding_window")
    if window:
        raise HFError(f"{where}: sliding_window {config.get('sliding_window')} is enabled; meshtrain's attention "
                      f"sees the whole causal context")
    if (config.get("router_jitter_noise") or 0) > 0:
        raise HFError(f"{where}: router_jitter_noise {config['router_jitter_noise']}; meshtrain's router takes "
                      f"no noise (set it to 0)")
    if config.get("clip_qkv") is not None:
        raise HFError(f"{where}: clip_qkv {config['clip_qkv']}; meshtrain's attention does not clip q, k and v")
    if config.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act {config['hidden_act']!r}; meshtrain's experts are SwiGLU (silu)")
    if config.get("model_type") not in READS:
        raise HFError(f"{where}: model_type {config.get('model_type')!r}; meshtrain's MoE reads {', '.join(READS)}")


def spec_from_config(config: dict, where: str = "config.json") -> tuple[MoESpec, int]:
    """(spec, vocabulary size) of a Mixtral, Qwen3-MoE or OLMoE `config.json`: Mixtral
    renormalises its top-k always and has no q/k norm; Qwen3-MoE normalises each head's
    queries and keys and makes a layer dense as its decoder layer does (in `mlp_only_layers`,
    or not a multiple of `decoder_sparse_step`); OLMoE normalises the whole projections. The
    balancing loss per row (`aux_coef_from_hf`), on where transformers adds it to `.loss`
    (`output_router_logits`; off by default), its weight kept either way."""
    _refuse(config, where)
    kind = config["model_type"]
    defaults = DEFAULTS[kind]
    try:
        d, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
        kv = int(config.get("num_key_value_heads") or heads)
        names = ("num_local_experts", "num_experts")  # transformers 5 maps one onto the other
        names = names if kind == "mixtral" else names[::-1]
        experts = next((config[n] for n in names if config.get(n) is not None), None)
        if experts is None:
            raise KeyError(names[0])
        experts, top_k = int(experts), int(config["num_experts_per_tok"])
        head_dim = int(config.get("head_dim") or d // heads)
        expert_ffn = int(config["moe_intermediate_size"]) if kind == "qwen3_moe" else ffn
        dense: tuple[int, ...] = ()
        if kind == "qwen3_moe":  # as transformers' Qwen3MoeDecoderLayer chooses
            only, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step", 1))
            dense = tuple(i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0))
        rope = rope_from_config(config, where, defaults["rope_theta"])
        vocab = int(config["vocab_size"])
    except KeyError as e:
        raise HFError(f"{where}: no {e.args[0]}") from None
    if heads % kv:
        raise HFError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    if not 1 <= top_k <= experts:
        raise HFError(f"{where}: num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    if kind == "olmoe" and head_dim * heads != d:
        raise HFError(f"{where}: head_dim {head_dim}; OLMoE's query norm spans hidden_size {d}, so a head is "
                      f"{d // heads} wide")
    coef = float(config.get("router_aux_loss_coef", defaults["router_aux_loss_coef"]))
    aux = aux_coef_from_hf(coef, top_k, layers - len(dense))
    spec = MoESpec(n_layers=layers, n_heads=heads, n_kv_heads=kv, d_model=d, head_dim=head_dim,
                   ffn_dim=ffn, n_experts=experts, top_k=top_k,
                   expert_ffn_dim=expert_ffn, dense_layers=dense,
                   norm_topk=kind == "mixtral" or bool(config.get("norm_topk_prob", False)),
                   qk_norm={"mixtral": "none", "qwen3_moe": "head", "olmoe": "projection"}[kind],
                   max_seq_len=int(config.get("max_position_embeddings", defaults["max_position_embeddings"])),
                   rms_norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                   pad_token_id=pad_from_config(config, vocab, where),
                   balance="sequence" if aux and config.get("output_router_logits") else "none", aux_coef=aux,
                   **rope)
    return spec, vocab


def architecture(spec: MoESpec) -> str:
    """The model_type a spec is written as, by its q/k norm: "head" Qwen3-MoE, "projection"
    OLMoE, "none" Mixtral; HFError (one line) for what the spec has that none can hold."""
    found = None
    kind = {"head": "qwen3_moe", "projection": "olmoe", "none": "mixtral"}.get(spec.qk_norm)
    if spec.shared_ffn_dim:
        found = f"shared experts (shared_ffn_dim {spec.shared_ffn_dim})"
    elif spec.score != "softmax":
        found = f"{spec.score} router scores (they score by softmax)"
    elif spec.routing != "learned":
        found = f"routing {spec.routing!r} (they route by the router's top-k)"
    elif kind is None:
        found = f"qk_norm {spec.qk_norm!r}"
    elif kind != "qwen3_moe" and spec.dense_layers:
        found = (f"dense layers {list(spec.dense_layers)} with qk_norm {spec.qk_norm!r} (only Qwen3-MoE, whose "
                 f"q/k norm is per head, has dense layers)")
    elif kind == "mixtral" and not spec.norm_topk:
        found = ("top-k weights left unnormalised (norm_topk false) with no q/k norm (Mixtral always renormalises; "
                 "Qwen3-MoE and OLMoE have q/k norms)")
    elif kind == "olmoe" and spec.head_size * spec.n_heads != spec.d_model:
        found = (f"head_dim {spec.head_size} with a whole-projection q/k norm (OLMoE's spans d_model: "
                 f"{spec.d_model // spec.n_heads} a head)")
    if found:
        raise HFError(f"this MoE has {found}, which none of {TITLES} can hold; it cannot be written as a "
                      f"Hugging Face folder")
    return kind


def config_from_spec(spec: MoESpec, vocab_size: int, dtype: str, special_ids: dict | None = None) -> dict:
    """The `config.json` of `spec` as its `architecture`, which transformers loads into a
    model computing meshtrain's logits; the balancing loss's weight mapped back
    (`aux_coef_from_hf`; 0 where meshtrain balances by a bias), and `output_router_logits`
    true where the balancing loss is on."""
    kind = architecture(spec)
    ids = special_ids or {}
    moe_layers = spec.n_layers - len(spec.dense_layers)
    coef = spec.aux_coef * max(moe_layers, 1) / spec.top_k if spec.balance != "bias" else 0.0
    coef = float(f"{coef:.12g}")  # the folder's own 0.03 back, not the round trip's 0.030000000000000002
    balanced = spec.balance in ("sequence", "batch", "pooled") and spec.aux_coef > 0  # transformers' .loss adds it then
    config = {"architectures": [CLASSES[kind]], "model_type": kind, "dtype": dtype, "torch_dtype": dtype,
              "vocab_size": vocab_size, "hidden_size": spec.d_model, "num_hidden_layers": spec.n_layers,
              "num_attention_heads": spec.n_heads, "num_key_value_heads": spec.kv_heads, "hidden_act": "silu",
              "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.rms_norm_eps,
              "tie_word_embeddings": spec.tie_embeddings, "num_experts_per_tok": spec.top_k,
              "router_aux_loss_coef": coef, "output_router_logits": balanced, **rope_config(spec),
              **{f"{k}_token_id": ids.get(k) for k in ("bos", "eos", "pad")}}
    if kind == "mixtral":
        config.update(intermediate_size=spec.expert_ffn_dim, num_local_experts=spec.n_experts,
                      head_dim=spec.head_size, sliding_window=None, router_jitter_noise=0.0)
    elif kind == "qwen3_moe":
        config.update(intermediate_size=spec.ffn_dim, moe_intermediate_size=spec.expert_ffn_dim,
                      num_experts=spec.n_experts, decoder_sparse_step=1, mlp_only_layers=list(spec.dense_layers),
                      norm_topk_prob=spec.norm_topk, head_dim=spec.head_size, attention_bias=False,
                      use_sliding_window=False, sliding_window=None)
    else:
        config.update(intermediate_size=spec.expert_ffn_dim, num_experts=spec.n_experts,
                      norm_topk_prob=spec.norm_topk, attention_bias=False, clip_qkv=None)
    return config


def hf_name(name: str) -> str:
    """transformers' in-memory name of a parameter: ours under `model.`, but the head's."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def our_name(name: str) -> str:
    return name.removeprefix("model.")


def hf_parts(spec: MoESpec, name: str) -> list[tuple[str, tuple]]:
    """(key on disk, index into ours) of each tensor parameter `name` is written as: the
    router under the architecture's block name; the stacked experts one key per expert and
    projection (gate_up_proj[m, :I] the gate, [m, I:] the up, down_proj[m] the down);
    everything else under its in-memory name."""
    match = _STACKED.fullmatch(name)
    if match is None:
        return [(hf_name(name), ())]
    kind = architecture(spec)
    block, what = f"model.layers.{match[1]}.{BLOCK[kind]}", match[2]
    if what == "gate.weight":
        return [(f"{block}.gate.weight", ())]
    gate, up, down = EXPERT[kind]
    n, width = spec.n_experts, spec.expert_ffn_dim
    if what == "experts.down_proj":
        return [(f"{block}.experts.{m}.{down}.weight", (m,)) for m in range(n)]
    return [part for m in range(n) for part in ((f"{block}.experts.{m}.{gate}.weight", (m, slice(0, width))),
                                                (f"{block}.experts.{m}.{up}.weight", (m, slice(width, 2 * width))))]


def state_problem(name: str, value) -> str | None:
    """A router's balancing bias (`balance="bias"`) shifts which experts a token takes; the
    three formats' routers have none, so only an all-zero bias may be left out."""
    if name.endswith(".mlp.gate.expert_bias"):
        if not bool(value.any()):
            return None
        return (f"{name} is nonzero (trained with --moe-balance bias): the routers of {TITLES} have no such "
                f"bias, so transformers would route tokens to other experts")
    return f"{name} is state transformers' model has no place for"
