"""Optimizer, learning-rate schedule and gradient clipping.

Clipping uses the global gradient norm. Parameters that a strategy shards carry the mesh
axes they are split over in `SHARDED_OVER`; their partial squared norms are summed over those
axes, in fp64, so the norm is the full model's whatever the layout, up to fp32's rounding."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.mesh import AXES

SHARDED_OVER = "meshtrain_sharded_over"
# The axes over which a parameter is a replica unless it says it is sharded over them.
REPLICATED_AXES = ("dp", "tp")
# The axes a tensor's replicas lie along, where not the default's (dp and tp but those it is
# split over): an expert chunk's are its edp group's (`parallel/experts.py`).
REPLICATED_OVER = "meshtrain_replicated_over"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (PyTorch-native peers hold those), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


# The shape of the one-process tensor that a trained tensor is (a part of): set on tensor-
# parallel shards and ZeRO's flat pieces, read through `full_shape`.
FULL_SHAPE = "meshtrain_full_shape"

OptimizerFactory = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]

# Optimizers whose update of each element reads only that element's gradient and state: they
# step a shard (tensor-parallel) or a flat piece (ZeRO) exactly as they would the whole tensor.
# Others (Adafactor's factored moments, LBFGS, LAMB's and Shampoo's per-tensor norms or
# preconditioners) would step a piece differently from the whole, so they are refused there.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in
                    ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
                     "Adadelta") if hasattr(torch.optim, name))


def full_shape(t: torch.Tensor) -> torch.Size:
    """The full (one-process) shape of the parameter `t` is, or is a part of: a tensor-parallel
    shard's or a ZeRO piece's whole parameter, else `t`'s own shape. An optimizer factory reads
    it to decide per parameter (no weight decay when `len(full_shape(p)) < 2`)."""
    shape = getattr(t, FULL_SHAPE, None)
    return torch.Size(shape) if shape is not None else t.shape


def adamw(lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
          eps: float = 1e-8) -> OptimizerFactory:
    """The command line's optimizer, as a factory: AdamW where matrices decay (GPT-2's and
    nanoGPT's rule, decided on full shapes) and biases and norms do not."""
    def make(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(decay_groups(named, weight_decay), lr=lr, betas=betas, eps=eps)
    return make


def decay_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Parameter groups where matrices decay by `weight_decay` and biases and norms do not,
    decided on full shapes (`full_shape`), leaving out an empty group."""
    decayed = [p for _, p in named if len(full_shape(p)) >= 2]
    rest = [p for _, p in named if len(full_shape(p)) < 2]
    return [g for g in ({"params": decayed, "weight_decay": weight_decay},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def keep_grad_views(optimizer: torch.optim.Optimizer, zero_buffers: Callable[[], None]) -> None:
    """Make `optimizer.zero_grad()` zero, in place, the buffers a synchroniser fills (ZeRO's
    shards, whose `.grad` are views of them), whatever `set_to_none` says. torch's default
    (None) would cut the views, and from then on the optimizer would skip every tensor — and
    clipping see a norm of 0 — while the synchroniser went on filling the buffers; and zeroing
    only the views would leave the rest of a full gradient buffer (ZeRO-1's) to add last
    step's gradients into the next."""
    optimizer.zero_grad = lambda set_to_none=True: zero_buffers()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):  # a tensor learning rate (torchao's) changes in place
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def by_device_and_dtype(tensors) -> list[list[torch.Tensor]]:
    """The tensors grouped so that each group is one `torch._foreach_*` launch."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def zero_(tensors) -> None:
    """Zero the tensors in place (their local parts), one launch per device and dtype, where
    a loop of `zero_` would dispatch one per tensor."""
    for group in by_device_and_dtype(local_tensor(t) for t in tensors):
        torch._foreach_zero_(group)


def scale_(tensors, factor) -> None:
    """Multiply the tensors in place by `factor` (a number, or a 0-dim tensor that stays on
    its device: nothing is read on the host), one launch per device and dtype."""
    for group in by_device_and_dtype(tensors):
        if torch.is_tensor(factor):
            torch._foreach_mul_(group, factor.to(group[0].device, group[0].dtype))
        else:
            torch._foreach_mul_(group, factor)


def divide_(tensors, divisor: torch.Tensor) -> None:
    """Divide the tensors in place by a 0-dim tensor (on the device), one launch per device
    and dtype."""
    for group in by_device_and_dtype(tensors):
        torch._foreach_div_(group, divisor.to(group[0].device, group[0].dtype))


def norm_dtype(device: torch.device) -> torch.dtype:
    """fp64 for a norm's squares, where the device has it. In fp32, torch's CPU norm of a
    large tensor loses up to 5e-5 (gpt-small's head gradient), and a layout that norms shards
    loses differently from one that norms whole tensors. MPS has no fp64: fp32 there."""
    return torch.float32 if device.type == "mps" else torch.float64


# On the CPU torch norms a tensor in fp64 through an fp64 copy of it (measured: 2× the fp32
# tensor's bytes); normed in pieces of this many elements, the copy stays at 8 MiB. CUDA's
# kernel reads the tensor in place, accumulating in fp64.
CPU_NORM_PIECE = 1 << 20


def _norm_pieces(tensors):
    for t in tensors:  # a tensor within a piece is normed as it is: no view or split to dispatch
        yield from t.reshape(-1).split(CPU_NORM_PIECE) if t.device.type == "cpu" and t.numel() > CPU_NORM_PIECE \
            else (t,)


def sum_of_squares(tensors, device: torch.device) -> torch.Tensor:
    """Σ‖t‖² of `tensors`, a 0-dim tensor on `device` in `norm_dtype` (nothing read on the
    host): the norms taken by `torch._foreach_norm` with an fp64 result, which accumulates in
    fp64 on CPU and CUDA, one launch per device and dtype; their squares summed in fp64."""
    dtype = norm_dtype(device)
    squares = [torch.stack(torch._foreach_norm(group, 2.0, dtype=norm_dtype(group[0].device))).to(device, dtype)
               .square().sum() for group in by_device_and_dtype(_norm_pieces(tensors))]
    return torch.stack(squares).sum() if squares else torch.zeros((), dtype=dtype, device=device)


def grad_norm(params, comm: Comm, *, world_sum: torch.Tensor | None = None) -> torch.Tensor:
    """The global gradient norm, an fp32 0-dim tensor on the mesh's device (nothing read on
    the host). `world_sum`: a few numbers (1-dim, on the device) summed over every rank in
    the same all-reduces, in place — what a step must agree on rides on this collective
    instead of one of its own (the preemption poll).

    Every rank issues the same collectives whatever gradients it holds (a pipeline stage owns
    some parameters, a shard may be empty): one all-reduce of one number per mesh axis,
    counted under `metrics`. Each tensor's squared norm counts once: a replicated gradient
    only on the ranks at coordinate 0 of the axes it is replicated over; a sharded one
    (`SHARDED_OVER`) on every rank of those axes; pipeline stages hold different parameters,
    so every stage counts. The squares are taken, summed and all-reduced in fp64
    (`sum_of_squares`), so that the norm of shards is the norm of the whole tensors up to
    fp64 rounding, in every layout; only the root is rounded to fp32, what clipping scales
    fp32 gradients by."""
    mesh = comm.mesh
    counted = []
    for p in params:
        if p.grad is None:
            continue
        sharded = set(getattr(p, SHARDED_OVER, ()))
        replicated = getattr(p, REPLICATED_OVER, REPLICATED_AXES)
        if all(mesh.coord(axis) == 0 for axis in replicated if axis not in sharded):
            counted.append(local_tensor(p.grad))  # a gradient carries no graph: nothing to detach
    total = sum_of_squares(counted, mesh.device)
    if world_sum is not None:
        total = torch.cat([total.reshape(1), world_sum.to(total.dtype)])
    for axis in AXES:
        comm.all_reduce(total, axis, purpose=METRICS)
    if world_sum is not None:
        world_sum.copy_(total[1:])
        total = total[0]
    return total.sqrt().float()


def clip_grads_(params, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so that their global norm `norm` (a device tensor) is at most
    `max_norm`, as torch's `clip_grad_norm_(foreach=True)` does: by min(1, max/(norm+1e-6))
    computed on the device, one launch per device and dtype."""
    if max_norm > 0:
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        scale_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))


