"""What every rank measures: its model-state bytes (parameters, gradients, optimizer
states), the activation bytes autograd saves for backward, and its peak RSS; and what rank 0
writes: one JSON line per step and the loss curve."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
import torch.nn as nn


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    params = list(model.parameters())
    states = [v for st in optimizer.state.values() for v in st.values()
              if torch.is_tensor(v) and v.dim() > 0]  # skip Adam's scalar step counters
    parts = {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params),
             "optimizer": _storage_bytes(states)}
    return {"total": sum(parts.values()), **parts}


class ActivationMeter:
    """Counts the bytes autograd saves for backward during a forward pass (parameters that
    are saved are not activations and are left out). Use as a context manager."""

    def __init__(self, model: nn.Module):
        self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.peak = 0
        self._seen: dict[int, int] = {}
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._param_storages:
            self._seen[ptr] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self.peak = max(self.peak, sum(self._seen.values()))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class StepLog:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed as it goes."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
