"""Data parallelism for linear layers that moves rows instead of a weight gradient
(`--dp-linear-sync allgather|auto`).

A linear layer's weight gradient is ∇W = δᵀ·x over the rows of the batch. Plain data
parallelism all-reduces ∇W. Here, in the layer's backward, each rank launches one
asynchronous all-gather over dp of its rows [x | δ] (input and output-gradient side by
side) and goes on with the backward; at the end of the backward every gathered layer forms
the whole batch's ∇W = δ_allᵀ·x_all and ∇b = Σ δ_all itself. The input-gradient δ·W stays
local, and autograd never forms the local ∇W (the layer's backward is ours). Which rule
picks the layers, and why, is in `comm.py` (`linear_sync_bytes`).

Micro-batches: each micro-batch's rows are gathered in its own backward and its ∇W added
into the gradient, under `no_sync` too. Keeping the rows for one gather at the last
micro-batch would send the same bytes (each micro-batch has only its own B/m rows) while
holding m micro-batches' rows; gathering each at once keeps one micro-batch's rows alive and
costs m smaller collectives instead of one.

The price: each rank computes the whole batch's ∇W (N× the weight-gradient FLOPs) and holds
the gathered rows of every gathered layer until the end of its backward.

Any module that computes `F.linear(x, module.weight, module.bias)` of its first argument may
take this path: every `nn.Linear`, and a module marked with `mark_linear`. Its forward is
replaced in place (names, parameters and state dict stay as they were)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshtrain.comm import Comm, cheaper_linear_sync, linear_sync_bytes
from meshtrain.parallel.deferred_linear import DeferredWeightLinear, owner_counts

LINEAR = "meshtrain_linear"


def mark_linear(module: nn.Module) -> nn.Module:
    """Declare that `module` computes `F.linear(x, module.weight, module.bias)` of its first
    argument, so that `--dp-linear-sync` may take it over like an `nn.Linear`."""
    setattr(module, LINEAR, True)
    return module


@dataclass
class LinearChoice:
    """How one linear layer's weight gradient is made whole, and what each way sends per step."""
    name: str
    n_in: int
    n_out: int
    bias: bool
    sync: str  # "allreduce" or "allgather"
    sent: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        bias = "+bias" if self.bias else ""
        return (f"{self.name} ({self.n_in}→{self.n_out}{bias}): {self.sync} "
                f"(all-reduce {self.sent['allreduce'] / 1e3:,.1f} kB, all-gather {self.sent['allgather'] / 1e3:,.1f} kB"
                f" per step and rank)")


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers that may take the all-gather path: `nn.Linear`s and marked modules whose
    weight is trained and not shared with another module (a tied weight's gradient has
    other sources, which only the all-reduce sums)."""
    owners = owner_counts(model)
    found = []
    for name, m in model.named_modules():
        if not (isinstance(m, nn.Linear) or getattr(m, LINEAR, False)):
            continue
        params = [p for p in (m.weight, getattr(m, "bias", None)) if p is not None]
        if m.weight.dim() == 2 and m.weight.requires_grad and all(owners.get(p) == 1 for p in params):
            found.append((name, m))
    return found


def choose_linear_syncs(model: nn.Module, mode: str, rows: int, n: int, *, grad_size: int,
                        activation_size: int) -> list[LinearChoice]:
    """Each linear layer's sync under `mode` (allreduce | allgather | auto) for `rows` rows
    per step in the global batch over `n` data-parallel ranks; auto applies
    `cheaper_linear_sync` to the actual shapes."""
    choices = []
    for name, m in linear_layers(model):
        n_out, n_in = m.weight.shape
        bias = getattr(m, "bias", None) is not None
        sizes = dict(grad_size=grad_size, activation_size=activation_size)
        sync = cheaper_linear_sync(n_in, n_out, bias, rows, n, **sizes) if mode == "auto" else mode
        choices.append(LinearChoice(name, n_in, n_out, bias, sync, linear_sync_bytes(n_in, n_out, bias, rows, n,
                                                                                   **sizes)))
    return choices


class _GatheredLayer:
    """One linear layer on the all-gather path: its parameters and where their gradients live."""

    def __init__(self, module: nn.Module, sync: "LinearGather", grad_dtype: torch.dtype):
        self.sync = sync
        self.weight, self.bias = module.weight, getattr(module, "bias", None)
        self.params = [p for p in (self.weight, self.bias) if p is not None]
        self.n_in = module.weight.shape[1]
        self.grads = {p: torch.zeros(p.shape, dtype=grad_dtype, device=p.device) for p in self.params}
        for p in self.params:
            if p.dtype == grad_dtype:
                p.grad = self.grads[p]
        inner = module.forward

        def forward(x, *args, **kwargs):
            if not torch.is_grad_enabled():  # evaluation: the layer's own forward
                return inner(x, *args, **kwargs)
            return DeferredWeightLinear.apply(x, self.weight, self.bias, self)
        module.forward = forward

    def defer(self, x: torch.Tensor, grad: torch.Tensor, wants_bias: bool) -> None:
        """The backward's rows [x | δ] go to the layer's all-gather; the weight and bias
        gradients are formed from every rank's rows."""
        self.sync.send_rows(self, x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]))

    def add_grads(self, xs: torch.Tensor, ds: torch.Tensor) -> None:
        """Add the whole batch's gradients into the buffers (re-attached as `.grad` if a
        `zero_grad(set_to_none=True)` took them away: that meant zero)."""
        for p in self.params:
            if p.dtype == self.grads[p].dtype and p.grad is not self.grads[p]:
                self.grads[p].zero_()
                p.grad = self.grads[p]
        self.grads[self.weight].add_((ds.t() @ xs).to(self.grads[self.weight].dtype))
        if self.bias is not None:
            self.grads[self.bias].add_(ds.sum(0).to(self.grads[self.bias].dtype))


