"""What a PyTorch-native peer is built from: typed options the command line fills from its
configuration (`cli.bench.bench_options`), so that the peers never read the command line's `Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.parallel.options import Layout
from meshtrain.parallel.pipeline.stages import PipelinePlan


@dataclass(frozen=True)
class PeerOptions:
    """`layout`: ours' layout (its precision and gradient dtype, bucket size, SP, the
    pipeline's schedule, chunks, micro-batches and blocks per stage; the axis sizes live on
    the mesh). `build_model(device)`: the full, unsharded model with ours' initial weights,
    one process's. `lr`, `weight_decay`: the AdamW ours runs. `pipeline`: how the model is
    cut into stages (torch-pp only)."""
    layout: Layout
    build_model: Callable[[torch.device], nn.Module]
    lr: float
    weight_decay: float
    pipeline: PipelinePlan | None = None
