"""meshtrain's mixture-of-experts decoder (`models/moe.py`) as a recipe: its presets,
Hugging Face's initialisation, its tensor-parallel and pipeline plans, what a layout must
divide, its FLOPs on the active parameters, and what it cannot do yet (one line each)."""

from __future__ import annotations

from meshtrain.models.specs import MoESpec
from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.styles import COLUMN, PARTIAL, REGION, ROW, VOCAB, Heads, TensorPlan
import meshtrain.recipes.moe_hf as moe_hf
from meshtrain.recipes.family import Family
from meshtrain.recipes.llama import with_padding_row

SCORES = ("softmax", "sigmoid")
BALANCES = ("sequence", "batch", "pooled", "bias", "none")
ROUTINGS = ("learned", "balanced")
QK_NORMS = ("none", "head", "projection")
EXPERT_KERNELS = ("grouped", "loop")

PRESETS = {
    # Qwen3-MoE's architecture (per-head q/k norm; the first layer dense, as its
    # mlp_only_layers and DeepSeek's first_k_dense_replace make it), so that `export --hf` writes
    # a folder transformers loads. The suite's: 4 layers, 4 experts of which each token takes
    # 2, widths in whole 16-byte units (grouped_mm's strides) in fp32 and bf16. And one
    # trainable here: 8 experts, top-2, about llama-small's active size.
    "moe-test": MoESpec(n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, ffn_dim=64, n_experts=4, top_k=2,
                        expert_ffn_dim=16, dense_layers=(0,), qk_norm="head", max_seq_len=64),
    "moe-small": MoESpec(n_layers=8, n_heads=8, n_kv_heads=4, d_model=256, ffn_dim=704, n_experts=8, top_k=2,
                         expert_ffn_dim=352, dense_layers=(0,), qk_norm="head", max_seq_len=512),
}


