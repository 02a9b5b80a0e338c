"""Expert parallelism: a mixture of experts' experts split over the `ep` ranks (folded over
each pipeline stage's dp × cp × tp ranks: `mesh.py`), the tokens moved to them instead.

Each rank routes its own tokens (its rows, its cp share of them, its tp share under SP),
then for every MoE layer and micro-batch:

1. its (token, slot) rows are sorted by expert — the experts of ep rank j are the j-th
   contiguous E/ep of them, so the rows bound for each rank are contiguous;
2. the per-expert counts go round first (an all-to-all of ep × E/ep integers), and both
   directions' split sizes are read on the host — the one host sync of a layer's
   micro-batch, which variable-size all-to-all needs;
3. the rows go to the ranks holding their experts (all-to-all with those splits), are
   regrouped by local expert, run through the grouped experts, put back in arrival order,
   and return by the inverse all-to-all, where the router's weights combine them.

The backward runs the same two exchanges the other way round on the gradients. A rank that
sends or receives no rows still takes part in both (empty splits), so no rank waits on one
that skipped its collective.

Tensor parallelism without SP gives every tp rank the same tokens: each takes its 1/tp of
them before the dispatch (the gradient of that cut is all-gathered back: every rank's
gradient of the layer's input is whole) and the outputs are all-gathered after the combine
(its gradient cut to the rank's share), so no expert computes a token twice. The router and
the balancing loss still see every token, as without expert parallelism.

An expert's parameters are summed over its `edp` replicas (not all of dp), and count once in
the gradient norm (on edp coordinate 0, every ep rank its own chunk)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.optim import REPLICATED_OVER
from meshtrain.parallel.state import set_shard
from meshtrain.parallel.tensor import _conjugate, _own_copy

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's stacked experts: modules with `n_experts`, the stacked projections
    `gate_up_proj` [E, 2I, d] and `down_proj` [E, d, I], and the steps of their
    `combine(x, chosen, weights)`: `sort_rows`, `compute` and `weigh` (meshtrain's
    `models.moe.Experts`; by duck typing, as strategies name no model)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "n_experts") and all(isinstance(getattr(m, p, None), nn.Parameter) for p in EXPERT_PARAMS)
            and all(hasattr(m, f) for f in ("combine", "sort_rows", "compute", "weigh"))]


class LoadOverBound(ValueError):
    """A MoE layer's routing would send a rank more rows than its bound: raised on every
    ep rank alike, before the rows move."""


@dataclass(frozen=True)
class LoadBound:
    """The most rows a rank's experts of `layer` may receive: `factor` × the balanced share
    (the rows the ep group sends, over ep). Decided from every rank's totals, which every
    rank gathers alike, so that all stop or none."""
    layer: str
    factor: float

    def totals(self, send: torch.Tensor, receive: torch.Tensor, comm: Comm) -> torch.Tensor:
        """[ep, 2]: each ep rank's rows out and in (an all-gather of two numbers)."""
        return comm.gather_along(torch.stack([send.sum(), receive.sum()])[None], "ep", 0)

    def check(self, totals: list[int]) -> None:
        sent, received = totals[0::2], totals[1::2]
        share = sum(sent) / len(sent)
        if max(received) > self.factor * share:
            raise LoadOverBound(f"{self.layer}: its ep ranks would receive {received} rows, above the bound of "
                                f"{self.factor:g} × the balanced {share:g} (--ep-max-load); raise the bound, set "
                                f"--moe-capacity, or balance the routing harder")


def apply_expert_parallel(model: nn.Module, comm: Comm, *, split_tp: bool,
                          max_load: float | None = None) -> list[nn.Parameter]:
    """Keep this rank's E/ep experts of every MoE layer (their chunk of each stacked
    parameter, marked as split over ep) and route the layer's tokens by all-to-all
    (`split_tp`: tp ranks hold the same tokens — no SP — and each dispatches its 1/tp;
    `max_load`: each layer's `LoadBound` factor, None for none).
    Returns the experts' parameters: their gradients are summed over edp, not dp."""
    mesh = comm.mesh
    ep, at = mesh.size("ep"), mesh.coord("ep")
    found, params = expert_modules(model), []
    if not found:
        raise ValueError(f"ep={ep}: the model has no stacked experts to split (expert parallelism is for "
                         "mixture-of-experts models)")
    for name, m in found:
        if m.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {m.n_experts} experts of {name}")
        local = m.n_experts // ep
        for leaf in EXPERT_PARAMS:
            full = getattr(m, leaf)
            piece = nn.Parameter(_own_copy(full.detach().narrow(0, at * local, local)), requires_grad=full.requires_grad)
            set_shard(piece, "ep", 0)
            setattr(piece, REPLICATED_OVER, ("edp",))
            setattr(m, leaf, piece)
            params.append(piece)
        m.combine = partial(expert_parallel_combine, m, comm, split_tp,
                            LoadBound(name, max_load) if max_load is not None else None)
    return params


