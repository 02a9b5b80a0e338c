"""Where a low-bit optimizer (`meshtrain/lowbit.py`) may step pieces of a tensor: its moments
are quantized in blocks, each with its own scale, so a piece steps as the whole tensor would
only if it is made of whole blocks of that tensor. ZeRO lays its groups out so (`FlatGroup`'s
`align`); a tensor-parallel or expert-parallel shard is checked here."""

from __future__ import annotations

import math

import torch

from meshtrain.lowbit import quantizes
from meshtrain.parallel.options import ConfigError
from meshtrain.parallel.state import SHARD, shard_positions


def check_state_blocks(model: torch.nn.Module, block: int, comm) -> None:
    """Every tensor-parallel or expert-parallel shard of a quantized tensor is runs of whole
    blocks of the one-process tensor (so its blocks are the whole tensor's); refused,
    naming the first that is not (`ConfigError`: every rank refuses alike, one line)."""
    for name, p in model.named_parameters():
        spec = getattr(p, SHARD, None)
        if spec is None:
            continue
        axis, dim = spec[0], spec[1]
        full = list(p.shape)
        full[dim] *= comm.mesh.size(axis)
        if not quantizes(full, block):
            continue
        inner, outer = math.prod(full[dim + 1:]), math.prod(full[:dim])
        runs = []  # every rank's runs of consecutive positions along the split dim, [a, b): all alike refuse
        for coord in range(comm.mesh.size(axis)):
            positions = shard_positions(spec, p.shape[dim], coord, comm.mesh.size(axis))
            rows = list(range(positions.start, positions.stop)) if isinstance(positions, slice) else list(positions)
            start = rows[0]
            for prev, r in zip(rows, rows[1:] + [None]):
                if r != prev + 1:
                    runs.append((start, prev + 1))
                    start = r
        whole = all((o * full[dim] * inner + a * inner) % block == 0 and (b - a) * inner % block == 0
                    for o in range(min(outer, block)) for a, b in runs)
        if not whole:
            raise ConfigError(f"a low-bit optimizer keeps its moments in blocks of {block} elements, and {name} "
                             f"({'×'.join(map(str, full))}) is split over {axis} into pieces that are not whole "
                             f"blocks of it; use --optimizer adamw, or a layout that does not split it")
