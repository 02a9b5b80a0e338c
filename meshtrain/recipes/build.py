"""The shipped presets as `Recipe`s, and whole models built from them (torch is loaded here,
once a model is wanted; the registry beside it stays torch-free)."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.loss import cross_entropy_sum
from meshtrain.parallel.materialize import InitSpec, ModelRules, materialize, to_placeholders
from meshtrain.recipes import family_of_model, model_spec, mlp
from meshtrain.recipes.recipe import Recipe


def preset_recipe(name: str, *, vocab_size: int = 256, n_inputs: int = 64, n_classes: int = 10,
                  dropout: float = 0.0, attention: str = "sdpa", mlp_hidden: str = "", moe: dict | None = None) -> Recipe:
    """The preset `name` (or a published shape) as a recipe: its structure built on the meta
    device and drawn per rank from its family's rules, its plans, the summed cross-entropy
    (divided by the step's global number of loss terms)."""
    family, spec = model_spec(name, mlp_hidden=mlp_hidden, dropout=dropout, attention=attention, moe=moe)
    if name in family.published and name not in family.presets:
        vocab_size = family.published[name][1]

    def make_model() -> nn.Module:
        return family.build(spec, vocab_size=vocab_size, n_inputs=n_inputs, n_classes=n_classes)
    return Recipe(make_model=make_model, loss_fn=cross_entropy_sum, loss_reduction="sum",
                  tp_plan=family.tp_plan(spec), pipeline=family.pipeline_plan(spec),
                  init=ModelRules(family.init_rules))


def build_model(name: str, seed: int, *, vocab_size: int = 256, n_inputs: int = 64, n_classes: int = 10,
                dropout: float = 0.0, attention: str = "sdpa", mlp_hidden: str = "", moe: dict | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """The preset `name` with its initial weights from `seed` (`mlp_hidden`: the MLP's hidden
    widths, e.g. "1024,1024"); on `device="meta"`, its structure only (`init_spec` says how to
    draw it). A published shape (llama3-8b, ...) is built on `meta`, for a start."""
    recipe = preset_recipe(name, vocab_size=vocab_size, n_inputs=n_inputs, n_classes=n_classes, dropout=dropout,
                           attention=attention, mlp_hidden=mlp_hidden, moe=moe)
    with torch.device("meta"):
        model = recipe.make_model()
    if str(device) == "meta":
        return model
    init = recipe.init.spec(model, seed)
    to_placeholders(model, device)
    materialize(model, lambda name, p: init.full_value(name).to(device=p.device, dtype=p.dtype))
    return model


def init_spec(model: nn.Module, seed: int) -> InitSpec:
    """How to draw a built model's weights from `seed`: its family's rules (PyTorch's Linear
    defaults for a model of no registered family)."""
    family = family_of_model(model)
    return ModelRules(family.init_rules if family is not None else mlp.init_rules).spec(model, seed)
