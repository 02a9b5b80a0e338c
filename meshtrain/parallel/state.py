"""The state of a parallelized model by parameter name, at full shape: what verify, the
checkpoint and the text sample read, whatever the layout. Names are those of the full
model under every strategy, so two layouts' states match key by key."""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def digest(t: torch.Tensor) -> bytes:
    """A fingerprint of a tensor's exact bytes (bit-identical tensors, equal digests)."""
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()


def optimizer_state(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict[str, dict]:
    """Each parameter's optimizer state (Adam's step and moments), keyed by its name, on the CPU."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                out[names[p]] = {k: cpu_copy(v) if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def load_optimizer_state(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                         state: dict[str, dict]) -> None:
    """Replace the optimizer state of the named parameters by `state` (copies, on each
    parameter's device; Adam's step counter stays where Adam keeps it). A parameter absent
    from `state` starts with none, as before its first step."""
    for p in params.values():
        optimizer.state.pop(p, None)
    for name, entry in state.items():
        p = params[name]
        optimizer.state[p] = {k: (v.clone() if k == "step" else v.to(p.device, copy=True)) if torch.is_tensor(v) else v
                              for k, v in entry.items()}
