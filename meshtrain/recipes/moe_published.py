"""Released mixture-of-experts architectures the planner plans (`meshtrain plan --model
NAME`), as meshtrain's MoE spec and vocabulary: each is what `recipes/moe_hf.py` reads from
the checkpoint's own `config.json` (a test holds the two equal), and its parameter count is
the checkpoint's (`tests/test_plan_moe.py`). `train` reaches them through `--init-from` a
folder of their weights. Each folder says `output_router_logits: false`, so transformers'
`.loss` has no balancing term and none is on here (`balance="none"`, the weight kept).
No torch at import."""

from __future__ import annotations

from meshtrain.models.specs import MoESpec


def _aux(coef: float, top_k: int, moe_layers: int) -> float:
    """transformers' router_aux_loss_coef as meshtrain's per-layer, per-row weight
    (`moe_hf.aux_coef_from_hf`)."""
    return coef * top_k / moe_layers


def _mixtral(layers, hidden, heads, kv_heads, ffn, vocab, seq_len, coef=0.02):
    """Mixtral: 8 experts of the dense width, top-2 renormalised, no q/k norm, RoPE 10⁶."""
    return MoESpec(n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, d_model=hidden, head_dim=hidden // heads,
                   ffn_dim=ffn, n_experts=8, top_k=2, expert_ffn_dim=ffn, max_seq_len=seq_len, rope_theta=1e6,
                   rms_norm_eps=1e-5, aux_coef=_aux(coef, 2, layers), balance="none"), vocab


def _qwen3(layers, hidden, heads, kv_heads, ffn, expert_ffn, experts, top_k, seq_len=40960):
    """Qwen3-MoE: per-head q/k RMSNorm, head_dim 128, top-8 renormalised, every layer sparse
    (mlp_only_layers [], decoder_sparse_step 1), RoPE 10⁶, vocabulary 151,936."""
    return MoESpec(n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, d_model=hidden, head_dim=128, ffn_dim=ffn,
                   n_experts=experts, top_k=top_k, expert_ffn_dim=expert_ffn, qk_norm="head", max_seq_len=seq_len,
                   rope_theta=1e6, rms_norm_eps=1e-6, aux_coef=_aux(0.001, top_k, layers),
                   balance="none"), 151936


PUBLISHED = {
    # mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1
    "mixtral-8x7b": _mixtral(32, 4096, 32, 8, 14336, 32000, 32768),
    "mixtral-8x22b": _mixtral(56, 6144, 48, 8, 16384, 32768, 65536, coef=0.001),
    # Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B
    "qwen3-30b-a3b": _qwen3(48, 2048, 32, 4, 6144, 768, 128, 8),
    "qwen3-235b-a22b": _qwen3(94, 4096, 64, 4, 12288, 1536, 128, 8),
    # allenai/OLMoE-1B-7B-0924: the whole q and k projections RMS-normalised, 64 experts, top-8
    # not renormalised, RoPE 10⁴
    "olmoe-1b-7b": (MoESpec(n_layers=16, n_heads=16, n_kv_heads=16, d_model=2048, head_dim=128, ffn_dim=1024,
                            n_experts=64, top_k=8, expert_ffn_dim=1024, norm_topk=False, qk_norm="projection",
                            max_seq_len=4096, rms_norm_eps=1e-5, aux_coef=_aux(0.01, 8, 16),
                            balance="none"), 50304),
}
