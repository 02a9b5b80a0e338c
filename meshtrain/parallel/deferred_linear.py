"""A linear layer whose weight gradient is formed later, elsewhere: its backward computes only
the input gradient δ·W and hands (x, δ) to its layer (`layer.defer(x, δ, wants_bias)`, which
returns the bias gradient if it forms it now, else None). Zero-bubble's weight pass
(`pipeline/split.py`) and data parallelism's all-gather path for linear layers
(`linear_gather.py`) both build on it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def owner_counts(model: nn.Module) -> dict[nn.Parameter, int]:
    """How many modules own each parameter directly: a weight owned by more than one (tied)
    has gradients from elsewhere too, so its layer cannot form them alone later."""
    owners: dict[nn.Parameter, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[p] = owners.get(p, 0) + 1
    return owners


def input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """δ·W, the one gradient the backward forms (its own seam: a test counts it)."""
    return grad.matmul(weight)


class DeferredWeightLinear(torch.autograd.Function):
    """y = x Wᵀ + b; `layer` takes (x, δ) in backward. Give it the weight detached when no
    gradient may reach the weight's accumulator (whose post-accumulate hooks would fire)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        bias_grad = ctx.layer.defer(x, grad, ctx.needs_input_grad[2])
        dx = input_grad(grad, weight) if ctx.needs_input_grad[0] else None
        return dx, None, bias_grad, None
