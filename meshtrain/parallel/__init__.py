"""Strategies, applied from outside the model in one fixed order, written once here:
cut pipeline stages -> tensor-parallel plan -> activation checkpointing -> ZeRO/FSDP or
data-parallel gradient sync -> (the optimizer, built by the caller on what comes out).
This version has data parallelism; the other steps slot in here as they are built."""

from __future__ import annotations

import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.config import LayoutConfig
from meshtrain.parallel.data import DataParallel


def parallelize(model: nn.Module, comm: Comm, layout: LayoutConfig, **dp_options) -> DataParallel | None:
    """Apply the layout's strategies to `model` in place; returns the gradient synchroniser
    the training loop drives (None when there is nothing to synchronise)."""
    if comm.mesh.size("dp") == 1:
        return None
    return DataParallel(model, comm, axis="dp", bucket_mb=layout.bucket_mb, **dp_options)


def full_state_dict(model: nn.Module) -> dict:
    """Every parameter at full shape, as one process would hold it (CPU copies).
    Data parallelism replicates parameters, so the local state is already the full state;
    sharding strategies gather here."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