class LinearGather:
    """The gradient synchroniser of the layers on the all-gather path (`choices` with sync
    "allgather"): gathers launched from their backward, waited on and turned into
    gradients when the backward ends."""

    def __init__(self, model: nn.Module, comm: Comm, choices: list[LinearChoice], *, axis: str = "dp",
                 grad_dtype: torch.dtype | None = None):
        self.comm, self.axis = comm, axis
        modules = dict(model.named_modules())
        self.layers = [_GatheredLayer(modules[c.name], self,
                                      grad_dtype or modules[c.name].weight.dtype)
                       for c in choices if c.sync == "allgather"]
        self._layer_of = {p: layer for layer in self.layers for p in layer.params}
        self._pending: list[tuple[_GatheredLayer, object, torch.Tensor]] = []
        self._callback_queued = False

    @property
    def params(self) -> list[nn.Parameter]:
        return list(self._layer_of)

    def owns(self, p: nn.Parameter) -> bool:
        return p in self._layer_of

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """Where `p`'s gradient lives (its `.grad` too when the dtypes agree)."""
        return self._layer_of[p].grads[p]

    def send_rows(self, layer: _GatheredLayer, x: torch.Tensor, delta: torch.Tensor) -> None:
        """Launch the all-gather of this rank's rows [x | δ] (one collective per layer and
        backward); they are turned into gradients when the backward ends."""
        rows = torch.cat([x, delta], dim=1)
        gathered = rows.new_empty((rows.shape[0] * self.comm.mesh.size(self.axis), rows.shape[1]))
        self._pending.append((layer, self.comm.all_gather(gathered, rows, self.axis, async_op=True), gathered))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    def inputs_and_errors(self, layer: _GatheredLayer, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's inputs x and output-gradients δ, from the gathered rows [x | δ]."""
        return gathered[:, :layer.n_in], gathered[:, layer.n_in:]

    def _drain(self) -> None:
        """At the end of a backward: wait for its gathers and form the gradients."""
        self._callback_queued = False
        pending, self._pending = self._pending, []
        for layer, work, gathered in pending:
            work.wait()
            layer.add_grads(*self.inputs_and_errors(layer, gathered))

    def no_sync(self):
        """Nothing to hold back: each micro-batch's rows are gathered in its own backward."""
        return nullcontext()

    def finish_grad_sync(self) -> None:
        """Gradients were formed at the end of each backward; nothing is left in flight."""
        self._drain()

    def reset(self) -> None:
        """After a step that failed half-way: wait for gathers in flight, zero the gradients."""
        for _, work, _ in self._pending:
            work.wait()
        self._pending, self._callback_queued = [], False
        for layer in self.layers:
            for g in layer.grads.values():
                g.zero_()
