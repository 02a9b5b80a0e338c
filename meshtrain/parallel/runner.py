"""The step runner: what runs forward, loss and backward over one rank's micro-batches.
This one runs them one after the other; a pipeline schedule's interpreter takes its place."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch


class PlainRunner:
    """Each micro-batch in turn. Gradients are synchronised only after the last one: the
    others run under the synchroniser's `no_sync`. A failure half-way resets the
    synchroniser, so the next step starts clean."""

    def run(self, p, micro_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]], count: int,
            normalizer: float) -> torch.Tensor:
        """Forward and backward of micro-batches 0..count-1 (`micro_batch(i)` gives inputs — a
        tensor, or a dict of keyword arguments — and targets); returns this rank's summed loss ÷ `normalizer`, detached."""
        total = torch.zeros((), device=p.comm.mesh.device)
        try:
            for i in range(count):
                inputs, targets = micro_batch(i)
                with p.grad_sync.no_sync() if i < count - 1 else nullcontext():
                    # the output is not kept past the loss: backward frees what it no longer needs
                    with p.forward_scope(), p.loss_scope():
                        loss = p.loss_fn(p.module(**inputs) if isinstance(inputs, dict) else p.module(inputs),
                                         targets) / normalizer
                    (loss * p.loss_scale if p.loss_scale != 1 else loss).backward()
                total += loss.detach()
        except BaseException:
            p.grad_sync.reset()
            raise
        return total
