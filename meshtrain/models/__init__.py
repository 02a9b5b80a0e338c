"""Plain PyTorch models — `gpt.GPT`, `llama.Llama`, `mlp.MLP` — and their constructor
arguments (`specs`, no torch). They import nothing else of meshtrain: what the rest of the
package knows about each (presets, initial weights, plans, the planner's shape) is its
family's recipe (`meshtrain.recipes`), and Hugging Face folders are `models.hf`'s.

The names below the specs are old import paths, resolved lazily (`__getattr__`)."""

from __future__ import annotations

from meshtrain.models.specs import GPTSpec, LlamaSpec, MLPSpec, RopeScaling  # noqa: F401


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def load_hf(folder, device="cpu", dtype=None):
    """A Hugging Face Llama folder (config.json + safetensors) as meshtrain's plain `Llama`."""
    from meshtrain.models import hf
    return hf.load_hf(folder, device=device, dtype=dtype)


def save_hf(model, folder, dtype=None, **side) -> None:
    """A `Llama` as a Hugging Face folder that transformers loads as is (`side`: `like=` an
    imported folder whose configs and tokenizer to carry over, or `tokenizer=`; `hf.save_hf`)."""
    from meshtrain.models import hf
    hf.save_hf(model, folder, dtype=dtype, **side)


_MOVED = {
    "build_model": "meshtrain.recipes.build",  # a preset with its weights: its recipe's
    "replace_submodule": "meshtrain.parallel.modules", "find_block_list": "meshtrain.parallel.modules",
    "published_llamas": "meshtrain.recipes.llama", "published_llama": "meshtrain.recipes.llama",
}


def __getattr__(name: str):
    """Old import paths: the strategies' module helpers and the presets' builder live elsewhere now."""
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'meshtrain.models' has no attribute {name!r}")
