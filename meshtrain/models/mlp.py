"""The classic data-parallel example: a stack of Linear+ReLU layers and a linear head."""

import torch
import torch.nn as nn

from meshtrain.models.specs import MLPSpec


class MLP(nn.Module):
    def __init__(self, spec: MLPSpec, n_inputs: int, n_classes: int):
        super().__init__()
        widths = (n_inputs, *spec.hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)
