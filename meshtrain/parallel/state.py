"""The state of a parallelized model by parameter name, at full shape: what verify, the
checkpoint and the text sample read, whatever the layout. Names are those of the full
model under every strategy, so two layouts' states match key by key.

A parameter a strategy splits carries its shard spec (`set_shard`: the mesh axis and the
dimension it is split along, in equal contiguous chunks in coordinate order — or, for a
fused layer, each of its `sections` along that dimension split so, the rank's chunks
concatenated); everything else is whole on every rank. Gathering a full tensor is a
collective over that axis."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.lowbit import held_bytes, is_low_bit, readable_state
from meshtrain.optim import SHARDED_OVER, local_tensor, zero_
from meshtrain.parallel.precision import grad_holder, grad_of, master_bytes, master_of

SHARD = "meshtrain_shard"
PIECE_BYTES = 1 << 20  # the most of a chunk `gather_full` moves at once when it cannot land in place


def set_shard(p: nn.Parameter, axis: str, dim: int, sections: tuple[int, ...] | None = None) -> None:
    """Mark `p` as this rank's chunk of the full tensor along `dim`, split over `axis` (each
    of the full tensor's `sections` along `dim` split alike, when given)."""
    setattr(p, SHARD, (axis, dim) if sections is None else (axis, dim, tuple(sections)))
    setattr(p, SHARDED_OVER, (axis,))


def shard_positions(spec: tuple, n_local: int, coord: int, size: int) -> slice | list[int]:
    """The positions along the split dimension that the rank at `coord` holds (its piece is
    `n_local` long): one slice, or for a fused spec the positions of its chunk of each section."""
    if len(spec) < 3:
        return slice(coord * n_local, (coord + 1) * n_local)
    positions, start = [], 0
    for width in spec[2]:
        k = width // size
        positions += range(start + coord * k, start + (coord + 1) * k)
        start += width
    return positions


def shard_index(p: torch.Tensor, comm: Comm, shape: torch.Size | None = None) -> tuple | None:
    """Where `p`'s piece (of `shape`, by default its own) sits in the full tensor, as an
    index of it (None: it is the whole tensor)."""
    spec = getattr(p, SHARD, None)
    if spec is None:
        return None
    axis, dim = spec[0], spec[1]
    n = (shape or p.shape)[dim]
    return (slice(None),) * dim + (shard_positions(spec, n, comm.mesh.coord(axis), comm.mesh.size(axis)),)


