"""Count the calls that make the host wait for the device.

On a GPU a step is fast only while the host runs ahead of the device: every call that
reads a device tensor's value on the host (`Tensor.item`, `tolist`, `bool(t)`, `float(t)`,
`int(t)`, `numpy`, `nonzero`, `t.__index__`) waits for all the work queued before it.
`HostSyncs` is a `TorchFunctionMode` that counts those calls and where they were made
(the innermost frame outside torch), so a test can hold a step to its budget on a CPU.

What it cannot see: a host-to-device copy of a CPU tensor (`.to(device)` waits for nothing,
but a pageable copy is synchronous for the host), syncs inside C++ ops (`torch.unique`, a
boolean-mask index, `repeat_interleave` without `output_size`), object collectives
(`all_gather_object` pickles through a device tensor), `cudaStreamSynchronize` calls of
a process group, and calls the autograd engine makes during a backward (a custom Function's
backward, a checkpointed block's recomputation: the mode is not active there). Those places
are tested directly."""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

SYNCING = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
           torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.numpy: "numpy",
           torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero", torch.Tensor.__index__: "index"}


def _caller() -> str:
    """The innermost frame that is not torch's, as `file:line function`."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_syncs.py"):
            return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncs(TorchFunctionMode):
    """While active: `count` of host-syncing calls, `where` a Counter of (kind, caller).
    Not counted: calls on meta tensors (nothing waits) and on the tensors in `host` (which
    stay on the host whatever the device: `optimizer_steps`)."""

    def __init__(self, host=()):
        super().__init__()
        self.where: Counter = Counter()
        self._host = {id(t) for t in host}

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = SYNCING.get(func)
        if kind is not None and args and torch.is_tensor(args[0]) and args[0].device.type != "meta" \
                and id(args[0]) not in self._host:
            self.where[(kind, _caller())] += 1
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        return "\n".join(f"{n:4d} {kind:8s} {where}" for (kind, where), n in self.where.most_common())


def optimizer_steps(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The step counters torch's optimizers keep on the host (a CPU scalar per parameter
    unless `capturable` or `fused`): reading them waits for nothing."""
    return [s["step"] for s in optimizer.state.values()
            if torch.is_tensor(s.get("step")) and s["step"].device.type == "cpu"]
