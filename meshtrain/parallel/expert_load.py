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


def expert_routers(module: nn.Module) -> list[str]:
    """The names of a model's routers (modules keeping an `expert_load` and an `update_bias`)."""
    return [n for n, m in module.named_modules() if hasattr(m, "expert_load") and hasattr(m, "update_bias")]


class ExpertLoad:
    """The routers of `module` (this rank's stage of the model), the axes their counts are
    summed over, and `names`, every router of the whole model (all stages'), by which each
    stage's rows are placed in the load it reports."""

    def __init__(self, module: nn.Module, comm: Comm, sp: bool, names: list[str]):
        mine = dict(module.named_modules())
        self.names, self.comm = names, comm
        self.routers = [(names.index(n), mine[n]) for n in names if n in mine]
        self.axes = ["dp"] + (["tp"] if sp else [])
        self._experts: int | None = None  # under pp: every router's expert count, learned at the first step

    def finish_step(self, stepped: bool) -> torch.Tensor | None:
        """Collective over the token-splitting axes (and pp): the global load of the step,
        [every router of the model, experts] (None without routers), each router's bias moved
        from its row when the step was taken, and the counts restarted. A stage without a
        router takes part in the pipeline's sum all the same."""
        if not self.names:
            return None
        load = torch.stack([r.expert_load for _, r in self.routers]) if self.routers else None
        if load is not None:
            for axis in self.axes:
                self.comm.all_reduce(load, axis, purpose=METRICS)
            for (_, router), row in zip(self.routers, load):
                if stepped:
                    router.update_bias(row)
                else:
                    router.expert_load.zero_()
        if self.comm.mesh.size("pp") == 1:
            return load
        if self._experts is None:  # once: a stage without routers learns the experts' count
            width = torch.tensor([load.shape[1] if load is not None else 0], device=self.comm.mesh.device)
            self.comm.all_reduce(width, "pp", op=torch.distributed.ReduceOp.MAX, purpose=METRICS)
            self._experts = int(width.item())
        full = torch.zeros(len(self.names), self._experts, device=self.comm.mesh.device)
        for (i, _), row in zip(self.routers, load if load is not None else []):
            full[i] = row
        self.comm.all_reduce(full, "pp", purpose=METRICS)
        return full


class _SumOver(torch.autograd.Function):
    """Sum over the ranks of `axes`, forward; backward the same sum of the gradients: each
    rank's loss term depends on every rank's sums, so each rank's part gets them all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        out = x.contiguous().clone()
        for axis in axes:
            comm.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.contiguous().clone()
        for axis in ctx.axes:
            ctx.comm.all_reduce(out, axis)
        return out, None, None


def sum_sequences_over(module: nn.Module, comm: Comm, axes: tuple[str, ...]) -> None:
    """Make each MoE layer's balancing sums (`sequence_sum`) add up the ranks of `axes` that
    hold other tokens of the same rows (cp's ring; tp under SP)."""
    axes = tuple(a for a in axes if comm.mesh.size(a) > 1)
    if not axes:
        return
    for m in module.modules():
        if hasattr(m, "sequence_sum"):
            m.sequence_sum = lambda sums, _comm=comm, _axes=axes: _SumOver.apply(sums, _comm, _axes)


def max_over_mean(load: torch.Tensor) -> list[float]:
    """Each router's busiest expert's tokens over the mean (1: perfectly balanced; E: every
    token on one expert), from a step's global load [routers, experts] (read on the host)."""
    load = load.double()
    return (load.max(1).values / load.mean(1).clamp_min(1e-12)).tolist()


def set_aux_scale(module: nn.Module, scale) -> None:
    """Give each MoE layer's balancing loss the scale the step's loss has (`scale`: the loss
    scale over the step's normalizer, a number or a 0-dim device tensor: nothing read on the
    host), so that its per-token terms are divided as the cross-entropy's are."""
    for m in module.modules():
        if hasattr(m, "aux_scale"):
            m.aux_scale = scale
