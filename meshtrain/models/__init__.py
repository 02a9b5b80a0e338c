"""Plain PyTorch models. Weights are a function of (seed, parameter name) (`models.init`):
`build_model` builds the structure on the `meta` device and draws every parameter; training
builds on `meta`, lets the strategies cut and shard the structure, and each rank draws only
what it holds (the same values).

torch is imported inside the functions: `config` reads the presets below this package, and
a bad flag must be refused without the second it takes to import torch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshtrain.models.presets import GPTSpec, LlamaSpec, MLPSpec, spec_of

if TYPE_CHECKING:
    import torch


def build_model(name: str, seed: int, *, vocab_size: int = 256, n_inputs: int = 64, n_classes: int = 10,
                dropout: float = 0.0, attention: str = "sdpa", mlp_hidden: str = "",
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """The preset `name` with its initial weights from `seed` (`mlp_hidden`: the MLP's hidden
    widths, e.g. "1024,1024"); on `device="meta"`, its structure only (`models.init.init_spec`
    says how to draw it)."""
    import torch

    from meshtrain.models.init import init_spec, materialize, to_placeholders
    if name in published_llamas():  # the planner's published shapes, as models (meta, for a start)
        spec, vocab_size = published_llama(name)
    else:
        spec = spec_of(name, mlp_hidden)
    with torch.device("meta"):
        if isinstance(spec, GPTSpec):
            from meshtrain.models.gpt import GPT
            model = GPT(dataclasses.replace(spec, dropout=dropout, attention=attention), vocab_size)
        elif isinstance(spec, LlamaSpec):
            from meshtrain.models.llama import Llama
            model = Llama(spec, vocab_size)
        elif isinstance(spec, MLPSpec):
            from meshtrain.models.mlp import MLP
            model = MLP(spec, n_inputs, n_classes)
        else:
            raise ValueError(f"unknown model {name}")
    if str(device) == "meta":
        return model
    init = init_spec(model, seed)
    to_placeholders(model, device)
    materialize(model, lambda name, p: init.full_value(name).to(device=p.device, dtype=p.dtype))
    return model


def published_llamas() -> list[str]:
    """The planner's published Llama shapes (llama2-7b, llama3-8b, ...)."""
    from meshtrain.plan.shapes import PUBLISHED
    return [n for n, sh in PUBLISHED.items() if sh.kind == "llama"]


def published_llama(name: str) -> tuple[LlamaSpec, int]:
    """(spec, vocabulary) of a published Llama shape: Llama 2's RoPE base 10,000, Llama 3's
    500,000 (with 3.1's llama3 scaling left to the weights' own config.json)."""
    from meshtrain.plan.shapes import PUBLISHED
    sh = PUBLISHED[name]
    spec = LlamaSpec(n_layers=sh.layers, n_heads=sh.heads, n_kv_heads=sh.kv_heads, d_model=sh.hidden,
                     ffn_dim=sh.ffn_width, max_seq_len=sh.seq_len, rope_theta=500000.0 if "llama3" in name else 10000.0)
    return spec, sh.vocab


def load_hf(folder, device="cpu", dtype=None) -> torch.nn.Module:
    """A Hugging Face Llama folder (config.json + safetensors) as meshtrain's plain `Llama`."""
    from meshtrain.models import hf
    return hf.load_hf(folder, device=device, dtype=dtype)


def save_hf(model: torch.nn.Module, folder, dtype=None, **side) -> None:
    """A `Llama` as a Hugging Face folder that transformers loads as is (`side`: `like=` an
    imported folder whose configs and tokenizer to carry over, or `tokenizer=`; `hf.save_hf`)."""
    from meshtrain.models import hf
    hf.save_hf(model, folder, dtype=dtype, **side)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def __getattr__(name: str):
    """Old import paths: the strategies' module helpers live in `parallel.modules` now."""
    if name in ("replace_submodule", "find_block_list"):
        from meshtrain.parallel import modules
        return getattr(modules, name)
    raise AttributeError(f"module 'meshtrain.models' has no attribute {name!r}")
