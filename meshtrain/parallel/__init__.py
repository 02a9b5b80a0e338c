"""Strategies, applied from outside the model in one fixed order, written once here:
cut pipeline stages -> tensor-parallel plan -> activation checkpointing -> ZeRO/FSDP or
data-parallel gradient sync -> the optimizer, built on what comes out.
This version has data parallelism; the other steps slot in here as they are built.

`parallelize` is the one path from a plain `nn.Module`, a mesh (through its `Comm`) and a
layout to what a training loop drives, the `Parallelized` object: the CLI's loop and a
user's own loop go through it alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.config import LayoutConfig, TrainConfig
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import build_optimizer
from meshtrain.parallel.data import DataParallel
from meshtrain.parallel.runner import PlainRunner
from meshtrain.parallel.state import cpu_copy, load_optimizer_state, optimizer_state


@dataclass
class Parallelized:
    """What the training loop drives. `module` is called for forward; `loss_fn(output,
    targets)` gives the summed loss; `grad_sync` makes gradients whole (`no_sync`,
    `finish_grad_sync`, `reset`); `optimizer` was built after sharding; `runner` runs one
    rank's micro-batches. Gradients are scaled by `loss_scale` (a peer that averages over
    ranks, like torch DDP, needs dp).

    The `full_*` methods are collective: every rank calls them (sharding strategies gather
    there), and each returns the full-shape tensors as one process would hold them."""
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_sync: object
    optimizer: torch.optim.Optimizer
    runner: PlainRunner
    comm: Comm
    loss_scale: float = 1.0

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the full model's names (wrappers add no prefix)."""
        return list(self.module.named_parameters())

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def full_state_dict(self) -> dict:
        """{"model": weights by name, "optim": each parameter's optimizer state by name}, CPU copies.
        Data parallelism replicates everything, so the local state is the full state."""
        names = {p: n for n, p in self.named_parameters()}
        return {"model": {k: cpu_copy(v) for k, v in self.module.state_dict().items()},
                "optim": optimizer_state(self.optimizer, names)}

    def load_full_state_dict(self, state: dict) -> None:
        """Take weights and optimizer state from a full state (each rank keeps its part)."""
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, dict(self.named_parameters()), state.get("optim", {}))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient at full shape (CPU copies), as synchronised."""
        return {n: cpu_copy(p.grad) for n, p in self.named_parameters() if p.grad is not None}

    def local_pieces(self) -> dict[str, tuple[nn.Parameter, tuple | None]]:
        """What this rank holds of each tensor: (its local parameter, the index of that piece
        in the full tensor, None for all of it). Every rank's piece must equal that part of
        the full state: replicas bit-identical, shards where they live (checked by verify)."""
        return {n: (p, None) for n, p in self.named_parameters()}


def parallelize(model: nn.Module, comm: Comm, layout: LayoutConfig, train: TrainConfig, *,
                loss_fn=cross_entropy_sum, **dp_options) -> Parallelized:
    """Apply the layout's strategies to `model` (in place; it must hold the full weights, the
    same on every rank) and build the optimizer on the result."""
    # Decided on the full parameters, before any strategy reshapes them: matrices decay.
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    # (pipeline stages, the tensor-parallel plan and activation checkpointing go here)
    grad_sync = DataParallel(model, comm, axis="dp", bucket_mb=layout.bucket_mb, **dp_options)
    optimizer = build_optimizer(list(model.named_parameters()), decay, train)
    return Parallelized(model, loss_fn, grad_sync, optimizer, PlainRunner(), comm)
