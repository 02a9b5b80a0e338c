"""Dropout that every layout draws alike, so that `verify` can check runs with dropout.

Each sample's mask at each site is a pure function of (seed, step, the sample's index in
the global batch, the site's module name): a generator seeded from those draws the mask at
the full shape of one sample's activation, and a rank whose activation is a shard (this
rank's chunk of the sequence under SP, its heads under TP) keeps that chunk of the mask. So
one process, any data-parallel or micro-batch split, any tensor- or sequence-parallel
layout — and, later, any recomputation — drop exactly the same elements.

The cost: every rank draws the whole mask of each of its samples, tp times the random
numbers of its shard, one generator per sample and site. The cheaper alternative is
Megatron's RNG tracker (a generator per tp rank for sharded regions, a shared one for
replicated ones): each rank draws only its shard, but the masks then depend on the layout,
and no layout could be compared with one process."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.models import replace_submodule
from meshtrain.parallel.context import sequence_positions


class DropoutKeys:
    """Where the micro-batch being computed sits: the step and its rows of the global batch.
    The training step sets it before each micro-batch's forward."""

    def __init__(self, seed: int):
        self.seed, self.step, self.rows = seed, 0, slice(0, 0)

    def use(self, step: int, rows: slice) -> None:
        self.step, self.rows = step, rows

    def key(self, row: int, site: str) -> int:
        raw = hashlib.blake2b(f"{self.seed}/{self.step}/{row}/{site}".encode(), digest_size=8).digest()
        return int.from_bytes(raw, "little") & (2**63 - 1)


class SeededDropout(nn.Module):
    """nn.Dropout with masks from `DropoutKeys`. `shard` = (dim, comm): the input is this
    rank's tp chunk along `dim` (counted without the batch dimension's shift: dim ≥ 1).
    `tokens` = (rank, cp): under context parallelism the input [b, s/cp, ...] holds cp rank
    `rank`'s tokens of each sequence (head-tail), whose one-process mask it keeps."""

    def __init__(self, p: float, keys: DropoutKeys, site: str):
        super().__init__()
        self.p, self.keys, self.site = p, keys, site
        self.shard: tuple[int, Comm] | None = None
        self.tokens: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        shape = list(x.shape[1:])
        if self.shard is not None:
            dim, comm = self.shard
            shape[dim - 1] *= comm.mesh.size("tp")
        positions = None
        if self.tokens is not None:
            if x.dim() != 3:
                raise RuntimeError(f"dropout at {self.site}: context parallelism drops [batch, tokens, features] "
                                   f"activations only; attention-probability dropout is refused under cp")
            rank, cp = self.tokens
            shape[0] *= cp
            positions = sequence_positions(shape[0], rank, cp)
        rows = range(self.keys.rows.start, self.keys.rows.stop)
        if len(rows) != x.shape[0]:
            raise RuntimeError(f"dropout at {self.site}: {x.shape[0]} samples but the keys name {len(rows)}")
        masks = []
        for row in rows:
            # Drawn on the CPU generator whatever the device: CUDA's Philox draws other bits,
            # and a GPU run must drop what the CPU reference drops (verify --device cuda).
            g = torch.Generator()
            g.manual_seed(self.keys.key(row, self.site))
            keep = torch.rand(shape, generator=g) >= self.p
            if positions is not None:  # this cp rank's tokens, then (under SP) its tp chunk of them
                keep = keep[positions]
            if self.shard is not None:
                n = x.shape[dim]
                keep = keep.narrow(dim - 1, comm.mesh.coord("tp") * n, n)
            masks.append(keep)
        return x * torch.stack(masks).to(x.device, non_blocking=True) / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"


def seed_dropout(model: nn.Module, keys: DropoutKeys) -> None:
    """Replace every active nn.Dropout of `model` by a SeededDropout named after its site."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout) and module.p > 0:
            replace_submodule(model, name, SeededDropout(module.p, keys, name))
