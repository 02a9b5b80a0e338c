"""A model the user wrote, on the command line: `meshtrain train|verify --model
pkg.module:factory`. `factory()` returns a `Recipe` (`recipes/recipe.py`: the same type each
shipped preset is) or just the `nn.Module`; the layout flags become
`meshtrain.parallelize`'s arguments, and batches come from the recipe or from `--data`
(token ids [B, seq] for text, 8×8 digits as [B, 64] floats with 10 classes).

No torch import at module level: `cli.validate` asks `is_user_model` while it validates flags."""

from __future__ import annotations

import importlib
from typing import Callable

from meshtrain.recipes.recipe import Recipe


def is_user_model(name: str) -> bool:
    """`pkg.module:factory` names a user's model; a bare name is a preset."""
    return ":" in name


def load_recipe(name: str) -> Recipe:
    """The `Recipe` of `--model pkg.module:factory`; ValueError with one line if it cannot be had."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {name}: cannot import {module_name} ({e}); run from the folder that holds it or "
                         f"add it to PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {name}: {module_name} has no function {attr!r}")
    made = factory()
    if isinstance(made, Recipe):
        return made
    import torch.nn as nn
    if isinstance(made, nn.Module):
        return Recipe(make_model=factory)
    raise ValueError(f"--model {name}: {attr}() returned {type(made).__name__}, not a meshtrain.Recipe or nn.Module")


class RecipeData:
    """A recipe's batches in the form the training loop reads them (`batch(step, size, rows)`)."""

    def __init__(self, batch: Callable):
        self._batch = batch

    def batch(self, step: int, batch_size: int, rows: slice):
        from meshtrain.batch_rows import take_rows
        inputs, targets = self._batch(step, batch_size)
        return take_rows(inputs, rows), take_rows(targets, rows)
