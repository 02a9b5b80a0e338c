"""Optimizer, learning-rate schedule and gradient clipping.

Clipping uses the global gradient norm. Parameters that a strategy shards carry the mesh
axes they are split over in `SHARDED_OVER`; their partial squared norms are summed over those
axes, so the norm is the full model's whatever the layout (with pure data parallelism every
gradient is replicated and no communication is needed)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.config import TrainConfig

SHARDED_OVER = "meshtrain_sharded_over"


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases and norms do not (as in GPT-2 and nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(params, max_norm: float, comm: Comm) -> float:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm."""
    partial: dict[tuple[str, ...], torch.Tensor] = {}
    for p in params:
        if p.grad is None:
            continue
        axes = tuple(getattr(p, SHARDED_OVER, ()))
        sq = p.grad.detach().float().pow(2).sum()
        partial[axes] = partial[axes] + sq if axes in partial else sq
    total = 0.0
    for axes, sq in sorted(partial.items()):
        for axis in axes:
            comm.all_reduce(sq, axis)
        total += sq.item()
    norm = math.sqrt(total)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
