"""Every collective and point-to-point transfer goes through here, so that the bytes each
rank sends are counted per mesh axis. The count is what this rank sends under the
bandwidth-optimal algorithms the papers' formulas assume, for B bytes and n ranks:

    all-reduce of B bytes (ring: reduce-scatter, then all-gather)   2(n-1)/n · B
    all-gather into B bytes in all (each rank holds B/n)              (n-1)/n · B
    reduce-scatter of B bytes in all (each rank keeps B/n)            (n-1)/n · B
    broadcast of B bytes (pipelined ring; spread evenly over ranks)   (n-1)/n · B
    all-to-all of B bytes (each rank keeps 1/n of its own)           (n-1)/n · B
    send of B bytes                                                   B  (receiving: 0)

Reductions made only to report numbers or to check (the logged loss, the gradient norm,
fingerprints) are counted under "metrics", apart from the model's own traffic, so that
per-axis figures match the formulas exactly. On an axis of size 1 a collective is a no-op
and counts nothing.

The formulas are functions (`all_reduce_bytes`, `all_gather_bytes`, in `meshtrain.ring`, which
needs no torch) so that a choice between strategies (`linear_sync_bytes`, the planner)
predicts exactly what is counted.

One such choice: making a linear layer's weight gradient whole over N data-parallel ranks.
∇W = δᵀ·x sums over rows (samples, or tokens), so instead of all-reducing ∇W [n_out × n_in]
each rank can all-gather every rank's inputs x and output-gradients δ and form ∇W itself;
the bias gradient is the column sum of δ and comes free. For B rows in the global batch:

    all-reduce   2(N-1)/N · (n_in + 1)·n_out    elements of the gradient (the +1: the bias)
    all-gather    (N-1)/N · B·(n_in + n_out)    elements of the activations

Counted as each rank's own data (n_in·n_out against b·(n_in + n_out) for b = B/N rows per
rank), the all-gather wins when b < n/2 for a square layer; counted as sent bytes, as here,
it wins when B < 2·(n_in + 1)·n_out/(n_in + n_out) — B < n + 1 for a square layer, i.e.
b < n/N: the same rule at N = 2, stricter beyond, because an all-reduce's bytes do not grow
with N while the gathered rows do. Micro-batches do not change either side: the all-reduce
runs once per step, and each micro-batch gathers only its own B/m rows."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshtrain.ring import all_gather_bytes, all_reduce_bytes

if TYPE_CHECKING:  # for annotations only: the mesh makes its Comm (`Mesh.comm`), so a runtime import would be a cycle
    from meshtrain.mesh import Mesh

METRICS = "metrics"
# torch 2.13 renamed the tensor forms of all-gather and reduce-scatter; 2.11 has only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """The handle of a collective over a group of one: nothing to wait for."""

    def wait(self):
        return True


class Comm:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._sent = defaultdict(float)  # (axis or purpose, collective) -> bytes

    def _count(self, key: str, kind: str, nbytes: float) -> None:
        self._sent[key, kind] += nbytes

    def totals(self) -> dict[str, float]:
        """Bytes sent so far, by axis (a copy: subtract two of them for a step's traffic)."""
        out = defaultdict(float)
        for (key, _), nbytes in self._sent.items():
            out[key] += nbytes
        return dict(out)

    def detailed_totals(self) -> dict[tuple[str, str], float]:
        """Bytes sent so far, by (axis, collective)."""
        return dict(self._sent)

    @torch.compiler.disable  # collectives run eagerly: a compiled block breaks its graph here
    def _run(self, axis: str, kind: str, purpose: str | None, nbytes: float, async_op: bool, call,
             channel: str | None = None):
        """Count, then issue `call(group)` (the axis's group, or its `channel`); a group of
        one does nothing."""
        if self.mesh.size(axis) == 1:
            return _Done() if async_op else None
        self._count(purpose or axis, kind, nbytes)
        work = call(self.mesh.group(axis, channel))
        return work if async_op else None

    def all_reduce(self, tensor: torch.Tensor, axis: str, *, op=dist.ReduceOp.SUM, async_op: bool = False,
                   purpose: str | None = None):
        """Sum (or `op`) `tensor` in place over the ranks of `axis`."""
        return self._run(axis, "all_reduce", purpose, all_reduce_bytes(_nbytes(tensor), self.mesh.size(axis)), async_op,
                         lambda g: dist.all_reduce(tensor, op=op, group=g, async_op=async_op))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, axis: str, *, async_op: bool = False,
                   purpose: str | None = None):
        """`output` (n × the shard's size, along dim 0) receives every rank's `shard` in rank order."""
        n = self.mesh.size(axis)
        if n == 1:
            output.copy_(shard)
        return self._run(axis, "all_gather", purpose, all_gather_bytes(_nbytes(output), n), async_op,
                         lambda g: _all_gather_tensor(output, shard, group=g, async_op=async_op))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, axis: str, *, op=dist.ReduceOp.SUM,
                       async_op: bool = False, purpose: str | None = None, channel: str | None = None):
        """`output` receives this rank's 1/n of `tensor` (dim 0) summed over the ranks of `axis`
        (on the axis's `channel`, if named: `Mesh.open_channel`)."""
        n = self.mesh.size(axis)
        if n == 1:
            output.copy_(tensor)
        return self._run(axis, "reduce_scatter", purpose, all_gather_bytes(_nbytes(tensor), n), async_op,
                         lambda g: _reduce_scatter_tensor(output, tensor, op=op, group=g, async_op=async_op), channel)

    def all_to_all(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """Split `x` along dim 0 into n equal parts, send part j to the rank at coordinate j
        of `axis`; returns what every rank sent this one, in coordinate order (dim 0)."""
        x = x.contiguous()
        n = self.mesh.size(axis)
        if n == 1:
            return x
        out = torch.empty_like(x)
        self._run(axis, "all_to_all", None, all_gather_bytes(_nbytes(x), n), False,
                  lambda g: dist.all_to_all_single(out, x, group=g))
        return out

    def all_to_all_v(self, x: torch.Tensor, axis: str, send: list[int], receive: list[int], *,
                     async_op: bool = False):
        """Send `x`'s first `send[0]` rows to the rank at coordinate 0 of `axis`, the next
        `send[1]` to coordinate 1, and so on; returns the `receive[j]` rows each rank j sent
        this one, in coordinate order (with `async_op`, (that tensor, the work to wait for
        before reading it)). Counted: the bytes that leave this rank (its own rows stay)."""
        n = self.mesh.size(axis)
        if n == 1:
            return (x, _Done()) if async_op else x
        x = x.contiguous()
        row = x.element_size() * _row_elements(x)
        out = x.new_empty((sum(receive), *x.shape[1:]))
        sent = (sum(send) - send[self.mesh.coord(axis)]) * row
        work = self._run(axis, "all_to_all", None, sent, async_op,
                         lambda g: dist.all_to_all_single(out, x, receive, send, group=g, async_op=async_op))
        return (out, work) if async_op else out

    def gather_along(self, x: torch.Tensor, axis: str, dim: int, *, purpose: str | None = None) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in coordinate order (a new tensor)."""
        chunk = x.movedim(dim, 0).contiguous()
        full = chunk.new_empty((chunk.shape[0] * self.mesh.size(axis), *chunk.shape[1:]))
        self.all_gather(full, chunk, axis, purpose=purpose)
        del chunk  # a copy when dim > 0: gone before the result's, so at most two full tensors are held
        return full.movedim(0, dim).contiguous()

    def reduce_scatter_along(self, x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        """The sum of `x` over the ranks of `axis`, of which this rank keeps its chunk along `dim`."""
        full = x.movedim(dim, 0).contiguous()
        chunk = full.new_empty((full.shape[0] // self.mesh.size(axis), *full.shape[1:]))
        self.reduce_scatter(chunk, full, axis)
        return chunk.movedim(0, dim).contiguous()

    def broadcast(self, tensor: torch.Tensor, axis: str, *, src_coord: int = 0, async_op: bool = False,
                  purpose: str | None = None):
        """Every rank of `axis` receives the tensor of the rank at coordinate `src_coord`."""
        return self._run(axis, "broadcast", purpose, all_gather_bytes(_nbytes(tensor), self.mesh.size(axis)), async_op,
                         lambda g: dist.broadcast(tensor, group=g, async_op=async_op,
                                                  src=self.mesh.rank_at(axis, src_coord)))

    @torch.compiler.disable
    def exchange(self, ops: list[tuple[bool, torch.Tensor, int, int]], axis: str, *, purpose: str | None = None,
                 wrap: bool = False):
        """One group of point-to-point transfers with neighbours along `axis`, issued together
        through `batch_isend_irecv` (on NCCL one grouped call on the axis's communicator: the
        transfers progress as a whole); returns their handles. `ops`: (is a send, tensor,
        offset of the peer along the axis, tag — which NCCL ignores); `wrap`: the axis is a ring."""
        group, p2p = self.mesh.group(axis), []
        for is_send, tensor, offset, tag in ops:
            if is_send:
                tensor = tensor.contiguous()
                self._count(purpose or axis, "send", _nbytes(tensor))
            p2p.append(dist.P2POp(dist.isend if is_send else dist.irecv, tensor, self._peer(axis, offset, wrap), group,
                                  tag))
        return dist.batch_isend_irecv(p2p) if p2p else []

    def prepare_p2p(self, axis: str) -> None:
        """Collective over `axis`: NCCL makes a group's communicator at its first call, and a
        batched point-to-point call that comes first must involve every rank of the group;
        one tiny all-reduce makes it now (not counted: it moves no model data)."""
        if self.mesh.size(axis) > 1:
            dist.all_reduce(torch.zeros(1, device=self.mesh.device), group=self.mesh.group(axis))

    def _peer(self, axis: str, offset: int, wrap: bool = False) -> int:
        peer = self.mesh.neighbour(axis, offset, wrap=wrap)
        if peer is None:
            raise ValueError(f"rank {self.mesh.rank} has no neighbour {offset:+d} along {axis}")
        return peer

    def barrier(self, axis: str | None = None) -> None:
        """Wait for every rank of the whole mesh, or of `axis` (timing only: moves nothing)."""
        if (self.mesh.world_size if axis is None else self.mesh.size(axis)) > 1:
            dist.barrier(group=None if axis is None else self.mesh.group(axis))

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank of the whole mesh (a one-element all-reduce,
        counted under metrics)."""
        return self.any_ranks([flag])[0]

    def any_ranks(self, flags: list[bool]) -> list[bool]:
        """Whether each of `flags` is true on any rank of the whole mesh (one all-reduce of a
        number each, counted under metrics): a verdict whose size does not grow with the world."""
        return [v > 0 for v in self._max_over_ranks([1.0 if f else 0.0 for f in flags], torch.float32)]

    def largest(self, values: list[int]) -> list[int]:
        """Each of `values`' largest over every rank of the whole mesh (one all-reduce of an
        integer each, counted under metrics)."""
        return [int(v) for v in self._max_over_ranks(values, torch.int64)]

    def _max_over_ranks(self, values: list, dtype: torch.dtype) -> list:
        if self.mesh.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=dtype, device=self.mesh.device)
        self._count(METRICS, "all_reduce", all_reduce_bytes(_nbytes(t), self.mesh.world_size))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_gather_object(self, obj, axis: str | None = None) -> list:
        """A picklable object from every rank of the whole mesh, or of `axis` (reporting and
        reading state only: not counted)."""
        n = self.mesh.world_size if axis is None else self.mesh.size(axis)
        if n == 1:
            return [obj]
        out = [None] * n
        dist.all_gather_object(out, obj, group=None if axis is None else self.mesh.group(axis))
        return out

    def gather_object(self, obj) -> list | None:
        """Every rank's picklable `obj` on rank 0, in rank order; None on the other ranks (what
        only rank 0 writes: what they receive does not grow with the world; `gather_to_rank_0`).
        Not counted."""
        if self.mesh.world_size == 1:
            return [obj]
        return gather_to_rank_0(obj, None, self.mesh.device)

    def broadcast_object(self, obj):
        """Rank 0's picklable `obj` on every rank (the others' `obj` is ignored). Not counted."""
        if self.mesh.world_size == 1:
            return obj
        return broadcast_from_rank_0(obj, None, self.mesh.device)


