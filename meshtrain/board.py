"""`train --tensorboard`: the run's curves as TensorBoard events in OUT/tensorboard (rank 0
writes; every rank's memory is gathered to it each step). Needs the optional `tensorboard`
package (`pip install 'meshtrain[tb]'`), checked before any rank starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MISSING = "--tensorboard needs the tensorboard package; install it with: pip install 'meshtrain[tb]'"


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class Board:
    """Scalars per step: training and held-out loss, learning rate, tokens/s, gradient
    norm, and each rank's peak resident memory."""

    def __init__(self, out: Path, comm):
        self.comm = comm
        self.writer = None
        if comm.mesh.is_main:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"))

    def step(self, step: int, *, loss: float, lr: float | None, tokens_per_s: float, grad_norm: float,
             val_loss: float | None, expert_load_max_over_mean: float | None = None,
             balance_loss: float | None = None) -> None:
        """Collective (the memory of every rank)."""
        from meshtrain.metrics import peak_rss_mib
        memory = self.comm.all_gather_object(peak_rss_mib())
        if self.writer is None:
            return
        scalars = {"loss/train": loss, "tokens_per_s": tokens_per_s, "grad_norm": grad_norm}
        if lr is not None:
            scalars["lr"] = lr
        if val_loss is not None:
            scalars["loss/held_out"] = val_loss
        if expert_load_max_over_mean is not None:  # a mixture of experts: its busiest router's max/mean load
            scalars["moe/expert_load_max_over_mean"] = expert_load_max_over_mean
        if balance_loss is not None:  # and the balancing loss it added (not in loss/train)
            scalars["moe/balance_loss"] = balance_loss
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        for rank, mib in enumerate(memory):
            self.writer.add_scalar(f"memory_mib/rank{rank}", mib, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
