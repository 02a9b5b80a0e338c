"""Old import path: the specs are `models.specs`; the named presets are their families'
recipes' (`meshtrain.recipes`), resolved lazily."""

from meshtrain.models.specs import GPTSpec, LlamaSpec, MLPSpec, RopeScaling  # noqa: F401


def __getattr__(name: str):
    if name in ("PRESETS", "spec_of", "parse_widths"):
        import meshtrain.recipes
        return getattr(meshtrain.recipes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
