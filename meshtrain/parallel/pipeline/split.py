"""Zero-bubble's split backward: a weight-gradient store per linear layer.

ZB-H1 runs each micro-batch's backward in two passes, the input-gradient pass early (the
previous stage waits for it) and the weight-gradient pass later (to fill the bubble). Here
the input pass is one ordinary backward in which every linear layer computes only its input
gradient δ·W (and its bias's Σδ) and keeps (x, δ) in the store, under the micro-batch's key;
every other parameter (norms, biases, embeddings) gets its gradient in that pass as usual,
through its hooks, and the graph is freed after it. The weight pass computes ∇W = δᵀ·x of
each kept pair, and nothing else: no input gradient is computed twice. Its gradients are
formed by hand, so no post-accumulate hook sees them: the synchroniser is handed each
(`weight_grad_ready`: it adds it where it keeps that gradient and marks it ready), then told
the pass is over (`end_weight_pass`: ZeRO 2 and 3 reduce-scatter there).

A linear layer is any module owning a 2-D weight (no other module shares it): whatever
`F.linear` of that weight its forward calls — `nn.Linear`'s, the tensor-parallel column and
row layers' — is taken over, through a `TorchFunctionMode` entered around that forward only.
A module that does something else with its weight (an embedding's lookup) is left as it is.
Every backward of such a layer must run inside an input pass (one outside raises: its ∇W
would have nowhere to go), so only the stages that split their backward are wrapped. Under
activation checkpointing the input pass recomputes the block and the store keeps the
recomputed input; under sequence parallelism the column layers' input is the gathered
sequence, which the store keeps whole until the weight pass."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshtrain.parallel.deferred_linear import DeferredWeightLinear, owner_counts


class WeightGradStore:
    """(weight, input, output gradient) of each linear layer's backward in an input pass,
    by micro-batch key, until that micro-batch's weight pass."""

    def __init__(self):
        self._key = None  # the micro-batch whose input pass runs
        self._kept: dict[object, list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]] = {}

    @contextmanager
    def input_pass(self, key):
        """Linear layers' backwards inside keep (x, δ) under `key` instead of forming ∇W."""
        self._key = key
        try:
            yield
        finally:
            self._key = None

    @property
    def keeping(self) -> bool:
        return self._key is not None

    def keep(self, weight: nn.Parameter, x: torch.Tensor, grad: torch.Tensor) -> None:
        self._kept.setdefault(self._key, []).append((weight, x.detach(), grad.detach()))

    def weight_grads(self, key) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """The weight pass of micro-batch `key`: ∇W = δᵀ·x of each weight's kept pairs (summed:
        a layer run on chunks of rows kept one pair a chunk), one weight at a time, its pairs
        let go as it is formed — so the pass holds one ∇W at a time beyond what it hands on.
        In the order the input pass kept them (backward's), so data-parallel buckets, filled in
        that order, complete and go out in index order during the pass."""
        by_weight: dict[nn.Parameter, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for weight, x, grad in self._kept.pop(key, []):
            by_weight.setdefault(weight, []).append((x, grad))
        for weight in list(by_weight):
            pairs = by_weight.pop(weight)
            with torch.no_grad():
                dw = weight_grad(*pairs.pop())
                while pairs:
                    dw.add_(weight_grad(*pairs.pop()))
            yield weight, dw

    def held_bytes(self) -> int:
        """The bytes of the pairs kept now (each storage once: q, k and v share their input)."""
        storages = {}
        for pairs in self._kept.values():
            for _, x, grad in pairs:
                for t in (x, grad):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def clear(self) -> None:
        self._key = None
        self._kept.clear()


def weight_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """∇W = δᵀ·x over every row (the leading dimensions flattened)."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _TakeLinear(TorchFunctionMode):
    """Inside one module's forward: its `F.linear` of `weight` becomes a `DeferredWeightLinear`
    whose backward keeps (x, δ) in the store for the weight pass. The weight goes in detached:
    no edge leads to its gradient accumulator, whose post-accumulate hooks would fire even
    for no gradient (and tell a synchroniser a gradient was complete)."""

    def __init__(self, weight: nn.Parameter, store: WeightGradStore):
        super().__init__()
        self.weight, self.store = weight, store

    def defer(self, x: torch.Tensor, grad: torch.Tensor, wants_bias: bool) -> torch.Tensor | None:
        if not self.store.keeping:
            raise RuntimeError("a zero-bubble stage's linear layer ran a backward outside an input pass: its weight "
                               "gradient would be lost (run it under WeightGradStore.input_pass)")
        self.store.keep(self.weight, x, grad)
        return grad.reshape(-1, grad.shape[-1]).sum(0) if wants_bias else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) > 1 and args[1] is self.weight and torch.is_grad_enabled():
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return DeferredWeightLinear.apply(args[0], self.weight.detach(), bias, self)
        return func(*args, **kwargs)


def split_linears(model: nn.Module, store: WeightGradStore) -> list[str]:
    """Wrap the forward of every linear layer of `model` in place (names, parameters and
    state dict stay) so that its weight gradient waits in `store`; returns their names."""
    owners = owner_counts(model)
    names = []
    for name, m in model.named_modules():
        w = m._parameters.get("weight")
        if w is not None and w.dim() == 2 and w.requires_grad and owners[w] == 1:
            _wrap(m, w, store)
            names.append(name)
    return names


def _wrap(module: nn.Module, weight: nn.Parameter, store: WeightGradStore) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        with _TakeLinear(weight, store):
            return inner(*args, **kwargs)
    module.forward = forward
