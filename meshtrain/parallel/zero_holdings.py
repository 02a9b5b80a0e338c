"""What a rank holds under ZeRO (`zero.py`), read and written by parameter name at full
shape: the pieces of its shards (values, gradients, optimizer states), the full state
streamed one parameter at a time, and loading a full state back into the shards."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.lowbit import readable_state
from meshtrain.parallel.precision import grad_holder, grad_of, master_bytes, master_of
from meshtrain.optim import full_shape as optimizer_full_shape
from meshtrain.parallel.state import (SHARD, Entry, Held, Piece, Where, assemble_batched, batches_of, buffer_entries,
                                      cpu_copy, full_shape, is_collector, masters_of, model_state_bytes, params_held,
                                      shard_index)
from meshtrain.parallel.zero import FlatGroup, Zero


class ZeroHoldings:
    """What a rank holds under ZeRO: the pieces of its shards (values, gradients, optimizer
    states) and, under stages 1 and 2, the full parameters as replicas."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm, zero: Zero, *,
                 params: list[tuple[str, nn.Parameter]] | None = None, buffers: bool = True):
        """`params`: the parameters `zero` shards (default: all the module's); `buffers`:
        whether the module's buffers are among what these holdings stream (one of several
        holdings of a module says so: `SplitHoldings`)."""
        self.module, self.optimizer, self.comm, self.zero = module, optimizer, comm, zero
        self.params = list(module.named_parameters()) if params is None else list(params)
        self.buffers = buffers

    def trained(self) -> list[torch.Tensor]:
        return [grad_holder(self.optimizer, value) for _, value, _, _ in self.zero.pieces]

    def pieces(self) -> list[Piece]:
        held = [Piece(name, value, grad_of(self.optimizer, value), where) for name, value, where, _ in self.zero.pieces]
        if self.zero.stage < 3:  # the full parameters: the same on every dp rank
            held += [Piece(n, p, None, Where(shard_index(p, self.comm))) for n, p in self.params]
        return held

    def _pieces_held(self) -> list[Held]:
        return [Held(name, where, tuple(optimizer_full_shape(value)), value) for name, value, where, _ in self.zero.pieces]

    def checkpointed(self) -> list[Held]:
        """What a checkpoint records of this rank: its pieces as the optimizer steps them
        (fp32 masters under mixed precision), which the optimizer's state is keyed by."""
        return [Held(h.name, h.where, h.shape, master_of(self.optimizer, h.tensor)) for h in self._pieces_held()]

    def restored(self) -> list[Held]:
        """Every tensor of this rank that holds checkpointed values: what loading fills. Under
        stages 1 and 2 the full parameters (the pieces are views of them), under stage 3 the
        pieces; and their fp32 masters under mixed precision."""
        pieces = self._pieces_held()
        held = params_held(self.module, self.comm, self.params) if self.zero.stage < 3 else pieces
        return held + masters_of(pieces, self.optimizer)

    def read_on_load(self) -> list[Held]:
        """What a checkpoint load reads on this rank: its pieces (and their masters) only —
        under stages 1 and 2 the full parameters are then all-gathered over dp
        (`finish_load`), so the dp ranks read the weights once between them, not each."""
        pieces = self._pieces_held()
        return pieces + masters_of(pieces, self.optimizer)

    def finish_load(self) -> None:
        """Collective over dp, after a load: stages 1 and 2 rebuild the full parameters from
        the pieces every rank read."""
        if self.zero.stage < 3:
            self.zero.gather_params()

    def _piece_tensor(self, value: torch.Tensor, kind: str, key: str | None) -> torch.Tensor | None:
        """What this rank holds of `kind` for one of its pieces (None: nothing yet)."""
        if kind == "model":
            return master_of(self.optimizer, value)
        if kind == "grads":
            return self.zero.piece_grads[value]
        return readable_state(self.optimizer, master_of(self.optimizer, value)).get(key)

    def _keys(self) -> list[tuple[str, tuple | None, torch.dtype]]:
        """The optimizer state's keys, alike on every rank (in the order of their names): each
        with None for a per-element state (the parameter's shape) or its own shape (Adam's
        step), and its dtype."""
        first = next(iter(self.optimizer.state), None)
        if first is None:  # before the first step, on every rank alike
            return []
        # sorted: a loaded entry keeps the checkpoint index's order of its keys, which differs
        # between tensors, and so between the ranks' first entries
        return sorted(((k, None if v.dim() > 0 else tuple(v.shape), v.dtype)
                       for k, v in readable_state(self.optimizer, first).items() if torch.is_tensor(v)),
                      key=lambda entry: str(entry[0]))

    def _plan(self, kind: str) -> list[tuple[Entry, FlatGroup, int, str | None]]:
        """Each entry of `kind`, with its group, its parameter's number and the state key."""
        masters = getattr(self.optimizer, "masters", None) is not None
        value_dtype = {"model": torch.float32 if masters else None, "grads": self.zero.grad_dtype}.get(kind)
        keys = self._keys() if kind == "optim" else []
        out = []
        for g in self.zero.groups:
            for i, (name, p, shape) in enumerate(zip(g.names, g.params, g.shapes)):
                full = full_shape(p, self.comm, shape)
                if kind == "optim":
                    out += [(Entry(name, key, full if own is None else own, dtype), g, i, key)
                            for key, own, dtype in keys]
                else:
                    out.append((Entry(name, None, full, value_dtype or g.shard.dtype), g, i, None))
        return out

    def entries(self, kind: str) -> list[Entry]:
        entries = [entry for entry, _, _, _ in self._plan(kind)]
        if kind == "model" and self.buffers:
            entries += [entry for entry, _ in buffer_entries(self.module)]
        return entries

    def stream(self, kind: str, batch_bytes: int = 0):
        """Collective within the stage: each entry's full tensor in turn (`entries` order), a
        CPU copy on the collector, None elsewhere. A parameter's flat pieces go from the dp
        ranks that hold them to dp coordinate 0, by point-to-point (counted under metrics),
        which assembles the tensor-parallel part and gathers it over tp if split: one
        parameter at a time, never a whole group — or, with `batch_bytes`, a run of
        consecutive small ones at a time (`batches_of`: one message from each dp rank, one
        gather over tp: `assemble_batched`)."""
        comm, z = self.comm, self.zero
        me = comm.mesh.coord(z.axis)
        # Where every dp rank's pieces sit in their parameters, as each says (small objects).
        claims: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        for r, pieces in enumerate(comm.all_gather_object([(g.index, i, where.flat) for g in z.groups
                                                          for i, where, _ in g.pieces], axis=z.axis)):
            for group, i, flat in pieces:
                claims.setdefault((group, i), {})[r] = flat
        plan = self._plan(kind)
        for run in batches_of([entry for entry, _, _, _ in plan], batch_bytes):
            yield from self._stream_run(kind, [plan[k] for k in run], claims, me, batch_bytes)
        if kind == "model" and self.buffers:
            for entry, b in buffer_entries(self.module):
                yield entry, cpu_copy(b) if is_collector(comm) else None

    def _stream_run(self, kind: str, run: list, claims: dict, me: int, batch_bytes: int):
        """One run of `stream`: every dp rank's pieces of it in one message to dp
        coordinate 0, which lays them into the parameters' flat tensors and assembles them."""
        comm, z = self.comm, self.zero
        held_of = [claims.get((g.index, i), {}) for _, g, i, _ in run]
        mine = []  # this rank's pieces, in the run's order
        for (entry, g, i, key), held in zip(run, held_of):
            if entry.shape != () and me in held:
                value = next(v for (j, _, _), v in zip(g.pieces, g.values) if j == i)
                a, b = held[me]
                piece = self._piece_tensor(value, kind, key)
                mine.append(torch.zeros(b - a, dtype=entry.dtype, device=g.shard.device) if piece is None else
                            piece.to(entry.dtype))
        if me != 0:
            if sum(piece.numel() for piece in mine):
                for work in comm.exchange([(True, torch.cat(mine) if len(mine) > 1 else mine[0], -me, 0)], z.axis,
                                          purpose=METRICS):
                    work.wait()
            for entry, _, _, _ in run:
                yield entry, None
            return
        device, dtype = run[0][1].shard.device, run[0][0].dtype
        own, flats, lands = iter(mine), [], {}  # lands: where each dp rank's message goes, in its order
        for (entry, g, i, _), held in zip(run, held_of):
            if entry.shape == ():  # Adam's step counter: the same everywhere
                continue
            local = torch.zeros(g.shapes[i].numel(), dtype=entry.dtype, device=device)
            for r, (a, b) in held.items():
                if r == 0:
                    local[a:b] = next(own)
                elif b > a:
                    lands.setdefault(r, []).append(local[a:b])
            flats.append((local.view(g.shapes[i]), getattr(g.params[i], SHARD, None)))
        # One parameter's pieces land straight in place; a run's come in one buffer per rank.
        received = {r: into[0] if len(into) == 1 else torch.empty(sum(t.numel() for t in into), dtype=dtype,
                                                                   device=device) for r, into in lands.items()}
        for work in comm.exchange([(False, buf, r, 0) for r, buf in received.items()], z.axis, purpose=METRICS):
            work.wait()
        for r, into in lands.items():
            if len(into) > 1:
                for t, part in zip(into, received[r].split([t.numel() for t in into])):
                    t.copy_(part)
        del received
        fulls = assemble_batched(flats, comm, batch_bytes, fresh=True)
        for entry, _, _, _ in run:
            if entry.shape == ():
                yield entry, cpu_copy(self._first_step()) if is_collector(comm) else None
            else:
                yield entry, next(fulls)

    def _first_step(self) -> torch.Tensor:
        return next(iter(self.optimizer.state.values()))["step"]

    def load(self, model: dict[str, torch.Tensor], optim: dict[str, dict]) -> None:
        with torch.no_grad():
            for g in self.zero.groups:
                local = [Where(shard_index(p, self.comm, shape)).take(model[name])
                         for name, p, shape in zip(g.names, g.params, g.shapes)]
                flat = g.flat_from(local)
                if g.full is not None and self.zero.stage < 3:
                    g.full.copy_(flat)
                else:
                    g.shard.copy_(flat[g.lo:g.hi])
            for name, value, where, _ in self.zero.pieces:
                if master_of(self.optimizer, value) is not value:  # mixed precision: the fp32 masters
                    master_of(self.optimizer, value).copy_(where.take(model[name]))
        for _, value, _, _ in self.zero.pieces:
            self.optimizer.state.pop(master_of(self.optimizer, value), None)
        for name, value, where, _ in self.zero.pieces:
            entry = optim.get(name)
            if entry:
                self.optimizer.state[master_of(self.optimizer, value)] = {
                    k: (where.take(v).to(value.device, copy=True) if k != "step" and torch.is_tensor(v)
                        else v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()}

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def state_bytes(self) -> dict:
        z = self.zero
        held = [g.full if z.stage < 3 else g.shard for g in z.groups]
        grads = [g.grad_full if z.stage == 1 else g.grad_shard for g in z.groups]
        return model_state_bytes(held, self.optimizer, grads=grads, master=master_bytes(self.optimizer),
                                 gathered=z.peak_gathered)


class SplitHoldings:
    """One rank's holdings made of several, each over its own parameters (expert parallelism
    under ZeRO: the dense parameters' shards over dp, the experts' over edp), read and
    written as one: lists concatenated, streams one after the other (the same order on
    every rank). The optimizer is shared, so its states and masters are counted once."""

    def __init__(self, parts: list):
        self.parts = parts

    def _all(self, method: str, *args) -> list:
        return [x for part in self.parts for x in getattr(part, method)(*args)]

    def trained(self):
        return self._all("trained")

    def pieces(self):
        return self._all("pieces")

    def entries(self, kind: str):
        return self._all("entries", kind)

    def stream(self, kind: str, batch_bytes: int = 0):
        for part in self.parts:
            yield from part.stream(kind, batch_bytes)

    def checkpointed(self):
        return self._all("checkpointed")

    def restored(self):
        return self._all("restored")

    def read_on_load(self):
        return self._all("read_on_load")

    def finish_load(self) -> None:
        for part in self.parts:
            part.finish_load()

    def load(self, model: dict, optim: dict) -> None:
        for part in self.parts:
            part.load(model, optim)

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_bytes(self) -> dict:
        first, *rest = [part.state_bytes() for part in self.parts]
        out = dict(first)
        for more in rest:  # the optimizer's states and masters are the whole optimizer's in each
            for key in ("params", "grads", "gathered"):
                out[key] += more[key]
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return out
