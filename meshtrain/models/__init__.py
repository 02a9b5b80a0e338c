"""Plain PyTorch models — `gpt.GPT`, `llama.Llama`, `mlp.MLP` — and their constructor
arguments (`specs`, no torch). They import nothing else of meshtrain: what the rest of the
package knows about each (presets, initial weights, plans, the planner's shape) is its
family's recipe (`meshtrain.recipes`), and Hugging Face folders are `meshtrain.hf`'s.

The names below the specs are old import paths, resolved lazily (`__getattr__`)."""

from __future__ import annotations

from meshtrain.models.specs import GPTSpec, LlamaSpec, MLPSpec, RopeScaling  # noqa: F401


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


_MOVED = {
    "build_model": "meshtrain.recipes.build",  # a preset with its weights: its recipe's
    "replace_submodule": "meshtrain.parallel.modules", "find_block_list": "meshtrain.parallel.modules",
    "published_llamas": "meshtrain.recipes.llama", "published_llama": "meshtrain.recipes.llama",
    "load_hf": "meshtrain.hf", "save_hf": "meshtrain.hf",  # Hugging Face folders (the API contract's names)
}


def __getattr__(name: str):
    """Old import paths: the strategies' module helpers and the presets' builder live elsewhere now."""
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'meshtrain.models' has no attribute {name!r}")