def gather_full(local: torch.Tensor, spec: tuple | None, comm: Comm, *, keep: bool = True) -> torch.Tensor | None:
    """Collective over the spec's axis: the full tensor (a CPU copy) from every rank's chunk
    (`keep=False`: this rank only passes its chunk on, and gets None). Split along the first
    dimension, the chunks lie end to end and one all-gather fills the tensor; otherwise they
    come one rank at a time, in blocks of at most `PIECE_BYTES` (a broadcast each), straight
    into their places, so a rank holds the full tensor and one block at most — an all-gather
    would hold the gathered chunks and the tensor laid out from them, twice the tensor."""
    if spec is None or comm.mesh.size(spec[0]) == 1:
        return cpu_copy(local) if keep else None
    axis, dim = spec[0], spec[1]
    size, me, n = comm.mesh.size(axis), comm.mesh.coord(axis), local.shape[dim]
    shape = local.shape[:dim] + (n * size,) + local.shape[dim + 1:]
    if dim == 0 and len(spec) < 3:  # the chunks lie end to end: one all-gather straight into the tensor
        full = local.new_empty(shape)
        comm.all_gather(full, local.detach().contiguous(), axis, purpose=METRICS)  # reading state: not the model's
        return full.to("cpu") if keep else None
    full = torch.empty(shape, dtype=local.dtype) if keep else None
    rows = local.shape[0]  # split along another dimension: a chunk goes in blocks of its first one's rows
    block = rows if dim == 0 else max(1, PIECE_BYTES // max(1, local[0].numel() * local.element_size()))
    for r in range(size):
        at = shard_positions(spec, n, r, size)
        for a in range(0, rows, block):
            b = min(rows, a + block)
            piece = local.detach()[a:b].contiguous() if r == me else torch.empty(
                (b - a, *local.shape[1:]), dtype=local.dtype, device=local.device)
            comm.broadcast(piece, axis, src_coord=r, purpose=METRICS)  # reading state is not the model's traffic
            if full is not None:
                into = full if dim == 0 else full[a:b]  # the block's rows of the tensor
                if isinstance(at, slice):
                    into.narrow(dim, at.start, n).copy_(piece)
                else:
                    into.index_copy_(dim, torch.tensor(at), piece.to("cpu"))
            del piece
    return full


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class Entry:
    """One tensor of the full state, as every rank of a stage agrees on it: the parameter's
    (or buffer's) name, `key` (None: the value, or the gradient; else the optimizer state's
    key), and the full tensor's shape and dtype."""
    name: str
    key: str | None
    shape: tuple[int, ...]
    dtype: torch.dtype


def full_shape(p: torch.Tensor, comm: Comm, shape: torch.Size | None = None) -> tuple[int, ...]:
    """The full tensor's shape of `p` (its piece's `shape`, by default its own)."""
    shape = list(shape or p.shape)
    spec = getattr(p, SHARD, None)
    if spec is not None:
        shape[spec[1]] *= comm.mesh.size(spec[0])
    return tuple(shape)


def is_collector(comm: Comm) -> bool:
    """The rank of its pipeline stage that assembles the stage's full tensors (dp and tp
    coordinates 0): it alone keeps them, one at a time."""
    return comm.mesh.coord("dp") == 0 and comm.mesh.coord("tp") == 0


def _gathered_over(spec: tuple | None, comm: Comm) -> str | None:
    """The axis a tensor's assembly gathers over (None: it is whole here, no collective)."""
    return spec[0] if spec is not None and comm.mesh.size(spec[0]) > 1 else None


def _assembles(axis: str | None, comm: Comm) -> bool:
    """Whether this rank takes part in assembling a tensor gathered over `axis` (None: a
    replica): coordinate 0 on the other axes that hold replicas of it."""
    others = ("edp",) if axis == "ep" else ("dp", "tp")  # an expert chunk's replicas lie along edp
    return all(comm.mesh.coord(a) == 0 for a in others if a != axis)


def assemble_split(local: torch.Tensor, spec: tuple[str, int] | None, comm: Comm, *,
                   fresh: bool = False) -> torch.Tensor | None:
    """Collective among the ranks that assemble (coordinate 0 on the axes other than pp and
    the spec's): the full tensor, a CPU copy on the collector, None elsewhere. A replica is
    copied by the collector alone (`fresh`: `local` is the caller's own, not a parameter,
    and is not copied again where it is on the CPU already); a split tensor is gathered
    over its axis."""
    axis = _gathered_over(spec, comm)
    if not _assembles(axis, comm):
        return None
    if axis is None:
        return (local.to("cpu") if fresh else cpu_copy(local)) if is_collector(comm) else None
    return gather_full(local, spec, comm, keep=is_collector(comm))  # a new tensor



def assemble_batched(items: list[tuple[torch.Tensor, tuple | None]], comm: Comm, batch_bytes: int, *,
                     fresh: bool = False) -> Iterator[torch.Tensor | None]:
    """Collective: `assemble_split` of each (local, spec) of `items` in turn, but the
    consecutive tensors split over one axis (those whole here between them passed by) are
    gathered together, one all-gather for as many as fit in `batch_bytes` gathered — a
    model's many small tensors each cost a collective otherwise. A consumer that keeps what
    it reads (verify's full state) holds one batch more; `batch_bytes` 0 gathers one at a time.
    `fresh`: as `assemble_split`'s."""
    i = 0
    while i < len(items):
        axis = _gathered_over(items[i][1], comm)
        batch, total, j = [], 0, i
        while axis is not None and j < len(items):
            local, spec = items[j]
            there = _gathered_over(spec, comm)
            if there is None:
                j += 1
                continue
            nbytes = local.numel() * local.element_size() * comm.mesh.size(there)
            if there != axis or local.dtype != items[i][0].dtype or total + nbytes > batch_bytes:
                break
            batch.append(j)
            total += nbytes
            j += 1
        if len(batch) < 2:
            yield assemble_split(*items[i], comm, fresh=fresh)
            i += 1
            continue
        gathered = _gather_batch([items[k] for k in batch], axis, comm)
        for k in range(i, j):
            yield next(gathered) if k in batch else assemble_split(*items[k], comm, fresh=fresh)
        i = j


def _gather_batch(items: list[tuple[torch.Tensor, tuple]], axis: str, comm: Comm) -> Iterator[torch.Tensor | None]:
    """Collective over `axis`: the full tensors of `items` (all split over it, one dtype)
    from one all-gather of every rank's chunks laid end to end; CPU copies on the collector,
    None elsewhere (and None on the ranks that take no part: `assemble_split`'s)."""
    mesh = comm.mesh
    if not _assembles(axis, comm):
        yield from (None for _ in items)
        return
    flat = torch.cat([local.detach().reshape(-1) for local, _ in items])
    size = mesh.size(axis)
    out = flat.new_empty(size * flat.numel())
    comm.all_gather(out, flat, axis, purpose=METRICS)  # reading state: not the model's traffic
    del flat
    if not is_collector(comm):
        yield from (None for _ in items)
        return
    chunks, start = out.to("cpu").view(size, -1), 0
    for local, spec in items:
        dim = spec[1]
        n = local.shape[dim]
        full = torch.empty(local.shape[:dim] + (n * size,) + local.shape[dim + 1:], dtype=local.dtype)
        for r in range(size):
            chunk = chunks[r, start:start + local.numel()].view(local.shape)
            at = shard_positions(spec, n, r, size)
            if isinstance(at, slice):
                full.narrow(dim, at.start, n).copy_(chunk)
            else:
                full.index_copy_(dim, torch.tensor(at), chunk)
        start += local.numel()
        yield full


def batches_of(entries: list[Entry], batch_bytes: int) -> list[list[int]]:
    """`entries` cut into runs of consecutive ones of one dtype, at most `batch_bytes` each
    (one alone where it is larger): what one message carries (`batch_bytes` 0: one each)."""
    return runs_of([(e.dtype, math.prod(e.shape) * e.dtype.itemsize) for e in entries], batch_bytes)


def runs_of(items: list[tuple[object, int]], limit: int) -> list[list[int]]:
    """The indices of `items` ((kind, bytes) pairs) cut into runs of consecutive ones of one
    kind, at most `limit` bytes each (one alone where it is larger)."""
    runs: list[list[int]] = []
    total = 0
    for i, (kind, nbytes) in enumerate(items):
        if runs and items[runs[-1][0]][0] == kind and total + nbytes <= limit:
            runs[-1].append(i)
            total += nbytes
        else:
            runs.append([i])
            total = nbytes
    return runs


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (not those a module marks non-persistent, such as a
    cache it recomputes or a count it restarts each step)."""
    kept = set(module.state_dict(keep_vars=True))
    return [(n, b) for n, b in module.named_buffers() if n in kept]


def buffer_entries(module: nn.Module) -> list[tuple[Entry, torch.Tensor]]:
    """The module's persistent buffers (whole on every rank) as entries of the model's state."""
    return [(Entry(n, None, tuple(b.shape), b.dtype), b) for n, b in persistent_buffers(module)]


def digest(t: torch.Tensor) -> bytes:
    """A fingerprint of a tensor's exact bytes (bit-identical tensors, equal digests)."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()


def _is_per_element(v, p: nn.Parameter) -> bool:
    return torch.is_tensor(v) and v.shape == p.shape


def load_optimizer_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                         state: dict[str, dict], comm: Comm) -> None:
    """Replace the optimizer state of the named parameters by this rank's part of the full
    `state` (copies on each parameter's device; Adam's step counter stays where Adam keeps
    it). A parameter absent from `state` starts with none, as before its first step; the
    entries of parameters this rank does not hold (another pipeline stage's) are passed by."""
    for p in params.values():
        optimizer.state.pop(p, None)
    for name, entry in state.items():
        if name not in params:
            continue
        p = params[name]
        index = shard_index(p, comm)
        loaded = {}
        for k, v in entry.items():
            if torch.is_tensor(v) and k != "step":
                loaded[k] = (v[index] if index is not None and v.dim() == p.dim() else v).to(p.device, copy=True)
            else:
                loaded[k] = v.clone() if torch.is_tensor(v) else v
        optimizer.state[p] = loaded


