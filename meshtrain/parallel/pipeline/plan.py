"""How a model is cut into pipeline stages, as data (no torch: a model family's recipe
states its plan beside its presets). `stages.Stage` does the cutting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PipelinePlan:
    """How to cut a model into stages: the modules `before` the blocks (run by the first
    stage, in order), the name of the block list (an nn.ModuleList or nn.Sequential whose
    children each take and return one tensor), the modules `after` (the last stage's), and
    `activation_shape(rows, seq)`: the shape of what one block hands the next for a
    micro-batch of `rows` samples of `seq` positions (`seq` is 1 for inputs without one)."""
    before: tuple[str, ...]
    blocks: str
    after: tuple[str, ...]
    activation_shape: Callable[[int, int], tuple[int, ...]]

    def check(self, model, virtual_stages: int) -> None:
        """One line if the plan does not fit `model` cut into `virtual_stages`: a name that is
        no module, a block list that is no list or has too few blocks, or parameters that no
        part covers (the stages must hold the whole model)."""
        import torch.nn as nn  # only here: a plan is data that recipes state before torch loads
        modules = dict(model.named_modules())
        for name in (*self.before, self.blocks, *self.after):
            if name not in modules:
                raise ValueError(f"pipeline: {name!r} names no module of the model")
        blocks = modules[self.blocks]
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"pipeline: blocks={self.blocks!r} is a {type(blocks).__name__}, not an nn.ModuleList "
                             f"or nn.Sequential")
        if len(blocks) < virtual_stages:
            raise ValueError(f"pipeline: {len(blocks)} blocks cannot fill {virtual_stages} stages (pp·chunks); use "
                             f"fewer stages or chunks")
        covered = {id(p) for name in (*self.before, self.blocks, *self.after) for p in modules[name].parameters()}
        missed = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missed:
            raise ValueError(f"pipeline: the stages do not cover the model: {missed[0]} is in none of before, blocks "
                             f"and after ({len(missed)} parameters missed)")