@torch.compiler.disable  # the split sizes are read on the host: run eagerly between compiled parts
def expert_parallel_combine(experts: nn.Module, comm: Comm, split_tp: bool, bound: LoadBound | None,
                            x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`Experts.combine` with the experts split over ep: x [tokens, d], chosen and weights
    [tokens, k] (global expert ids; E for a choice a capacity dropped) -> [tokens, d]."""
    if split_tp:
        x, weights = _SplitTokens.apply(x, comm), _SplitTokens.apply(weights, comm)
        chosen = _take_chunk(chosen, comm)
    order, token, counts = experts.sort_rows(chosen)
    y = dispatch_and_run(experts.compute, x[token], counts, comm, **({"bound": bound} if bound else {}))
    out = experts.weigh(x, y, token, order, weights)
    return _GatherTokens.apply(out, comm) if split_tp else out


def dispatch_and_run(compute, rows: torch.Tensor, counts: torch.Tensor, comm: Comm, *,
                     overlap: bool = False, bound: LoadBound | None = None) -> torch.Tensor:
    """`rows` [R, d] sorted by (global) expert, `counts` [E] of them per expert: each row
    run by `compute(rows, counts_per_local_expert)` on the ep rank that holds its expert,
    and returned in the order given. With `overlap` the rows bound for this rank's own
    experts do not travel: they run while the others' are in flight (the dispatch
    overlapped with 1/ep of the experts' work); without, every row goes through the
    exchange and the experts run once, after it — the default: on CPU with gloo the
    overlap measured 0.95-1.03x the serial time (`benchmarks/expert_parallel.py --overlap`),
    and the planner models the serial path. `bound`: checked before any row moves.
    Rows beyond the counts (a capacity's dropped choices, sorted last) stay, and come back
    as zeros."""
    ep, me = comm.mesh.size("ep"), comm.mesh.coord("ep")
    send = counts.view(ep, -1)  # rows bound for each ep rank, per its local expert
    receive = comm.all_to_all(send.contiguous(), "ep")  # rows coming from each rank, per my local expert
    read = [torch.stack([send.sum(1), receive.sum(1)]).reshape(-1)]
    if bound is not None:
        read.append(bound.totals(send, receive, comm).reshape(-1))
    read = torch.cat(read).tolist()  # the host sync: all-to-all's split sizes (and the bound's totals)
    splits = [read[:ep], read[ep:2 * ep]]
    if bound is not None:
        bound.check(read[2 * ep:])
    dropped = rows.shape[0] - sum(splits[0])  # the rows a capacity dropped, sorted last: they stay
    rows = rows[:rows.shape[0] - dropped] if dropped else rows
    out_splits, in_splits = ([0 if j == me and overlap else n for j, n in enumerate(s)] for s in splits)  # travelling
    lo, hi = (sum(splits[0][:me]), sum(splits[0][:me + 1])) if overlap else (0, 0)  # this rank's own rows
    # split, not sliced: the backward then joins the three gradients in one tensor (a slice's
    # backward would allocate a zero tensor of all the rows for each)
    before, own, after = rows.split([lo, hi - lo, rows.shape[0] - hi])
    pending = _Pending()
    arrived = _Launch.apply(torch.cat([before, after]) if overlap else rows, comm, out_splits, in_splits, pending)
    local = compute(own.clone(), send[me]) if overlap else None  # while the others' rows travel
    arrived = _Wait.apply(arrived, pending)  # by source rank, then local expert
    remote = receive
    if overlap:  # its own rows did not travel
        remote = receive.clone()
        remote[me] = 0
    by_expert = _expert_major(remote, sum(in_splits))
    done = compute(arrived[by_expert], remote.sum(0))
    back = _exchange(done[by_expert.argsort()], comm, in_splits, out_splits)  # in arrival order, sent back
    if overlap:
        before, after = back.split([lo, back.shape[0] - lo])
        back = torch.cat([before, local, after])
    return torch.cat([back, back.new_zeros(dropped, back.shape[1])]) if dropped else back


def _expert_major(receive: torch.Tensor, total: int) -> torch.Tensor:
    """The order that regroups rows arrived (source rank, local expert)-major into (local
    expert, source rank)-major: `receive` [ep, E/ep] counts of each block."""
    ep, local = receive.shape
    block = torch.repeat_interleave(torch.arange(ep * local, device=receive.device), receive.reshape(-1),
                                    output_size=total)
    key = (block % local) * ep + block // local
    return key.argsort(stable=True)


class _Pending:
    """The handle of an exchange in flight, from `_Launch` to `_Wait`."""
    work = None


class _Launch(torch.autograd.Function):
    """Rows sent over ep without waiting (`_Wait` waits); the gradients go back the other way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, send: list[int], receive: list[int],
                pending: _Pending) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.receive = comm, send, receive
        out, pending.work = comm.all_to_all_v(rows, "ep", send, receive, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_to_all_v(grad.contiguous(), "ep", ctx.receive, ctx.send), None, None, None, None


class _Wait(torch.autograd.Function):
    """The exchange `_Launch` started, waited for: its rows, now arrived."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, pending: _Pending) -> torch.Tensor:
        pending.work.wait()
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _exchange(rows: torch.Tensor, comm: Comm, send: list[int], receive: list[int]) -> torch.Tensor:
    """Rows exchanged over ep with the given splits, waited for (backward: the other way)."""
    pending = _Pending()
    return _Wait.apply(_Launch.apply(rows, comm, send, receive, pending), pending)


def _take_chunk(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This tp rank's contiguous 1/tp of the tokens (dim 0)."""
    n, tp = x.shape[0] // comm.mesh.size("tp"), comm.mesh.size("tp")
    if x.shape[0] % tp:
        raise ValueError(f"expert parallelism with tp={tp} and no SP splits a micro-batch's {x.shape[0]} tokens "
                         f"over tp: use micro-batches whose tokens tp divides")
    return x[comm.mesh.coord("tp") * n:(comm.mesh.coord("tp") + 1) * n]


def _gather_rows(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return comm.gather_along(x.contiguous(), "tp", 0)


_SplitTokens = _conjugate("_SplitTokens", "This tp rank's share of replicated tokens forward; the shares' "
                          "gradients all-gathered backward.", _take_chunk, _gather_rows)
_GatherTokens = _conjugate("_GatherTokens", "The tp ranks' shares all-gathered forward; this rank's share of the "
                           "(replicated) gradient backward.", _gather_rows, _take_chunk)
