"""Mixed precision (`--precision bf16`): parameters and activations in bf16 for compute and
communication; fp32 master weights and fp32 AdamW moments for the update; the loss in fp32.
The masters are made from the bf16 weights (the seeded fp32 initialisation rounded once), as
DeepSpeed does. Gradients are accumulated and reduced in fp32 by default (18 bytes per
parameter: 2 + 4 + 4 + 4 + 4, as Megatron and torchtitan keep them); `--grad-dtype compute`
keeps them in bf16, the ZeRO paper's 16.

`MasterWeights` is the optimizer the loop drives: the user's optimizer on fp32 copies of the tensors it is
given — the parameters, or ZeRO's pieces of a shard, so the masters are sharded with them.
Each step upcasts the (synchronised, clipped) bf16 gradients into the masters' `.grad` for
the update only (`--grad-dtype compute`), steps, and rounds the masters back into the bf16
tensors. Under `--grad-dtype fp32` the gradients are accumulated in fp32 buffers instead (the
bf16 gradient of each backward is added into them and freed), which are the masters' `.grad`
for good."""

from __future__ import annotations

from typing import Callable

import torch

from meshtrain.optim import OptimizerFactory, by_device_and_dtype, zero_

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fp32_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """The loss computed in fp32 from low-precision logits (softmax over a vocabulary in bf16
    would lose the small probabilities)."""
    def loss(output, targets):
        return loss_fn(output.float() if torch.is_tensor(output) else output, targets)
    return loss


class MasterWeights:
    """An optimizer (`inner`, made by `factory` on the masters) stepping fp32 masters of
    low-precision tensors; looks like a torch optimizer to the loop (`param_groups`,
    `state`, `step`, `zero_grad`, `register_step_post_hook`)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], factory: OptimizerFactory,
                 grads: dict[torch.Tensor, torch.Tensor] | None = None,
                 zero_buffers: Callable[[], None] | None = None):
        """`grads`: where each tensor's gradient lives when it is kept apart from the tensor
        (`--grad-dtype fp32`: fp32 buffers, which become the masters' `.grad` for good);
        `zero_buffers`: what `zero_grad` zeroes when a synchroniser owns the gradient buffers
        (ZeRO: `optim.keep_grad_views` says why)."""
        self._zero_buffers = zero_buffers
        self.tensors = [t for _, t in named]
        self.persistent_grads = grads is not None
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        for _, t in named:
            master = t.detach().to(torch.float32, copy=True)
            for key, value in vars(t).items():  # shard specs travel with the master
                if key.startswith("meshtrain_"):
                    setattr(master, key, value)
            self.masters[t] = master
        if grads is not None:
            for t in self.tensors:
                self.masters[t].grad = grads[t]
        self.inner = factory([(n, self.masters[t]) for n, t in named])
        self._post_hooks: list[Callable] = []

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return self.inner.state

    def step(self) -> None:
        if not self.persistent_grads:
            for t in self.tensors:
                self.masters[t].grad = None if t.grad is None else t.grad.to(torch.float32)
        self.inner.step()
        with torch.no_grad():  # the compute copies from the masters: one launch per device and dtype
            for group in by_device_and_dtype(self.tensors):
                torch._foreach_copy_(group, [self.masters[t] for t in group])
        if not self.persistent_grads:
            for t in self.tensors:
                self.masters[t].grad = None  # the upcast gradient lives for the update only
        for hook in self._post_hooks:
            hook(self, (), {})

    def zero_grad(self, set_to_none: bool = False) -> None:
        """In place whatever `set_to_none` says (the buffers are views a synchroniser fills)."""
        if self._zero_buffers is not None:
            self._zero_buffers()
            return
        grads = (self.masters[t].grad if self.persistent_grads else t.grad for t in self.tensors)
        zero_([g for g in grads if g is not None])

    def register_step_post_hook(self, hook: Callable) -> None:
        self._post_hooks.append(hook)


def master_of(optimizer, t: torch.Tensor) -> torch.Tensor:
    """The tensor the optimizer keeps (and keys its state by) for `t`: its fp32 master under
    mixed precision, else `t` itself."""
    masters = getattr(optimizer, "masters", None)
    return masters[t] if masters is not None else t


def master_bytes(optimizer) -> int:
    masters = getattr(optimizer, "masters", None)
    return sum(m.numel() * m.element_size() for m in masters.values()) if masters else 0


def grad_holder(optimizer, t: torch.Tensor) -> torch.Tensor:
    """The tensor whose `.grad` is `t`'s gradient: its master when gradients are kept apart
    from the low-precision tensors (`--grad-dtype fp32`), else `t`."""
    return optimizer.masters[t] if getattr(optimizer, "persistent_grads", False) else t


def grad_of(optimizer, t: torch.Tensor) -> torch.Tensor | None:
    return grad_holder(optimizer, t).grad
