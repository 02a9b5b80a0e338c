"""The experts' load over a step, made global: after each optimizer step, every router's
token counts (`TopKRouter.expert_load`, this rank's tokens over its micro-batches) are
summed over the ranks that split the batch's tokens — dp and cp always, tp under SP (tp
ranks without SP hold the same tokens, counted once) — in one all-reduce of all the
stage's routers; each router then moves its balancing bias from the global load (every
replica the same step, so replicas stay bit-identical) and restarts its count. What a
pipeline stage reports is its own layers' load."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm


def _routers(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "expert_load") and hasattr(m, "update_bias")]


class ExpertLoad:
    """The routers of `module` (this rank's stage of the model) and the axes their counts
    are summed over."""

    def __init__(self, module: nn.Module, comm: Comm, sp: bool):
        self.routers, self.comm = _routers(module), comm
        self.axes = ["dp"] + (["tp"] if sp else [])

    def __bool__(self) -> bool:
        return bool(self.routers)

    def finish_step(self, stepped: bool) -> torch.Tensor | None:
        """Collective over the token-splitting axes: the global load [routers, experts] of the
        step (None without routers), each router's bias moved from it when the step was
        taken, and the counts restarted."""
        if not self.routers:
            return None
        load = torch.stack([r.expert_load for r in self.routers])
        for axis in self.axes:
            self.comm.all_reduce(load, axis, purpose=METRICS)
        for router, row in zip(self.routers, load):
            if stepped:
                router.update_bias(row)
            else:
                router.expert_load.zero_()
        return load
