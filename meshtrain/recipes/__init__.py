"""The model families meshtrain knows, one recipe module each (`gpt`, `llama`, `mlp`, `moe`), and
one registry of their presets and published shapes, read by the trainer, the planner and the
command line alike. No torch at import.

A family of your own registers with `register(MyFamily())` in the process that uses it, or
— so that the command line and every rank it starts find it by a preset's name — through an
entry point of the group `meshtrain.recipes` naming the `Family` object (a package's
`[project.entry-points."meshtrain.recipes"]`), loaded the first time a name is not known."""

from __future__ import annotations

from meshtrain.recipes import gpt, llama, mlp, moe
from meshtrain.recipes.family import Family
from meshtrain.recipes.mlp import parse_widths
from meshtrain.recipes.recipe import Recipe

ENTRY_POINTS = "meshtrain.recipes"

FAMILIES: dict[str, Family] = {}
PRESETS: dict[str, object] = {}  # name -> spec: what `train --model NAME` builds
PUBLISHED: dict[str, tuple[object, int]] = {}  # name -> (spec, vocabulary): released shapes, planned
_plugins_loaded = False


def register(family: Family) -> Family:
    """Add a family and its presets and published shapes (a name already taken by another
    family is refused: two recipes for one name would train differently in different places)."""
    if not isinstance(family, Family):
        raise TypeError(f"register: {type(family).__name__} is not a meshtrain.recipes.Family")
    for name in (*family.presets, *family.published):
        owner = PRESETS.get(name) or PUBLISHED.get(name, (None,))[0]
        if owner is not None and family_of(owner) is not family:
            raise ValueError(f"register: the model name {name!r} of family {family.name!r} is taken already")
    FAMILIES[family.name] = family
    PRESETS.update(family.presets)
    PUBLISHED.update(family.published)
    return family


def add_preset(name: str, spec) -> None:
    """A preset made at run time (`train --init-from DIR` names the folder's architecture)."""
    family_of(spec)
    PRESETS[name] = spec


def family_of(spec) -> Family:
    """The family whose `spec_type` `spec` is."""
    for family in FAMILIES.values():
        if type(spec) is family.spec_type:
            return family
    raise ValueError(f"no registered model family builds a {type(spec).__name__}")


def family_of_model(model) -> Family | None:
    """The family a built model is of (None: not one of the registered families')."""
    return next((f for f in FAMILIES.values() if f.owns(model)), None)


def _load_plugins() -> None:
    """The families other packages declare (entry points of the group `meshtrain.recipes`), once."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points
    for point in entry_points(group=ENTRY_POINTS):
        found = point.load()
        register(found() if isinstance(found, type) else found)


def is_preset(name: str) -> bool:
    """Whether `train --model NAME` builds `name` (a registered family's preset)."""
    if name not in PRESETS:
        _load_plugins()
    return name in PRESETS


def is_published(name: str) -> bool:
    if name not in PUBLISHED:
        _load_plugins()
    return name in PUBLISHED


def spec_of(name: str, mlp_hidden: str = ""):
    """The preset `name`, with the MLP's hidden widths replaced when `mlp_hidden` gives them."""
    if not is_preset(name):
        raise KeyError(name)
    spec = PRESETS[name]
    return family_of(spec).with_options(spec, hidden=parse_widths(mlp_hidden)) if mlp_hidden else spec


def model_spec(name: str, *, mlp_hidden: str = "", dropout: float = 0.0, attention: str = "sdpa",
               moe: dict | None = None):
    """(family, spec) of a preset or a published shape, with the model flags applied (`moe`:
    a mixture of experts' routing and balancing fields)."""
    if name not in PRESETS and is_published(name) and not is_preset(name):  # a built-in preset reads no plugin
        spec = PUBLISHED[name][0]
    else:
        spec = spec_of(name)
    family = family_of(spec)
    return family, family.with_options(spec, dropout=dropout, attention=attention,
                                       hidden=parse_widths(mlp_hidden) if mlp_hidden else None,
                                       **({"moe": moe} if moe else {}))  # families without MoE flags take none


def tp_plan_of(name: str):
    """The tensor-parallel plan of a preset."""
    family, spec = model_spec(name)
    return family.tp_plan(spec)


def pipeline_plan_of(spec):
    """How a preset's spec is cut into pipeline stages."""
    return family_of(spec).pipeline_plan(spec)


def published_shapes() -> dict:
    """name -> `plan.shapes.Shape` of every published architecture."""
    _load_plugins()
    return {name: family_of(spec).shape(spec, vocab) for name, (spec, vocab) in PUBLISHED.items()}


def shape_of(name: str, vocab_size: int = 2048):
    """The planner's shape of a published architecture, or of a preset at `vocab_size` tokens."""
    if is_published(name):
        spec, vocab = PUBLISHED[name]
        return family_of(spec).shape(spec, vocab)
    shape = family_of(PRESETS[name]).shape(PRESETS[name], vocab_size) if is_preset(name) else None
    if shape is None:
        known = [n for n, s in PRESETS.items() if family_of(s).shape(s, vocab_size) is not None] + list(PUBLISHED)
        raise ValueError(f"unknown model '{name}' for the planner; use one of {', '.join(known)}")
    return shape


for _family in (gpt.FAMILY, llama.FAMILY, mlp.FAMILY, moe.FAMILY):
    register(_family)

__all__ = ["Family", "Recipe", "register", "add_preset", "family_of", "family_of_model", "is_preset", "is_published",
           "spec_of", "model_spec", "tp_plan_of", "pipeline_plan_of", "published_shapes", "shape_of", "PRESETS",
           "PUBLISHED", "FAMILIES"]