def problems(spec: MoESpec) -> list[str]:
    """What is wrong with a spec, one line each (before any rank starts)."""
    found = []
    if not 1 <= spec.top_k <= spec.n_experts:
        found.append(f"top_k {spec.top_k} must be between 1 and the {spec.n_experts} experts")
    for value, allowed, what in ((spec.score, SCORES, "router score"), (spec.balance, BALANCES, "balancing"),
                                 (spec.routing, ROUTINGS, "routing"), (spec.qk_norm, QK_NORMS, "qk norm"),
                                 (spec.experts, EXPERT_KERNELS, "experts kernel")):
        if value not in allowed:
            found.append(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")
    if spec.balance_rows < 1:
        found.append(f"balance_rows {spec.balance_rows} must be 1 or more")
    if spec.capacity is not None and not spec.capacity > 0:
        found.append(f"capacity {spec.capacity:g}: a capacity factor must be above 0 (an expert of capacity "
                     f"⌈F·s·k/E⌉ takes F times its balanced share)")
    if any(not 0 <= i < spec.n_layers for i in spec.dense_layers):
        found.append(f"dense layers {list(spec.dense_layers)} must be among the {spec.n_layers} layers")
    if spec.n_heads % spec.kv_heads:
        found.append(f"n_kv_heads {spec.kv_heads} does not divide n_heads {spec.n_heads}")
    return found


def tp_plan(spec: MoESpec) -> TensorPlan:
    """The Llama's attention plan (a per-head q/k norm applied by each rank to its heads, its
    gradient summed over tp); a dense layer's MLP split as the Llama's; the experts and the
    router replicated over tp (each tp rank runs the experts of the tokens it holds: all of
    them, or under SP its part of the sequence, whose gradients are then summed)."""
    styles = {
        "embed_tokens": VOCAB,
        "layers.*.self_attn": (REGION, Heads("n_heads", "n_kv_heads")),
        "layers.*.self_attn.[qkv]_proj": COLUMN,
        "layers.*.self_attn.o_proj": ROW,
        "lm_head": (REGION, COLUMN),
    }
    if spec.qk_norm == "head":
        styles["layers.*.self_attn.[qk]_norm"] = PARTIAL
    for i in spec.dense_layers:
        styles.update({f"layers.{i}.mlp": REGION, f"layers.{i}.mlp.gate_proj": COLUMN,
                       f"layers.{i}.mlp.up_proj": COLUMN, f"layers.{i}.mlp.down_proj": ROW})
    return TensorPlan(styles, vocab_parallel_loss=True)


def flops_per_step(spec: MoESpec, vocab_size: int, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step on the active parameters: per token and layer the
    attention's projections and core (as the Llama's), a dense layer's SwiGLU, or the
    router, k experts' SwiGLUs and the shared experts; the head; backward twice the forward."""
    d, hd, s = spec.d_model, spec.head_size, seq_len
    attention = d * hd * (2 * spec.n_heads + 2 * spec.kv_heads)
    dense = 3 * d * spec.ffn_dim
    sparse = d * spec.n_experts + 3 * d * spec.expert_ffn_dim * spec.top_k + 3 * d * spec.shared_ffn_dim
    n_dense = len(spec.dense_layers)
    per_token = spec.n_layers * attention + n_dense * dense + (spec.n_layers - n_dense) * sparse + d * vocab_size
    forward = 2.0 * batch * s * per_token + 4.0 * batch * s * s * spec.n_layers * spec.n_heads * hd
    return 3.0 * forward


def init_rules(model) -> dict:
    """Hugging Face's initialisation of these families: every matrix (the router's, each
    stacked expert's) N(0, 0.02), RMSNorm weights 1, the embedding's padding row 0."""
    return with_padding_row({name: ("normal", 0.02) if p.dim() >= 2 else ("ones",)
                             for name, p in model.named_parameters()}, model)


class MoEFamily(Family):
    name, spec_type, presets, options = "moe", MoESpec, PRESETS, ("moe",)

    def build(self, spec: MoESpec, *, vocab_size: int = 256, **_):
        problem = problems(spec)
        if problem:
            raise ValueError(f"MoE spec: {problem[0]}")
        from meshtrain.models.moe import MoEModel  # torch: only when a model is built
        return MoEModel(spec, vocab_size)

    def owns(self, model) -> bool:
        from meshtrain.models.moe import MoEModel
        return isinstance(model, MoEModel)

    def init_rules(self, model) -> dict:
        return init_rules(model)

    def problems(self, spec: MoESpec) -> list[str]:
        return problems(spec)

    def with_options(self, spec: MoESpec, *, moe: dict | None = None, **_) -> MoESpec:
        """The spec with the command line's --moe-* flags (`moe`, by field name) applied."""
        import dataclasses
        return dataclasses.replace(spec, **moe) if moe else spec

    def tp_plan(self, spec: MoESpec) -> TensorPlan:
        return tp_plan(spec)

    def pipeline_plan(self, spec: MoESpec) -> PipelinePlan:
        return PipelinePlan(("embed_tokens",), "layers", ("norm", "lm_head"), lambda b, s: (b, s, spec.d_model))

    def blocks(self, spec: MoESpec) -> int:
        return spec.n_layers

    def tp_splits(self, spec: MoESpec, vocab_size: int) -> list[tuple[int, str]]:
        splits = [(spec.n_heads, "query heads"), (spec.kv_heads, "key/value heads"),
                  (vocab_size, "vocabulary (--vocab-size)")]
        return splits + ([(spec.ffn_dim, "dense MLP width")] if spec.dense_layers else [])

    def attention_heads(self, spec: MoESpec) -> list[tuple[str, int]]:
        return [("heads", spec.n_heads), ("kv heads", spec.kv_heads)]

    def pipeline_problem(self, spec: MoESpec) -> str | None:
        if spec.tie_embeddings:
            return "ties its head to its embedding, which pp would put on two stages; use --pp 1"
        return None

    def layout_problem(self, spec: MoESpec, *, tp: int = 1, micro_rows: int = 1, sp: bool = False, cp: int = 1,
                       pp: int = 1, dp: int = 1, microbatches: int = 1, **_) -> str | None:
        if spec.balance == "pooled" and (pp > 1 or (dp > 1 and microbatches > 1)):
            return ("pools its balancing loss over every layer and token of a forward (transformers' definition), "
                    + ("which --pp splits over stages; use --pp 1" if pp > 1 else
                       "and with --dp and micro-batches a forward holds other rows than a plain loop's "
                       "micro-batch; use --microbatches 1") + ", or --moe-balance sequence")
        if spec.capacity is not None and (cp > 1 or (sp and tp > 1)):
            return ("counts its experts' capacity per sequence, and context or sequence parallelism splits a "
                    "sequence over ranks (not built yet); use --cp 1 and no --sp with --moe-capacity")
        if tp > 1 and spec.qk_norm == "projection":
            return ("normalises queries and keys over the whole projection (OLMoE), whose statistics tensor "
                    "parallelism would split over ranks (not built yet); use --tp 1")
        if spec.balance == "batch" and micro_rows % spec.balance_rows:
            return (f"takes its batch balancing loss over groups of {spec.balance_rows} rows, which do not divide "
                    f"a micro-batch's {micro_rows} rows on each rank; use a --moe-balance-rows dividing "
                    f"{micro_rows}")
        return None

    def flops_per_step(self, spec: MoESpec, batch: int, seq_len: int, *, vocab_size: int = 256, **_) -> float:
        return flops_per_step(spec, vocab_size, batch, seq_len)

    # ---- the planner's shape (`plan/`) ---------------------------------------------------------

    from meshtrain.recipes.moe_published import PUBLISHED as published  # released shapes `plan --model` plans

    def shape(self, spec: MoESpec, vocab_size: int):
        """The planner's `Shape` (kind "moe"): the Llama's attention with the q/k norm, the
        dense layers' SwiGLU width, and the experts, their top-k and width, the shared expert,
        and the rows each auxiliary balancing loss is taken over (0: none)."""
        from meshtrain.plan.shapes import Shape  # kept under this marker: the file's top is another part's
        head_dim = spec.head_size if spec.head_size * spec.n_heads != spec.d_model else None
        aux = spec.aux_coef and spec.balance in ("sequence", "batch")
        return Shape(spec.n_layers, spec.d_model, spec.n_heads, vocab_size, spec.max_seq_len, "moe",
                     kv_heads=spec.kv_heads, ffn=spec.ffn_dim, head_dim=head_dim, experts=spec.n_experts,
                     top_k=spec.top_k, expert_ffn=spec.expert_ffn_dim, dense_layers=tuple(spec.dense_layers),
                     shared_ffn=spec.shared_ffn_dim, qk_norm=spec.qk_norm, norm_topk=spec.norm_topk,
                     aux_rows=(spec.balance_rows if spec.balance == "batch" else 1) if aux else 0,
                     capacity=spec.capacity, tied=spec.tie_embeddings)

    # ---- Hugging Face folders (Mixtral, Qwen3-MoE, OLMoE): `recipes/moe_hf.py` ----------------

    hf_folders, hf_types = True, moe_hf.READS

    def hf_reads(self, config: dict) -> bool:
        return config.get("model_type") in (*moe_hf.READS, *moe_hf.REFUSED)

    def spec_from_hf(self, config: dict, where: str) -> tuple[MoESpec, int]:
        return moe_hf.spec_from_config(config, where)

    def hf_config(self, spec: MoESpec, vocab_size: int, dtype: str, special_ids: dict) -> dict:
        return moe_hf.config_from_spec(spec, vocab_size, dtype, special_ids)

    def hf_name(self, name: str) -> str:
        return moe_hf.hf_name(name)

    def our_name(self, hf_name: str) -> str:
        return moe_hf.our_name(hf_name)

    def hf_parts(self, spec: MoESpec, name: str) -> list[tuple[str, tuple]]:
        return moe_hf.hf_parts(spec, name)

    def hf_state_problem(self, spec: MoESpec, name: str, value) -> str | None:
        return moe_hf.state_problem(name, value)


FAMILY = MoEFamily()
