"""What one `job.step` did (`meshtrain.StepOutput`)."""

from __future__ import annotations

import torch


class StepOutput:
    """What one `job.step` did: `loss`, the global batch's mean (the same on every rank);
    `grad_norm`, the global gradient norm before clipping; `lr`, the learning rate the step
    used (the first parameter group's); `stepped`, False when the norm was not finite and
    the update was skipped; `nonfinite`, then the first weight or gradient that is not
    finite (by the one-process name); `expert_load`, a mixture-of-experts model's tokens
    per expert over the step, summed over every rank, [every router of the model, experts]
    (None: no routers); `balance_loss`, the balancing loss the step added (its layers'
    coefficient × their mean over the step's tokens, summed over the layers: a 0-dim device
    tensor; None without one); `committed`, False when replica groups' vote (torchft's) did not
    commit the step: a group failed during it, and it is trained again.

    `loss` stays on the device until it is read (then a float, kept): a loop that reads a
    step's loss after it started the next one never makes the host wait for the device.
    `loss_tensor` is the 0-dim device tensor itself."""

    __slots__ = ("loss_tensor", "_loss", "grad_norm", "lr", "stepped", "nonfinite", "expert_load", "balance_loss",
                 "committed")

    def __init__(self, loss, grad_norm: float, lr: float | None, stepped: bool, nonfinite: str | None = None,
                 expert_load: torch.Tensor | None = None, balance_loss: torch.Tensor | None = None,
                 committed: bool = True):
        self.loss_tensor = loss if torch.is_tensor(loss) else torch.tensor(float(loss))
        self._loss = None if torch.is_tensor(loss) else float(loss)
        self.grad_norm, self.lr, self.stepped, self.nonfinite = grad_norm, lr, stepped, nonfinite
        self.expert_load, self.balance_loss, self.committed = expert_load, balance_loss, committed

    @property
    def loss(self) -> float:
        if self._loss is None:
            self._loss = self.loss_tensor.item()
        return self._loss

    def _values(self) -> tuple:
        return self.loss, self.grad_norm, self.lr, self.stepped, self.nonfinite

    def __eq__(self, other) -> bool:
        return isinstance(other, StepOutput) and self._values() == other._values()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"StepOutput(loss={self.loss:g}, grad_norm={self.grad_norm:g}, lr={self.lr}, stepped={self.stepped}"
                + (f", nonfinite={self.nonfinite!r})" if self.nonfinite else ")"))