@dataclass(frozen=True)
class Where:
    """Where a rank's piece sits in the full tensor: `index` selects the part a strategy
    splits along dims (tensor parallelism; None: all of it), `flat` a range of that part's
    elements in row-major order (ZeRO's flat shards; None: all of them)."""
    index: tuple | None = None
    flat: tuple[int, int] | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        part = full if self.index is None else full[self.index]
        return part if self.flat is None else part.reshape(-1)[self.flat[0]:self.flat[1]]


@dataclass
class Piece:
    """What one rank holds of one named tensor: its values, its synchronised gradient (None:
    this copy's gradient is not the synchronised one) and where it sits in the full tensor."""
    name: str
    value: torch.Tensor
    grad: torch.Tensor | None
    where: Where


@dataclass(frozen=True)
class Held:
    """A tensor of this rank that holds the part `where` of the full tensor `name` (of `shape`)."""
    name: str
    where: Where
    shape: tuple[int, ...]
    tensor: torch.Tensor


def params_held(module: nn.Module, comm: Comm, named: list[tuple[str, nn.Parameter]] | None = None) -> list[Held]:
    """The module's parameters (or the `named` ones) as this rank holds them (whole, or its
    tensor- or expert-parallel part)."""
    named = module.named_parameters() if named is None else named
    return [Held(n, Where(shard_index(p, comm)), full_shape(p, comm), p) for n, p in named]


