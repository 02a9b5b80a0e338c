"""The experts' load over a step, made global: after each optimizer step, every router's
token counts (`TopKRouter.expert_load`, this rank's tokens over its micro-batches) are
summed over the ranks that split the batch's tokens — dp and cp always, tp under SP (tp
ranks without SP hold the same tokens, counted once) — in one all-reduce of a table with a
row per router of the whole model (and a column more: the balancing loss each router's
layer added, `TopKRouter.balance_loss`); each router then moves its balancing bias from its
global row (every replica the same step, so replicas stay bit-identical) and restarts its
count. Under pp the stages' rows are summed over pp too, so every rank reports the whole
model's load."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm


def expert_routers(module: nn.Module) -> dict[str, int]:
    """A model's routers (modules keeping an `expert_load` and an `update_bias`): name ->
    its number of experts (read before a pipeline cut, so that every stage knows them all)."""
    return {n: m.expert_load.shape[0] for n, m in module.named_modules()
            if hasattr(m, "expert_load") and hasattr(m, "update_bias")}


class ExpertLoad:
    """The routers of `module` (this rank's stage of the model) placed in a table of every
    router of the whole model (`routers`: name -> experts), and the axes the counts are
    summed over."""

    def __init__(self, module: nn.Module, comm: Comm, sp: bool, routers: dict[str, int]):
        mine, names = dict(module.named_modules()), list(routers)
        self.comm, self.rows, self.experts = comm, len(names), max(routers.values(), default=0)
        self.routers = [(names.index(n), mine[n]) for n in names if n in mine]
        self.axes = ["dp"] + (["tp"] if sp else []) + (["pp"] if comm.mesh.size("pp") > 1 else [])

    def step_table(self) -> torch.Tensor | None:
        """Collective over the token-splitting axes and pp: the step's table [every router of
        the model, experts + 1] (each router's load, and the balancing loss its layer added;
        None without routers), whose sum over replica groups a caller may add before
        `finish_step` (`meshtrain.replicas`). A stage without a router takes part all the same."""
        if not self.rows:
            return None
        table = torch.zeros(self.rows, self.experts + 1, device=self.comm.mesh.device)
        for i, router in self.routers:
            table[i, :router.expert_load.shape[0]] = router.expert_load
            if hasattr(router, "balance_loss"):
                table[i, -1] = router.balance_loss
                router.balance_loss.zero_()
        for axis in self.axes:  # other stages' rows are zero here: pp's sum fills them in
            self.comm.all_reduce(table, axis, purpose=METRICS)
        return table

    def finish_step(self, stepped: bool, table: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's global load [every router of the model, experts] and its balancing loss
        summed over the layers (a 0-dim tensor; both None without routers), from `table` (the
        step's `step_table`, made here when None), each router's bias moved from its row when
        the step was taken, and the counts restarted."""
        if not self.rows:
            return None, None
        if table is None:
            table = self.step_table()
        load = table[:, :-1]
        for i, router in self.routers:
            if stepped:
                router.update_bias(load[i, :router.expert_load.shape[0]])
            else:
                router.expert_load.zero_()
        return load, table[:, -1].sum()


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


def pool_over_ranks(module: nn.Module, comm: Comm, sp: bool, microbatches: int) -> None:
    """A model's pooled balancing loss (`PooledBalance`: over a whole forward's tokens) sums
    its counts over the ranks that split the micro-batch's tokens — dp and cp, tp under SP —
    as a plain loop's one forward of the global batch pools them (the value it adds is
    summed over them again by `ExpertLoad`: divided by their number first). Under pipeline
    parallelism no rank runs the whole forward, and with dp and micro-batches the ranks'
    micro-batches together are no plain loop's micro-batch: both refused."""
    pools = {id(m.pooled): m.pooled for m in module.modules() if getattr(m, "pooled", None) is not None}
    if not pools:
        return
    if comm.mesh.size("pp") > 1:
        raise ValueError("balance='pooled' (transformers' definition) pools every layer of a forward, which "
                         "pipeline parallelism splits over stages: use pp 1, or balance='sequence'")
    if comm.mesh.batch_dp > 1 and microbatches > 1:
        raise ValueError("balance='pooled' pools a forward's tokens over the dp ranks, whose micro-batches hold "
                         "other rows than a plain loop's micro-batch: use microbatches=1, or balance='sequence'")
    axes = tuple(a for a in ("dp",) + (("tp",) if sp else ()) if comm.mesh.size(a) > 1)
    for pooled in pools.values():
        pooled.ranks = math.prod(comm.mesh.size(a) for a in axes)
        if axes:
            pooled.sum_over = partial(_summed, comm=comm, axes=axes)


def _summed(sums: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
    out = sums.clone()
    for axis in axes:
        comm.all_reduce(out, axis)
    return out


def max_over_mean(load: torch.Tensor) -> list[float]:
    """Each router's busiest expert's tokens over the mean (1: perfectly balanced; E: every
    token on one expert), from a step's global load [routers, experts] (read on the host)."""
    load = load.double()
    return (load.max(1).values / load.mean(1).clamp_min(1e-12)).tolist()


def set_aux_scale(module: nn.Module, scale: torch.Tensor, value_scale: torch.Tensor, per_forward: torch.Tensor,
                  value_per_forward: float) -> None:
    """Give each MoE layer's balancing loss its weight for the step (`balancing.py`): per
    token, `scale` in the gradient and `value_scale` in its logged value; a pooled loss
    (one per forward), `per_forward` and `value_per_forward`. Tensors are 0-dim on the
    device: nothing read on the host, and no value a compiled block would guard on."""
    for m in module.modules():
        if hasattr(m, "aux_scale"):
            m.aux_scale, m.aux_value_scale = scale, value_scale
        if getattr(m, "pooled", None) is not None:
            m.pooled.scale, m.pooled.value_scale = per_forward, value_per_forward


def balancing_layers(module: nn.Module) -> int:
    """How many of a model's layers add a balancing loss (read before a pipeline cut)."""
    return sum(1 for m in module.modules()
               if hasattr(m, "aux_scale") and getattr(m, "aux_coef", 0) and getattr(m, "balance", "") in
               ("sequence", "batch", "pooled"))