def gather_to_rank_0(obj, group, device: torch.device) -> list | None:
    """Collective over `group`, which holds every rank (None: the default group): each rank's
    picklable `obj` on rank 0, in rank order; None elsewhere. The pickles are padded to the
    largest (pickle ignores what follows), whose size one all-reduce finds: a rank other than
    0 receives that one number. torch's `gather_object` all-gathers every rank's size instead,
    8 bytes a rank to every rank. `device`: where the group's backend moves tensors."""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    mine = torch.zeros(int(size.item()), dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    root = dist.get_rank() == 0
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))] if root else None
    dist.gather(mine, out, dst=0, group=group)
    return [pickle.loads(t.cpu().numpy().tobytes()) for t in out] if root else None


def broadcast_from_rank_0(obj, group, device: torch.device):
    """Collective over `group`, which holds every rank (None: the default group): rank 0's
    picklable `obj` on every rank (its size, then its bytes)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group, device=device)
    return box[0]


def _row_elements(t: torch.Tensor) -> int:
    """Elements per row (dim 0) of `t`, read from its shape (it may have no rows)."""
    n = 1
    for size in t.shape[1:]:
        n *= size
    return n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


LINEAR_SYNCS = ("allreduce", "allgather")


def linear_sync_bytes(n_in: int, n_out: int, bias: bool, rows: int, n: int, *, grad_size: int = 4,
                      activation_size: int = 4) -> dict[str, float]:
    """Bytes each of `n` data-parallel ranks sends per step to make one linear layer's weight
    (and bias) gradient whole, for `rows` rows in the global batch: {"allreduce": …,
    "allgather": …}. Gradients are `grad_size` bytes an element, activations
    `activation_size` (they differ under bf16 with --grad-dtype fp32)."""
    return {"allreduce": all_reduce_bytes((n_in + bias) * n_out * grad_size, n),
            "allgather": all_gather_bytes(rows * (n_in + n_out) * activation_size, n)}


def linear_sync_crossover(n_in: int, n_out: int, bias: bool = True) -> float:
    """The global batch below which all-gathering a layer's rows sends fewer bytes than
    all-reducing its gradient (equal element sizes): 2·(n_in + 1)·n_out/(n_in + n_out)."""
    return 2 * (n_in + bias) * n_out / (n_in + n_out)


def cheaper_linear_sync(n_in: int, n_out: int, bias: bool, rows: int, n: int, **sizes) -> str:
    """The rule `--dp-linear-sync auto` applies per layer: all-gather exactly when it sends
    fewer bytes (a tie all-reduces: the simpler path, and no extra compute)."""
    sent = linear_sync_bytes(n_in, n_out, bias, rows, n, **sizes)
    return "allgather" if sent["allgather"] < sent["allreduce"] else "allreduce"