def masters_of(held: list[Held], optimizer) -> list[Held]:
    """The fp32 masters the optimizer steps of the `held` tensors that have one (mixed
    precision), placed alike."""
    return [Held(h.name, h.where, h.shape, master_of(optimizer, h.tensor)) for h in held
            if master_of(optimizer, h.tensor) is not h.tensor]


class ParamHoldings:
    """Each rank holds its model's parameters, whole or split along one dim (`set_shard`), and
    the optimizer steps them: plain and data parallelism, tensor parallelism, pipeline stages."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm):
        self.module, self.optimizer, self.comm = module, optimizer, comm

    def trained(self) -> list[torch.Tensor]:
        """The tensors whose `.grad` are the gradients the optimizer uses (what clipping
        scales): the parameters, or their masters when fp32 gradients live apart."""
        return [grad_holder(self.optimizer, p) for p in self.module.parameters()]

    def pieces(self) -> list[Piece]:
        return [Piece(n, p, grad_of(self.optimizer, p), Where(shard_index(p, self.comm)))
                for n, p in self.module.named_parameters()]

    def _locals(self, kind: str) -> list[tuple[Entry, torch.Tensor, tuple | None]]:
        """This rank's tensor of each entry of `kind`, and its shard spec."""
        out = []
        for n, p in self.module.named_parameters():
            spec = getattr(p, SHARD, None)
            if kind == "model":
                t = master_of(self.optimizer, p)
                out.append((Entry(n, None, full_shape(p, self.comm), t.dtype), t, spec))
            elif kind == "grads":
                t = grad_of(self.optimizer, p)
                if t is not None:
                    out.append((Entry(n, None, full_shape(p, self.comm), t.dtype), t, spec))
            else:
                for key, v in readable_state(self.optimizer, master_of(self.optimizer, p)).items():
                    if torch.is_tensor(v):
                        whole = _is_per_element(v, p)
                        out.append((Entry(n, key, full_shape(p, self.comm) if whole else tuple(v.shape), v.dtype), v,
                                    spec if whole else None))
        if kind == "model":
            out += [(entry, b, None) for entry, b in buffer_entries(self.module)]
        return out

    def entries(self, kind: str) -> list[Entry]:
        return [entry for entry, _, _ in self._locals(kind)]

    def stream(self, kind: str, batch_bytes: int = 0):
        """Collective within the stage: each entry's full tensor in turn (`entries` order), a
        CPU copy on the collector, None elsewhere; only one is ever assembled at a time, or
        with `batch_bytes` the small ones a batch at a time (`assemble_batched`)."""
        found = self._locals(kind)
        fulls = assemble_batched([(local, spec) for _, local, spec in found], self.comm, batch_bytes)
        for (entry, _, _), full in zip(found, fulls):
            yield entry, full

    def checkpointed(self) -> list[Held]:
        """What a checkpoint records of this rank: the tensors the optimizer steps (fp32
        masters under mixed precision), which its state is keyed by."""
        return [Held(h.name, h.where, h.shape, master_of(self.optimizer, h.tensor)) for h in self._params()]

    def restored(self) -> list[Held]:
        """Every tensor of this rank that holds the checkpointed values: what loading fills
        (the parameter, and its master under mixed precision)."""
        params = self._params()
        return params + masters_of(params, self.optimizer)

    def _params(self) -> list[Held]:
        return params_held(self.module, self.comm)

    def read_on_load(self) -> list[Held]:
        """What a checkpoint load reads on this rank: everything it restores."""
        return self.restored()

    def finish_load(self) -> None:
        """Nothing to rebuild after a load: each rank read all it holds."""

    def load(self, model: dict[str, torch.Tensor], optim: dict[str, dict]) -> None:
        params = dict(self.module.named_parameters())  # this stage's (the state holds every stage's)
        with torch.no_grad():
            for name, p in params.items():
                part = Where(shard_index(p, self.comm)).take(model[name])
                p.copy_(part)
                if master_of(self.optimizer, p) is not p:  # mixed precision: the fp32 master too
                    master_of(self.optimizer, p).copy_(part)
        load_optimizer_state(self.optimizer, {n: master_of(self.optimizer, p) for n, p in params.items()}, optim,
                             self.comm)

    def zero_grad(self) -> None:
        # in place: the gradients are views of the data-parallel buckets
        zero_([p.grad for p in self.module.parameters() if p.grad is not None])
        if getattr(self.optimizer, "persistent_grads", False):
            self.optimizer.zero_grad()  # the fp32 buffers the masters hold

    def state_bytes(self) -> dict:
        params = list(self.module.parameters())
        return model_state_bytes(params, self.optimizer, grads=[grad_of(self.optimizer, p) for p in params],
                                 master=master_bytes(self.optimizer))


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors in `tensors` on this rank: a tensor listed twice counts
    once, views into one buffer (gradient buckets) count their own extent, a DTensor its
    local shard (whatever larger storage that shard may be a view of)."""
    seen = {}
    for t in tensors:
        if t is not None:
            t = local_tensor(t)
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def model_state_bytes(params, optimizer: torch.optim.Optimizer, *, grads=None, master: int = 0,
                      gathered: int = 0) -> dict:
    """Parameters, gradients (by default the parameters' `.grad`), fp32 master weights and
    optimizer states this rank holds, in bytes (and, under ZeRO-3, the peak of full
    parameters gathered for compute)."""
    states = [v for st in optimizer.state.values() for v in st.values()
              if torch.is_tensor(v) and v.dim() > 0]  # skip Adam's scalar step counters
    grads = [p.grad for p in params] if grads is None else grads
    low_bit = sum(held_bytes(v) for v in states if is_low_bit(v))  # codes, scales and code map
    parts = {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "master": master,
             "optimizer": tensor_bytes(v for v in states if not is_low_bit(v)) + low_bit, "gathered": gathered}
    return {"total": sum(parts.values()), **parts}
