"""The state of a parallelized model by parameter name, at full shape: what verify, the
checkpoint and the text sample read, whatever the layout. Names are those of the full
model under every strategy, so two layouts' states match key by key.

A parameter a strategy splits carries its shard spec (`set_shard`: the mesh axis and the
dimension it is split along, in equal contiguous chunks in coordinate order); everything
else is whole on every rank. Gathering a full tensor is a collective over that axis."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.optim import SHARDED_OVER

SHARD = "meshtrain_shard"


def set_shard(p: nn.Parameter, axis: str, dim: int) -> None:
    """Mark `p` as this rank's chunk of the full tensor along `dim`, split over `axis`."""
    setattr(p, SHARD, (axis, dim))
    setattr(p, SHARDED_OVER, (axis,))


def shard_index(p: torch.Tensor, comm: Comm) -> tuple | None:
    """Where `p`'s piece sits in the full tensor (None: it is the whole tensor)."""
    spec = getattr(p, SHARD, None)
    if spec is None:
        return None
    axis, dim = spec
    n = p.shape[dim]
    return (slice(None),) * dim + (slice(comm.mesh.coord(axis) * n, (comm.mesh.coord(axis) + 1) * n),)


def gather_full(local: torch.Tensor, spec: tuple[str, int] | None, comm: Comm) -> torch.Tensor:
    """Collective over the spec's axis: the full tensor (a CPU copy) from every rank's chunk."""
    if spec is None or comm.mesh.size(spec[0]) == 1:
        return cpu_copy(local)
    axis, dim = spec
    # reading state is not the model's traffic: counted under metrics
    return comm.gather_along(local.detach(), axis, dim, purpose=METRICS).to("cpu")


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def digest(t: torch.Tensor) -> bytes:
    """A fingerprint of a tensor's exact bytes (bit-identical tensors, equal digests)."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()


def _is_per_element(v, p: nn.Parameter) -> bool:
    return torch.is_tensor(v) and v.shape == p.shape


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str], comm: Comm) -> dict[str, dict]:
    """Collective: each parameter's optimizer state (Adam's step and moments) at full shape,
    keyed by its name, on the CPU."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                spec = getattr(p, SHARD, None)
                out[names[p]] = {k: gather_full(v, spec, comm) if _is_per_element(v, p) else
                                 cpu_copy(v) if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                         state: dict[str, dict], comm: Comm) -> None:
    """Replace the optimizer state of the named parameters by this rank's part of the full
    `state` (copies on each parameter's device; Adam's step counter stays where Adam keeps
    it). A parameter absent from `state` starts with none, as before its first step."""
    for p in params.values():
        optimizer.state.pop(p, None)
    for name, entry in state.items():
        p = params[name]
        index = shard_index(p, comm)
        loaded = {}
        for k, v in entry.items():
            if torch.is_tensor(v) and k != "step":
                loaded[k] = (v[index] if index is not None and v.dim() == p.dim() else v).to(p.device, copy=True)
            else:
                loaded[k] = v.clone() if torch.is_tensor(v) else v
        optimizer.state[p] = loaded
