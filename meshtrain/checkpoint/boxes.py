"""Where a rank's piece of a tensor sits in the full tensor, as boxes (offsets and sizes in
the full tensor's coordinates), each with a view of the rank's memory that holds it: what a
sharded checkpoint records and reads, whatever strategy cut the piece.

A piece is the part `Where` describes: a tensor-parallel part (every position along one
dimension, or, for a fused layer, the rank's chunk of each section: several contiguous
segments), and of that part a flat range in row-major order (ZeRO's shards). A flat range
of a row-major array is a union of at most 2(ndim−1)+1 boxes: a partial first row, whole
rows, a partial last row, recursively. Padding is never part of a piece, so never a box."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from meshtrain.parallel.state import Where


@dataclass(frozen=True)
class Box:
    """`view` (a view of rank memory) holds the full tensor's block at `offsets`, of `sizes`."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    view: torch.Tensor


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [lo, hi) of a row-major array of `shape`, as boxes (offsets, sizes) in
    row-major order, each contiguous in the array's memory; at most 2(ndim−1)+1 of them."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = prod(shape[1:])
    rest = tuple(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    a, b = lo - first * inner, hi - last * inner  # within the first row, within the last row

    def within(row: int, x: int, y: int):
        return [((row, *o), (1, *s)) for o, s in flat_boxes(rest, x, y)]

    if first == last and (a > 0 or b < inner):
        return within(first, a, b)
    head, tail = [], []
    if a > 0:
        head, first = within(first, a, inner), first + 1
    if b < inner:
        tail, last = within(last, 0, b), last - 1
    whole = [((first, *(0,) * len(rest)), (last - first + 1, *rest))] if first <= last else []
    return head + whole + tail


def segments_of(positions: slice | list[int], length: int) -> list[tuple[int, int, int]]:
    """The runs of consecutive full-tensor positions a rank holds along the split dimension,
    as (local start, full start, length)."""
    if isinstance(positions, slice):
        start = positions.start or 0
        return [(0, start, (positions.stop if positions.stop is not None else length) - start)]
    runs: list[list[int]] = []
    for i, p in enumerate(positions):
        if runs and p == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([i, p, 1])
    return [tuple(r) for r in runs]


def boxes(tensor: torch.Tensor, where: Where, full_shape: tuple[int, ...]) -> list[Box]:
    """The boxes of the full tensor (of `full_shape`) that `tensor`, a rank's piece placed
    by `where`, holds, with views of `tensor` for each. `tensor` is laid out as its piece
    is: the tensor-parallel part's shape, or (a flat range of it) one dimension."""
    full_shape = tuple(full_shape)
    if where.index is None:
        dim, segments, part = None, None, full_shape
    else:
        dim = len(where.index) - 1
        segments = segments_of(where.index[dim], full_shape[dim])
        part = full_shape[:dim] + (sum(n for _, _, n in segments),) + full_shape[dim + 1:]
    lo, hi = where.flat if where.flat is not None else (0, prod(part))
    if tensor.numel() != hi - lo:
        raise ValueError(f"a piece of {hi - lo} elements of a {full_shape} tensor has {tensor.numel()}")
    if where.flat is None and tuple(tensor.shape) == part and tensor.numel() > 0:
        # the whole part: one box, the tensor itself, in whatever memory layout it has
        # (channels-last, a transposed view), so a load fills the tensor, never a copy
        return _place((0,) * len(part), part, tensor, dim, segments)
    flat = tensor.view(-1)  # a flat range is of a row-major tensor (ZeRO's pieces): never a copy
    out, start = [], 0
    for offsets, sizes in flat_boxes(part, lo, hi):
        n = prod(sizes)
        view = flat[start:start + n].view(sizes)
        start += n
        out += _place(offsets, sizes, view, dim, segments)
    return out


def _place(offsets, sizes, view, dim, segments) -> list[Box]:
    """A box of the tensor-parallel part in the full tensor's coordinates: along `dim`, cut
    where the rank's segments end and moved to where they sit."""
    if dim is None:
        return [Box(tuple(offsets), tuple(sizes), view)]
    out = []
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    for local, full, n in segments:
        x, y = max(lo, local), min(hi, local + n)
        if x < y:
            o = list(offsets)
            o[dim] = full + (x - local)
            s = list(sizes)
            s[dim] = y - x
            out.append(Box(tuple(o), tuple(s), view.narrow(dim, x - lo, y - x)))
    return out
