"""Plain PyTorch models — `gpt.GPT`, `llama.Llama`, `mlp.MLP` — and their constructor
arguments (`specs`, no torch). They import nothing else of meshtrain: what the rest of the
package knows about each (presets, initial weights, plans, the planner's shape) is its
family's recipe (`meshtrain.recipes`), and Hugging Face folders are `meshtrain.hf`'s."""

from __future__ import annotations

from meshtrain.models.specs import GPTSpec, LlamaSpec, MLPSpec, RopeScaling  # noqa: F401


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