def clip_grad_norm_(params, max_norm: float, comm: Comm) -> float:
    """Scale gradients so that their global norm is at most `max_norm`; returns the norm
    (reading it is the one host sync). A norm that is not finite is returned as it is, with
    nothing scaled: the caller skips the step."""
    params = list(params)
    norm = grad_norm(params, comm)
    value = norm.item()
    if math.isfinite(value):
        clip_grads_(params, max_norm, norm)
    return value


def optimizer_from(factory: OptimizerFactory, named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    """The optimizer `factory` makes for the (name, tensor) pairs; a factory that returns
    something else is refused with one line."""
    optimizer = factory(named)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: the factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer "
                        f"(write it as `lambda named_params: torch.optim.AdamW((p for _, p in named_params), ...)`)")
    return optimizer


def check_optimizer(factory: OptimizerFactory, model: nn.Module, *, elementwise: bool) -> None:
    """Before any strategy touches the model: the factory, tried on one small stand-in per
    parameter (same names, full shapes through `full_shape`), makes a torch optimizer — and,
    where tensors are stepped in pieces (`elementwise`: ZeRO's shards, tensor-parallel
    splits), one of `ELEMENTWISE`. Nothing is half applied when it is refused."""
    if not callable(factory):
        raise TypeError("optimizer: pass a factory taking (name, parameter) pairs, e.g. "
                        "`lambda named_params: torch.optim.AdamW((p for _, p in named_params), lr=1e-3)`")
    stand_ins = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            t = torch.zeros(1, requires_grad=True)
            setattr(t, FULL_SHAPE, tuple(p.shape))
            stand_ins.append((name, t))
    optimizer = optimizer_from(factory, stand_ins)
    # (a low-bit optimizer's blocks are laid out by ZeRO and checked against tp's shards:
    # `lowbit.py`, `parallel/state_blocks.py`)
    if elementwise and not isinstance(optimizer, ELEMENTWISE) and getattr(factory, "state_block", None) is None:
        allowed = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(f"optimizer: {type(optimizer).__name__} does not step each element on its own, so it cannot "
                         f"step ZeRO's or tensor parallelism's pieces of a tensor as it would the whole; use one of "
                         f"{allowed}, or zero=0 and tp=1")
