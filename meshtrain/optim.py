"""Optimizer, learning-rate schedule and gradient clipping.

Clipping uses the global gradient norm. Parameters that a strategy shards carry the mesh
axes they are split over in `SHARDED_OVER`; their partial squared norms are summed over those
axes, so the norm is the full model's whatever the layout."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.config import TrainConfig
from meshtrain.mesh import AXES

SHARDED_OVER = "meshtrain_sharded_over"
# The axes over which a parameter is a replica unless it says it is sharded over them.
REPLICATED_AXES = ("dp", "tp")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (PyTorch-native peers hold those), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class AdamWOnViews(torch.optim.AdamW):
    """AdamW over tensors whose `.grad` is a view of buffers a synchroniser fills (ZeRO's
    shards): `zero_grad()` zeroes those buffers in place (`zero_buffers`) whatever
    `set_to_none` says. torch's default (None) would cut the views, and from then on AdamW
    would skip every tensor — and clipping see a norm of 0 — while the synchroniser went on
    filling the buffers; and zeroing only the views would leave the rest of a full gradient
    buffer (ZeRO-1's) to add last step's gradients into the next."""

    def __init__(self, params, *, zero_buffers: Callable[[], None], **options):
        super().__init__(params, **options)
        self._zero_buffers = zero_buffers

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zero_buffers()


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], decay: set[str],
                    cfg: TrainConfig, *, zero_buffers: Callable[[], None] | None = None) -> torch.optim.Optimizer:
    """AdamW; the parameters named in `decay` (matrices, as in GPT-2 and nanoGPT: decided on
    the full parameters, since a shard's shape says nothing) decay, biases and norms do not.
    The tensors are stepped as given: parameters, or ZeRO's pieces of them, whose gradients
    are views of the buffers `zero_buffers` zeroes (`AdamWOnViews`)."""
    params = named_params
    groups = [{"params": [p for n, p in params if n in decay], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
    options = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    groups = [g for g in groups if g["params"]]
    if zero_buffers is not None:
        return AdamWOnViews(groups, zero_buffers=zero_buffers, **options)
    return torch.optim.AdamW(groups, **options)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(params, max_norm: float, comm: Comm) -> float:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm.

    Every rank issues the same collectives whatever gradients it holds (a pipeline stage owns
    some parameters, a shard may be empty): one all-reduce of one number per mesh axis,
    counted under `metrics`. Each tensor's squared norm counts once: a replicated gradient
    only on the ranks at coordinate 0 of the axes it is replicated over; a sharded one
    (`SHARDED_OVER`) on every rank of those axes; pipeline stages hold different parameters,
    so every stage counts. A norm that is not finite is returned as it is, with nothing
    scaled: the caller skips the step."""
    mesh = comm.mesh
    total = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for p in params:
        if p.grad is None:
            continue
        sharded = set(getattr(p, SHARDED_OVER, ()))
        if all(mesh.coord(axis) == 0 for axis in REPLICATED_AXES if axis not in sharded):
            total += local_tensor(p.grad).detach().float().pow(2).sum()
    for axis in AXES:
        comm.all_reduce(total, axis, purpose=METRICS)
    norm = math.sqrt(total.item())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
