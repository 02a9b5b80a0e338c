"""Data parallelism: our own, not torch DDP.

Gradients live in contiguous buckets (each parameter's `.grad` is a view into its bucket),
filled in reverse order of registration, which is the order backward produces them. A
post-accumulate-grad hook counts the gradients of each bucket; the moment a bucket is
complete its all-reduce is launched asynchronously, so communication overlaps the rest of
the backward pass. Buckets are launched in index order (the same order on every rank), and
all are waited on before the optimizer step.

Gradients are summed, not averaged: the training loop divides the loss by the global
number of tokens, so the sum over ranks (and over accumulated micro-batches) is exactly the
full-batch gradient. Inside `no_sync()` gradients only accumulate locally."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.comm import Comm


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pending = len(params)
        self.work = None


class DataParallel:
    """Attach bucketed, overlapped gradient all-reduce over `axis` to `model`'s parameters.
    The model is not wrapped: its forward, names and state dict stay as they were."""

    def __init__(self, model: nn.Module, comm: Comm, *, axis: str = "dp", bucket_mb: float = 25.0,
                 on_launch: Callable[[int], None] | None = None):
        self.comm, self.axis, self.on_launch = comm, axis, on_launch
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = _make_buckets(list(reversed(params)), int(bucket_mb * 2**20))
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        for b in self.buckets:
            for p in b.params:
                p.grad = b.views[p]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync = True
        self._next_launch = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        view = bucket.views[p]
        if p.grad.data_ptr() != view.data_ptr():  # someone reset .grad (zero_grad(set_to_none=True))
            view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch complete buckets in index order, so every rank issues the same sequence."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            bucket.work = self.comm.all_reduce(bucket.buffer, self.axis, async_op=True)
            if self.on_launch is not None:
                self.on_launch(bucket.index)
            self._next_launch += 1

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce; a bucket with unused parameters is sent now."""
        for bucket in self.buckets[self._next_launch:]:
            bucket.pending = 0
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.pending = len(bucket.params)
        self._next_launch = 0

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication (all micro-batches but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Greedy split into buckets of about `cap_bytes`, one dtype and device per bucket."""
    buckets, current, size = [], [], 0
    for p in params:
        if current and (size >= cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets
