"""meshtrain's GPT (`models/gpt.py`) as a recipe: its presets, GPT-2's initialisation, its
tensor-parallel and pipeline plans, what a layout must divide, and the planner's shape."""

from __future__ import annotations

import math
from dataclasses import replace

from meshtrain.models.specs import GPTSpec
from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.styles import (COLUMN, HEAD_SHARDED, REGION, ROW, SEQUENCE, SEQUENCE_SHARDED, VOCAB, Heads,
                                       TensorPlan)
from meshtrain.plan.shapes import Shape
from meshtrain.recipes.family import Family

PRESETS = {
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
}

# GPT-3 175B (Brown et al. 2020) with Megatron's vocabulary of 51,200, for the planner.
PUBLISHED = {"gpt3-175b": (GPTSpec(n_layers=96, n_heads=96, d_model=12288, max_seq_len=2048), 51200)}

# Attention split by heads (q, k, v by columns, proj by rows), the MLP's fc by columns and proj
# by rows, the token embedding and the head by vocabulary.
TP_PLAN = TensorPlan({
    "embed.tok": VOCAB,
    "embed.pos": SEQUENCE,
    "blocks.*.attn": (REGION, Heads("n_heads")),  # n_heads per rank (what all-to-all attention splits)
    "blocks.*.attn.[qkv]": COLUMN,
    "blocks.*.attn.proj": ROW,
    "blocks.*.attn.attn_drop": HEAD_SHARDED,
    "blocks.*.mlp": REGION,
    "blocks.*.mlp.fc": COLUMN,
    "blocks.*.mlp.proj": ROW,
    "embed.drop": SEQUENCE_SHARDED, "blocks.*.attn.drop": SEQUENCE_SHARDED, "blocks.*.mlp.drop": SEQUENCE_SHARDED,
    "head": (REGION, COLUMN),
}, vocab_parallel_loss=True)


def pipeline_plan(d_model: int) -> PipelinePlan:
    """The embedding on the first stage, the final norm and the head on the last."""
    return PipelinePlan(("embed",), "blocks", ("norm", "head"), lambda b, s: (b, s, d_model))


def flops_per_step(spec: GPTSpec, vocab_size: int, batch: int, seq_len: int) -> float:
    """Model FLOPs of one training step (forward and backward) on `batch` sequences:
    Megatron's count (Narayanan et al. 2021, appendix). Forward, per layer: the four h×h
    attention projections and the two h×4h MLP matrices, 24·B·s·h²; the attention scores and
    their weighting, 4·B·s²·h; once, the logits, 2·B·s·h·V. Backward costs twice forward, so
    a step is 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))."""
    s, h, l = seq_len, spec.d_model, spec.n_layers
    return 72.0 * batch * s * l * h * h * (1 + s / (6 * h) + vocab_size / (12 * l * h))


def init_rules(model) -> dict:
    """GPT-2's initialisation: matrices (embeddings too) N(0, 0.02), the residual projections
    N(0, 0.02/sqrt(2L)); LayerNorm weights 1, biases 0."""
    import torch.nn as nn  # a built model is at hand, so torch is loaded already
    n_layers = len(model.blocks)
    rules = {}
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            rules[name] = ("normal", 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02)
        else:
            parent = name.rpartition(".")[0]
            owner = model.get_submodule(parent) if parent else model
            rules[name] = ("ones",) if owner.__class__ is nn.LayerNorm and name.endswith(".weight") else ("zeros",)
    return rules


class GPTFamily(Family):
    name, spec_type, presets, published, options = "gpt", GPTSpec, PRESETS, PUBLISHED, ("dropout", "attention")

    def build(self, spec: GPTSpec, *, vocab_size: int = 256, **_):
        from meshtrain.models.gpt import GPT  # torch: only when a model is built
        return GPT(spec, vocab_size)

    def owns(self, model) -> bool:
        from meshtrain.models.gpt import GPT  # torch: only for a built model
        return isinstance(model, GPT)

    def init_rules(self, model) -> dict:
        return init_rules(model)

    def tp_plan(self, spec: GPTSpec) -> TensorPlan:
        return TP_PLAN

    def pipeline_plan(self, spec: GPTSpec) -> PipelinePlan:
        return pipeline_plan(spec.d_model)

    def blocks(self, spec: GPTSpec) -> int:
        return spec.n_layers

    def tp_splits(self, spec: GPTSpec, vocab_size: int) -> list[tuple[int, str]]:
        return [(spec.n_heads, "heads"), (spec.d_model, "hidden size"), (4 * spec.d_model, "MLP width"),
                (vocab_size, "vocabulary (--vocab-size)")]

    def attention_heads(self, spec: GPTSpec) -> list[tuple[str, int]]:
        return [("heads", spec.n_heads)]

    def max_positions(self, spec: GPTSpec) -> int:
        return spec.max_seq_len

    def with_options(self, spec: GPTSpec, *, dropout: float = 0.0, attention: str = "sdpa", hidden=None) -> GPTSpec:
        return replace(spec, dropout=dropout, attention=attention)

    def flops_per_step(self, spec: GPTSpec, batch: int, seq_len: int, *, vocab_size: int = 256, **_) -> float:
        return flops_per_step(spec, vocab_size, batch, seq_len)

    def shape(self, spec: GPTSpec, vocab_size: int) -> Shape:
        return Shape(spec.n_layers, spec.d_model, spec.n_heads, vocab_size, spec.max_seq_len)


FAMILY = GPTFamily()
