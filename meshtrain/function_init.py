"""A user's `init=fn(name, tensor, generator)` (`meshtrain.parallelize`) in the form the
strategies draw weights from (`parallel.materialize`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.parallel.materialize import stable_seed


class FunctionInit:
    """A user's `init=fn(name, tensor, generator)` in the form the strategies draw from: each
    parameter's full value from a CPU generator seeded by (seed, name), so every rank and the
    one-process reference draw the same values, each only for what it keeps."""

    def __init__(self, fn, shapes: dict[str, tuple[int, ...]], seed: int):
        self.fn, self.shapes, self.seed = fn, shapes, seed

    @classmethod
    def of(cls, model: nn.Module, fn, seed: int) -> "FunctionInit":
        if not callable(fn):
            raise TypeError("init: pass fn(name, tensor, generator) that fills the parameter's tensor in place")
        return cls(fn, {n: tuple(p.shape) for n, p in model.named_parameters()}, seed)

    def full_value(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shapes[name], dtype=torch.float32)
        with torch.no_grad():
            self.fn(name, out, torch.Generator().manual_seed(stable_seed(self.seed, name)))
        return out

    def fingerprint(self) -> int:
        text = repr((self.seed, sorted(self.shapes.items()), getattr(self.fn, "__qualname__", repr(self.fn))))
        return stable_seed(0, text)
