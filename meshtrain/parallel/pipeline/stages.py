"""Cutting a plain sequential model into pipeline stages, from outside.

A `PipelinePlan` names the model's parts: what runs before the blocks (the embedding), the
block list, what runs after (the final norm and the head), and the shape of the activation
between blocks. The blocks are split over p·v virtual stages as evenly as possible (8 blocks
over 3 stages: 3, 3, 2) or as `stage_layers` says; the first virtual stage also runs the
parts before, the last the parts after. A stage keeps one model object holding only its own
parts, under the full model's names: its blocks stay `blocks.5.*` (the block list keeps the
original indices), so verify and checkpoints match by name."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.parallel.pipeline.plan import PipelinePlan
from meshtrain.parallel.pipeline.schedules import split_layers


def refuse_tied_across_stages(model: nn.Module, plan: PipelinePlan) -> None:
    """A parameter used both before the blocks and after them (a head tied to the embedding)
    would live on the first and the last stage, and its two gradients would need summing
    between them: refused in one line, not trained wrongly."""
    before = {id(p): f"{name}.{pname}" for name in plan.before
              for pname, p in model.get_submodule(name).named_parameters()}
    for name in plan.after:
        for pname, p in model.get_submodule(name).named_parameters():
            if id(p) in before:
                raise ValueError(f"pipeline: {name}.{pname} is the same parameter as {before[id(p)]} (tied "
                                 f"embeddings), which would sit on the first and the last stage; untie them or "
                                 f"run with pp=1")


class Stage:
    """This rank's part of the model: chunk c runs virtual stage c·p + s."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage: int, stages: int, chunks: int,
                 stage_layers: list[int] | None = None):
        self.model, self.plan, self.stage, self.stages, self.chunks = model, plan, stage, stages, chunks
        if stages > 1:
            refuse_tied_across_stages(model, plan)
        blocks = model.get_submodule(plan.blocks)
        ranges = split_layers(len(blocks), stages * chunks, stage_layers)
        self.last_virtual = stages * chunks - 1
        self.block_ids = [list(ranges[c * stages + stage]) for c in range(chunks)]
        keep = {i for ids in self.block_ids for i in ids}
        for key in list(blocks._modules):  # keep the original indices: names stay those of the full model
            if int(key) not in keep:
                del blocks._modules[key]
        self.blocks = blocks
        for name in plan.before if not self.holds(0) else ():
            _drop(model, name)
        for name in plan.after if not self.holds(self.last_virtual) else ():
            _drop(model, name)

    def virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def holds(self, virtual_stage: int) -> bool:
        return virtual_stage % self.stages == self.stage

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.last_virtual

    def parts(self, chunk: int) -> list[nn.Module]:
        """What chunk `chunk` runs, in order: the parts before the blocks on the first virtual
        stage, its blocks, the parts after on the last."""
        before = [self.model.get_submodule(n) for n in self.plan.before] if self.is_first(chunk) else []
        after = [self.model.get_submodule(n) for n in self.plan.after] if self.is_last(chunk) else []
        return before + [self.blocks._modules[str(i)] for i in self.block_ids[chunk]] + after

    def forward(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts(chunk):
            x = part(x)
        return x


def _drop(model: nn.Module, name: str) -> None:
    parent, _, child = name.rpartition(".")
    delattr(model.get_submodule(parent) if parent else model, child)
