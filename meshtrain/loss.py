"""The default loss: cross-entropy summed over every prediction (tokens, or images for the
MLP). Summed, not averaged: the training step divides by the global number of loss terms,
so micro-batches and data-parallel ranks add up to exactly the full-batch gradient."""

import torch
import torch.nn.functional as F


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
