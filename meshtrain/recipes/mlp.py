"""The MLP (`models/mlp.py`) as a recipe: the classic data-parallel example on 8×8 digits,
PyTorch's own Linear initialisation, and the plans a user would write for a model that is
not a transformer."""

from __future__ import annotations

import math
from dataclasses import replace

from meshtrain.models.specs import MLPSpec
from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.styles import COLUMN, REGION, ROW, TensorPlan
from meshtrain.recipes.family import Family

PRESETS = {"mlp": MLPSpec(hidden=(128, 128, 128))}

# Blocks of Linear+ReLU, then a head, written as a user would for their own module names.
# Linears alternate column and row, so the ReLU between them runs on sharded features and one
# all-reduce ends each pair.
TP_PLAN = TensorPlan({
    "blocks.0": REGION, "blocks.0.0": COLUMN, "blocks.1.0": ROW,
    "blocks.2": REGION, "blocks.2.0": COLUMN, "head": ROW,
})


def pipeline_plan(width: int) -> PipelinePlan:
    return PipelinePlan((), "blocks", ("head",), lambda b, s: (b, width))


def flops_per_step(spec: MLPSpec, n_inputs: int, n_classes: int, batch: int) -> float:
    """2 FLOPs per weight and sample forward, twice that backward."""
    widths = (n_inputs, *spec.hidden, n_classes)
    weights = sum(a * b for a, b in zip(widths, widths[1:]))
    return 6.0 * batch * weights


def init_rules(model) -> dict:
    """PyTorch's own `nn.Linear` initialisation, U(±1/sqrt(fan_in)) for weight and bias
    (kaiming_uniform with a = sqrt(5)), for a model of Linear layers."""
    import torch.nn as nn  # a built model is at hand, so torch is loaded already
    rules = {}
    for module_name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            bound = 1 / math.sqrt(m.in_features)
            for leaf, _ in m.named_parameters(recurse=False):
                rules[f"{module_name}.{leaf}" if module_name else leaf] = ("uniform", bound)
    missing = {n for n, _ in model.named_parameters()} - set(rules)
    if missing:
        raise ValueError(f"no initialisation rule for {sorted(missing)}")
    return rules


def parse_widths(text: str) -> tuple[int, ...]:
    """'1024,1024' -> (1024, 1024); ValueError unless positive integers."""
    widths = tuple(int(w) for w in text.split(","))
    if not widths or min(widths) < 1:
        raise ValueError(text)
    return widths


class MLPFamily(Family):
    name, spec_type, presets, inputs, options = "mlp", MLPSpec, PRESETS, "features", ("hidden",)

    def build(self, spec: MLPSpec, *, n_inputs: int = 64, n_classes: int = 10, **_):
        from meshtrain.models.mlp import MLP  # torch: only when a model is built
        return MLP(spec, n_inputs, n_classes)

    def owns(self, model) -> bool:
        from meshtrain.models.mlp import MLP  # torch: only for a built model
        return isinstance(model, MLP)

    def init_rules(self, model) -> dict:
        return init_rules(model)

    def tp_plan(self, spec: MLPSpec) -> TensorPlan:
        return TP_PLAN

    def pipeline_plan(self, spec: MLPSpec) -> PipelinePlan:
        return pipeline_plan(spec.hidden[-1])

    def blocks(self, spec: MLPSpec) -> int:
        return len(spec.hidden)

    def tp_splits(self, spec: MLPSpec, vocab_size: int) -> list[tuple[int, str]]:
        return [(width, "hidden width") for width in spec.hidden]

    def n_params(self, spec: MLPSpec, vocab_size: int) -> int:
        widths = (64, *spec.hidden, 10)  # the digits' 8×8 pixels, 10 classes
        return sum((a + 1) * b for a, b in zip(widths, widths[1:]))

    def flops_per_step(self, spec: MLPSpec, batch: int, seq_len: int, *, n_inputs: int = 64, n_classes: int = 10,
                       **_) -> float:
        return flops_per_step(spec, n_inputs, n_classes, batch)

    def with_options(self, spec: MLPSpec, *, dropout: float = 0.0, attention: str = "sdpa", hidden=None) -> MLPSpec:
        return replace(spec, hidden=tuple(hidden)) if hidden else spec


FAMILY = MLPFamily()
