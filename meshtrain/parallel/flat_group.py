"""ZeRO's flat groups: parameters flattened into one zero-padded buffer of N·S elements, of
which dp rank r owns [r·S, (r+1)·S) — its shard — and where each parameter's piece of it
sits. Built from the parameters, or (placeholders, `parallel.materialize`) drawn one parameter at a
time, so that a rank never holds more than its part plus one parameter."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from meshtrain.comm import Comm
from meshtrain.metrics import note_buffer
from meshtrain.parallel.materialize import is_placeholder
from meshtrain.parallel.state import Where, shard_index


def _buffer(numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A communication buffer: allocated outside any dispatch mode, so that the activation
    meter does not count parameters and gradients in transit as activations."""
    with _disable_current_modes():
        return note_buffer(torch.zeros(numel, dtype=dtype or like.dtype, device=like.device))


class FlatGroup:
    """Parameters flattened into one buffer of n·S elements, of which this rank owns [lo, hi)."""

    def __init__(self, index: int, label: str, named: list[tuple[str, nn.Parameter]], comm: Comm, axis: str,
                 keep_full: bool, draw: Callable[[str, nn.Parameter], torch.Tensor] | None = None, align: int = 1):
        """`draw(name, p)`: this rank's values of a placeholder parameter (`parallel.materialize`),
        drawn as the group is built, so no rank holds more than its part plus one parameter.
        `align`: every parameter and every shard starts at a multiple of it (a low-bit
        optimizer's block: each piece is then whole blocks of its parameter), zeros between."""
        self.index, self.label = index, label
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += -(-p.numel() // align) * align
        n = comm.mesh.size(axis)
        self.shard_size = -(-total // (n * align)) * align
        self.padded = n * self.shard_size
        self.lo = comm.mesh.coord(axis) * self.shard_size
        self.hi = self.lo + self.shard_size
        # Where each parameter's piece of the shard sits (its tensor-parallel part, then the
        # flat range of it), decided while the parameters still have their shapes.
        self.pieces: list[tuple[int, Where, slice]] = []  # (param number, where, range in the shard)
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                self.pieces.append((i, Where(shard_index(p, comm), (a - off, b - off)), slice(a - self.lo, b - self.lo)))
        self.full: torch.Tensor | None = None
        self.work = None  # an all-gather in flight into `full`

        def source(i: int) -> torch.Tensor:
            """Parameter i's values: drawn now if it is a placeholder (one at a time)."""
            p = self.params[i]
            return draw(self.names[i], p) if draw is not None and is_placeholder(p) else p.detach()

        with torch.no_grad():
            if keep_full:  # stages 1 and 2: the parameters are views of the full buffer
                full = _buffer(self.padded, self.params[0])
                for i, off in enumerate(self.offsets):
                    full[off:off + self.params[i].numel()].copy_(source(i).reshape(-1))
                self.shard = full[self.lo:self.hi]
                self.point_params_at(full)
            else:  # stage 3: only the shard is ever built
                self.shard = _buffer(self.shard_size, self.params[0])
                for i, where, span in self.pieces:
                    self.shard[span].copy_(source(i).reshape(-1)[where.flat[0]:where.flat[1]])
                self.release_params()
        # Set by `Zero`: the gradients (stage 1's full buffer and its views; the shard's), the
        # tensors the optimizer steps (one per piece), and the bookkeeping of a sync.
        self.grad_full: torch.Tensor | None = None
        self.grad_views: dict[nn.Parameter, torch.Tensor] = {}
        self.grad_shard: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []
        self.ready: set[nn.Parameter] = set()  # gradients complete in this backward (stage 1: this sync)
        self.reduced = False  # its reduce-scatter launched and not yet taken in
        self.owners, self.seen = 0, 0  # stage 3: modules whose forward uses the group; how many ran

    def point_params_at(self, full: torch.Tensor) -> None:
        self.full = full
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = full[off:off + shape.numel()].view(shape)

    def release_params(self) -> None:
        self.full = None
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def flat_from(self, tensors: list[torch.Tensor | None], dtype: torch.dtype | None = None) -> torch.Tensor:
        """One padded flat buffer of per-parameter tensors (None: zeros)."""
        flat = _buffer(self.padded, self.shard, dtype)
        for t, off in zip(tensors, self.offsets):
            if t is not None:
                flat[off:off + t.numel()].copy_(t.reshape(-1))
        return flat

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)
