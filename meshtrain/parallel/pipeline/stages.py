"""Cutting a plain sequential model into pipeline stages, from outside.

A `PipelinePlan` names the model's parts: what runs before the blocks (the embedding), the
block list, what runs after (the final norm and the head), and the shape of the activation
between blocks. The blocks are split over p·v virtual stages as evenly as possible (8 blocks
over 3 stages: 3, 3, 2) or as `stage_layers` says; the first virtual stage also runs the
parts before, the last the parts after. A stage keeps one model object holding only its own
parts, under the full model's names: its blocks stay `blocks.5.*` (the block list keeps the
original indices), so verify and checkpoints match by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.parallel.pipeline.schedules import split_layers


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

    def check(self, model: nn.Module, virtual_stages: int) -> None:
        """One line if the plan does not fit `model` cut into `virtual_stages`: a name that is
        no module, a block list that is no list or has too few blocks, or parameters that no
        part covers (the stages must hold the whole model)."""
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


def gpt_plan(d_model: int) -> PipelinePlan:
    return PipelinePlan(("embed",), "blocks", ("norm", "head"), lambda b, s: (b, s, d_model))


def mlp_plan(width: int) -> PipelinePlan:
    return PipelinePlan((), "blocks", ("head",), lambda b, s: (b, width))


def llama_plan(d_model: int) -> PipelinePlan:
    """The Llama: the token embedding on the first stage, the final norm and head on the last."""
    return PipelinePlan(("embed_tokens",), "layers", ("norm", "lm_head"), lambda b, s: (b, s, d_model))


def plan_for(spec) -> PipelinePlan:
    """How a preset (its spec) is cut: meshtrain's own models are reached only through their plans."""
    from meshtrain.models.presets import GPTSpec, LlamaSpec
    if isinstance(spec, GPTSpec):
        return gpt_plan(spec.d_model)
    return llama_plan(spec.d_model) if isinstance(spec, LlamaSpec) else mlp_plan(spec.hidden[-1])


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
