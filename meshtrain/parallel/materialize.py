"""Initial weights as a function of (seed, parameter name), so that no rank builds the
whole model: the structure is built on the `meta` device, strategies cut and shard it, and
each rank draws only the parameters it holds — each the same values one process would give
it, drawn whole on the CPU generator (whatever the device) from a stable hash of the seed
and its full name, then sliced to the rank's piece. The one-process reference draws from the
same function, so every layout starts from the same weights by construction.

A rule is data (`("normal", std)`, `("uniform", bound)`, `("ones",)`, `("zeros",)`; a
normal rule may name rows to leave zero after it, `("normal", std, row, ...)`: an
embedding's padding row, as `nn.Embedding` and transformers' initialisation leave it), so that
ranks can compare their specs (`InitSpec.fingerprint`) before any weight exists. The rules
of meshtrain's own models are their recipes' (`meshtrain.recipes`); a strategy takes an
`InitSpec` as an argument and knows no model."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

Rule = tuple  # ("normal", std, *zero_rows) | ("uniform", bound) | ("ones",) | ("zeros",)


def stable_seed(seed: int, name: str) -> int:
    """A generator seed from (seed, name) that every process and run agrees on (not `hash()`)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class InitSpec:
    """How to draw each parameter of a model at its one-process (full) shape."""
    seed: int
    shapes: dict[str, tuple[int, ...]]
    rules: dict[str, Rule]

    def full_value(self, name: str) -> torch.Tensor:
        """The parameter's full initial value, fp32 on the CPU."""
        out = torch.empty(self.shapes[name], dtype=torch.float32)
        generator = torch.Generator().manual_seed(stable_seed(self.seed, name))
        kind, *args = self.rules[name]
        if kind == "normal":
            out.normal_(0.0, args[0], generator=generator)
            for row in args[1:]:  # drawn, then zeroed: the other rows are those of a rule without it
                out[row] = 0.0
        elif kind == "uniform":
            out.uniform_(-args[0], args[0], generator=generator)
        elif kind == "ones":
            out.fill_(1.0)
        elif kind == "zeros":
            out.zero_()
        else:
            raise ValueError(f"unknown initialisation rule {self.rules[name]!r} for {name}")
        return out

    def fingerprint(self) -> int:
        """A number every rank building the same model from the same seed shares."""
        text = repr((self.seed, sorted(self.shapes.items()), sorted(self.rules.items())))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


# ---- placeholders: a parameter with its shape and dtype but (almost) no storage ------------

def placeholder(shape: torch.Size | tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A real tensor of `shape` over one element of storage (every stride 0): it has the
    parameter's shape, dtype and device (so strategies can slice, group and hook it) and
    costs nothing until its values are drawn into it."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """No real parameter of one dimension or more has every stride 0; a placeholder (and any
    slice of one) does."""
    return t.dim() > 0 and all(s == 0 for s in t.stride())


def to_placeholders(model: nn.Module, device) -> None:
    """Swap every meta parameter of `model` for a placeholder on `device` (the same Parameter
    object; shard specs and other attributes stay)."""
    for module in model.modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if p.dim() == 0:
                    raise ValueError(f"parameter {leaf} of {type(module).__name__} is a scalar: a model with scalar "
                                     "parameters cannot be built on the meta device yet")
                q = nn.Parameter(placeholder(p.shape, p.dtype, device), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                module._parameters[leaf] = q
    for module in model.modules():
        state = getattr(module, "fp32_state_buffers", ())
        for leaf, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                if leaf not in state:
                    raise ValueError("a model built on the meta device has buffers, which are recomputed, not "
                                     "drawn: this model cannot be built that way yet")
                module._buffers[leaf] = torch.zeros(b.shape, dtype=torch.float32, device=device)


def cast_keeping_state_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)`, but a module's `fp32_state_buffers` (running state it keeps and
    updates, such as a router's balancing bias and its load counts) stay fp32 with the values
    they had: small steps vanish in bf16, and a cast there and back would round what a model
    already carries (a router bias of 0.3333333 came back as 0.3339844)."""
    kept = [(module, leaf, b) for module in model.modules() for leaf in getattr(module, "fp32_state_buffers", ())
            if (b := module._buffers.get(leaf)) is not None]
    model.to(dtype)
    for module, leaf, b in kept:  # the tensors from before the cast, which made new ones
        module._buffers[leaf] = b.float()


def materialize(model: nn.Module, values) -> None:
    """Draw every placeholder parameter: `values(name, p)` gives this rank's piece."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_placeholder(p):
                p.data = values(name, p)


@dataclass(frozen=True)
class ModelRules:
    """Initialisation rules read off a model's built structure (`rules(model) -> {name:
    Rule}`), as a model family states them: `spec(model, seed)` is the `InitSpec` to draw from."""
    rules: object

    def spec(self, model: nn.Module, seed: int) -> InitSpec:
        return InitSpec(seed, {n: tuple(p.shape) for n, p in model.named_parameters()}, self.rules(model))
