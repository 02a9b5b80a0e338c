"""Every collective goes through here, so that the bytes each rank moves are counted per
mesh axis. The count is what this rank sends under the bandwidth-optimal algorithms the
papers' formulas assume: a ring all-reduce of B bytes over n ranks sends 2(n-1)/n·B, an
all-gather or reduce-scatter of B bytes in all sends (n-1)/n·B, a point-to-point send B.

Reductions made only to report numbers (the logged loss) are counted under "metrics", apart
from the model's own traffic, so that per-axis figures match the formulas exactly."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from meshtrain.mesh import Mesh

METRICS = "metrics"


class _Done:
    """The handle of a collective over a group of one: nothing to wait for."""

    def wait(self):
        return True


class Comm:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._sent = defaultdict(float)

    def _count(self, key: str, nbytes: float) -> None:
        self._sent[key] += nbytes

    def totals(self) -> dict[str, float]:
        """Bytes sent so far, by axis (a copy: subtract two of them for a step's traffic)."""
        return dict(self._sent)

    def all_reduce(self, tensor: torch.Tensor, axis: str, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   purpose: str | None = None):
        """Sum (or `op`) `tensor` in place over the ranks of `axis`."""
        n = self.mesh.size(axis)
        if n == 1:
            return _Done() if async_op else None
        self._count(purpose or axis, 2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        work = dist.all_reduce(tensor, op=op, group=self.mesh.group(axis), async_op=async_op)
        return work if async_op else None

    def all_gather_object(self, obj) -> list:
        """Gather a small picklable object from every rank of the whole mesh (reporting only)."""
        if self.mesh.world_size == 1:
            return [obj]
        out = [None] * self.mesh.world_size
        dist.all_gather_object(out, obj)
        return out
