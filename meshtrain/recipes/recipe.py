"""`meshtrain.Recipe`: what training needs of a model, whoever wrote it. A user's
`--model pkg.module:factory` returns one; each preset the package ships is one too
(`meshtrain.recipes.build.preset_recipe`). Pure data, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Recipe:
    """What the command line needs of a model. `make_model()` builds it with the same
    weights on every call (seed inside, or the command line's `--seed` set before it is
    called) — or, with `init`, its structure only: it is then called on the meta device and
    each rank draws just its part from `init` (what `meshtrain.parallelize` takes as `init`:
    `fn(name, tensor, generator)` filling a parameter's full tensor, or a spec with
    `full_value(name)`; or `materialize.ModelRules`, rules read off the built structure, as
    the shipped presets give). `batch(step, batch_size)`: the global batch (inputs, targets)
    of a step, a pure function of the step (None: the `--data` dataset's); `loss_fn` (by
    default `meshtrain.cross_entropy`; None when the model returns its loss) with
    `loss_reduction` ("mean", or "sum": divided by the global number of loss terms),
    `tp_plan`, `pipeline`, `wrap`: as `meshtrain.parallelize` takes them; `optimizer`: a
    factory (None: AdamW at `--lr`, `--weight-decay` on matrices); `lr_scheduler`: a factory
    (None: `--lr`'s warm-up and cosine schedule, set each step)."""
    make_model: Callable
    batch: Callable | None = None
    loss_fn: Callable | None = "cross_entropy"  # meshtrain.cross_entropy; None: the output's own .loss
    tp_plan: object = None
    pipeline: object = None
    wrap: list[str] | None = None
    optimizer: Callable | None = None
    lr_scheduler: Callable | None = None
    init: object = None
    loss_reduction: str = "mean"
