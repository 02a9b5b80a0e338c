"""How a user's loss is weighted, so that every layout trains the model a plain PyTorch loop
over the same batches trains.

A mean is over its own micro-batch's terms. Summed over micro-batches and data-parallel
ranks as it is, a rank with fewer real targets would weigh each of them more than a plain
loop's mean over the whole batch does (transformers' old gradient-accumulation bug). So a
mean is taken apart where it is made: while the loss — and, for a model that computes its
own `.loss`, its forward — runs, `CountedMeans` (a `TorchFunctionMode`) sees every
`F.cross_entropy` and `F.nll_loss` call, turns a mean into a sum and counts its terms (the
targets that are not ignored). The step back-propagates the sums and divides the gradients
once, before clipping, by the count all-reduced over the global batch: a count found in the
first micro-batch's forward is not yet global, so the division waits for all of them. The
loss reported is the global mean.

A model whose forward takes `**kwargs` (as transformers' do) is passed
`num_items_in_batch`, counted beforehand as transformers' Trainer counts it (`labels[...,
1:] != -100` over the global batch for a causal LM); its loss then divides its sum by it
and is already the global mean's share. The terms its cross-entropy really had are counted
in the first step, which is refused if the count differs; after it the model's forward runs
without the mode (as does a loss weighted by rows): only a counted mean needs it each step.

What cannot be re-weighted is refused in one line at the first step: a loss that adds other
terms to a counted mean (a mixture-of-experts router's auxiliary loss), a class-weighted
cross-entropy. A mean of another kind (MSE, ...) is weighted by rows, exact when every row
has as many terms; when its targets hold the ignore index the first step says so."""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshtrain.loss import IGNORE_INDEX, cross_entropy_sum

_LOSSES = (F.cross_entropy, F.nll_loss)
_SIGNATURES = {f: inspect.signature(f) for f in _LOSSES}
_DIVISIONS = (torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.true_divide, torch.div, torch.true_divide)


def loss_terms(input: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The number of terms a cross-entropy or NLL mean averages (a device tensor): the class
    targets that are not `ignore_index`, or with class probabilities every sample."""
    if target.is_floating_point():
        classes = input.shape[1] if input.dim() > 1 else input.shape[0]
        return torch.tensor(input.numel() // classes, device=input.device)
    return (target != ignore_index).sum()


class CountedMeans(TorchFunctionMode):
    """While active: every mean cross-entropy or NLL becomes its sum, kept with its count of
    terms (`means`); a summed one is kept with its count (`sums`); a summed one divided by
    `num_items` (the `num_items_in_batch` passed to the model, or a copy of it) is kept as
    already normalised (`normalized`). `weighted`: a mean over class weights was seen (not
    re-weighted: its denominator is a sum of weights)."""

    def __init__(self, num_items: torch.Tensor | None = None):
        super().__init__()
        self.means: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sums: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.normalized: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.weighted = False
        self.ignore_index = IGNORE_INDEX  # the last counted mean's
        self._items = [num_items] if num_items is not None else []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SIGNATURES:
            return self._loss(func, args, kwargs)
        out = func(*args, **kwargs)
        if self._items and args:
            if func is torch.Tensor.to and _among(args[0], self._items):
                self._items.append(out)
            elif func in _DIVISIONS and len(args) == 2 and _among(args[1], self._items):
                self.normalized += [(out, count) for summed, count in self.sums if summed is args[0]]
        return out

    def _loss(self, func, args, kwargs):
        bound = _SIGNATURES[func].bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        reduction = a["reduction"]
        if a.get("size_average") is not None or a.get("reduce") is not None:
            reduction = nn._reduction.legacy_get_string(a["size_average"], a["reduce"], emit_warning=False)
        if reduction not in ("mean", "sum"):
            return func(*args, **kwargs)
        count = loss_terms(a["input"], a["target"], a["ignore_index"])
        if reduction == "sum":
            out = func(*args, **kwargs)
            self.sums.append((out, count))
        elif a["weight"] is not None:
            self.weighted = True
            out = func(*args, **kwargs)
        else:
            out = func(**{**a, "size_average": None, "reduce": None, "reduction": "sum"})
            self.means.append((out, count))
            self.ignore_index = a["ignore_index"]
        return out


def _among(t, tensors: list) -> bool:
    return any(t is u for u in tensors)


def cross_entropy(output: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy with the classes in the last dimension (logits [..., V], targets [...]),
    the mean over the targets that are not `ignore_index`: the loss of a language model or a
    classifier. Under a vocabulary-parallel head meshtrain computes it without gathering the
    logits."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def _rows(t) -> int:
    if isinstance(t, int):
        return t
    return t.shape[0] if torch.is_tensor(t) and t.dim() > 0 else 1


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the model's forward takes `num_items_in_batch` (as transformers' Trainer
    decides: the model's `accepts_loss_kwargs`, else a `**kwargs` parameter)."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params)


def labels_for_count(model: nn.Module, inputs: dict) -> torch.Tensor | None:
    """The labels transformers' Trainer counts `num_items_in_batch` over: `shift_labels`
    when given; a causal LM's labels but the first of each row (its loss shifts them); else
    the labels. None without labels."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"]
    labels = inputs.get("labels")
    if labels is None:
        return None
    loss = getattr(getattr(model, "loss_function", None), "__name__", None)
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return labels[..., 1:] if loss == "ForCausalLMLoss" and not encoder_decoder else labels


class LossTerms:
    """A user's loss as the step needs it: each micro-batch's loss as its share of the global
    batch's mean, or as a sum whose terms it counts (`counted`) for the step to divide by.

    kinds: "ce" (meshtrain.cross_entropy, F.cross_entropy, nn.CrossEntropyLoss passed
    directly: summed exactly, the terms counted from the targets beforehand); "sum" (the
    function, or with no function the model's `.loss`, returns a sum: divided by
    `normalizer`); "mean" (any other function: watched by `CountedMeans`); "own" (no
    function: the model's output carries its mean `.loss`, watched with its forward).
    A watched loss resolves at its first call to "counted" (a counted mean: a sum and its
    terms), "normalized" (the model divided its sum by `num_items_in_batch`) or "rows" (a
    mean of another kind, weighted by rows), and must stay so."""

    def __init__(self, loss_fn, reduction: str, normalizer):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={reduction!r}: use mean or sum")
        self.fn, self.normalizer = loss_fn, normalizer
        self.ignore_index, self.label_smoothing, self.flatten = IGNORE_INDEX, 0.0, False
        if reduction == "sum":
            self.kind = "sum"
        elif loss_fn is None:
            self.kind = "own"
        elif loss_fn is cross_entropy or loss_fn is F.cross_entropy:
            self.kind, self.flatten = "ce", loss_fn is cross_entropy
        elif isinstance(loss_fn, nn.CrossEntropyLoss):
            if loss_fn.weight is not None:
                raise ValueError("loss_fn: a CrossEntropyLoss with class weights averages by their sum; pass "
                                 "loss_reduction='sum' with a normalizer")
            if loss_fn.reduction != "mean":
                raise ValueError(f"loss_fn: CrossEntropyLoss(reduction={loss_fn.reduction!r}); use 'mean', or "
                                 f"loss_reduction='sum' for a sum")
            self.kind, self.ignore_index, self.label_smoothing = "ce", loss_fn.ignore_index, loss_fn.label_smoothing
        elif callable(loss_fn):
            self.kind = "mean"
        else:
            raise TypeError(f"loss_fn: {type(loss_fn).__name__} is not callable")
        if self.kind != "sum" and normalizer is not None:
            raise ValueError("normalizer: only with loss_reduction='sum' (a mean is normalised by its own terms)")
        # meshtrain's vocabulary-parallel cross-entropy can stand in for these
        self.is_cross_entropy = self.kind == "ce" or (self.kind == "sum" and loss_fn is cross_entropy_sum)
        self.watched = self.kind in ("mean", "own")
        self.resolved: str | None = None  # a watched loss's weighting, once its first call has shown it
        self.counted_ignore_index = IGNORE_INDEX  # a counted mean's, as its first call showed it
        self.settled = False  # a whole step has run: a loss divided by num_items or by rows is watched no more
        self.row_share = 1.0  # the part of a row each rank's loss covers (1/cp: cp ranks share a row)
        self._watch: CountedMeans | None = None
        self.start_step(None, torch.device("cpu"))

    @property
    def what(self) -> str:
        return "loss_fn=None: the model's loss" if self.kind == "own" else "loss_fn"

    def start_step(self, num_items: torch.Tensor | None, device: torch.device) -> None:
        """Before a step's (or an evaluation's) micro-batches: the counts start at zero, on
        `device`; `num_items`: what the model is passed as `num_items_in_batch`, if anything."""
        self.num_items = num_items
        self.counted = torch.zeros((), dtype=torch.float64, device=device)
        self.checked = torch.zeros((), dtype=torch.float64, device=device)  # the terms of a loss ÷ num_items

    def watching(self):
        """The context a watched loss's forward and loss run in (the model's own loss: its
        forward too). Once the first step has shown the loss divided by
        `num_items_in_batch` or weighted by rows, nothing is left to see: later steps run
        without the mode, which costs Python time per operator."""
        watch = not (self.settled and self.resolved in ("normalized", "rows"))
        self._watch = CountedMeans(self.num_items) if watch else None
        return self._watch if watch else nullcontext()

    def __call__(self, output, targets) -> torch.Tensor:
        """The micro-batch's loss as the runner back-propagates it: for "ce" and "sum" a sum
        (divided by the step's normalizer by the runner), for a watched loss a counted sum or
        a normalised share (its terms added to `counted` / `checked`)."""
        if self.kind == "ce":
            if self.flatten:
                output, targets = output.reshape(-1, output.shape[-1]), targets.reshape(-1)
            return _scalar(F.cross_entropy(output, targets, ignore_index=self.ignore_index,
                                           label_smoothing=self.label_smoothing, reduction="sum"))
        if self.kind == "sum":
            return _scalar(self.fn(output, targets) if self.fn is not None else _own_loss(output))
        if self.kind == "own":
            value = _scalar(_own_loss(output))
        else:
            with self.watching():
                value = _scalar(self.fn(output, targets))
        seen, self._watch = self._watch, None
        if seen is None and self.resolved is None:
            raise RuntimeError("loss_fn=None: the model's loss was computed outside the job's forward")
        return self._weigh(value, seen, targets) if seen is not None else self._settled(value, targets)

    def _settled(self, value: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor:
        """A loss resolved at its first call as "normalized" (its share of the global mean
        already) or "rows"."""
        if self.resolved == "normalized":
            return value
        share = _rows(rows) * self.row_share
        self.counted = self.counted + share
        return value * share

    def _weigh(self, value: torch.Tensor, seen: CountedMeans, rows: int | torch.Tensor) -> torch.Tensor:
        if seen.weighted:
            raise ValueError(f"{self.what} is a class-weighted cross-entropy, a mean over the weights of its "
                             f"targets that cannot be re-weighted across micro-batches and ranks; pass a sum with "
                             f"loss_reduction='sum' and a normalizer")
        normalized = [count for out, count in seen.normalized if out is value]
        means = [count for out, count in seen.means if out is value]
        if normalized and not seen.means:
            resolved = "normalized"
            self.checked = self.checked + normalized[0].to(self.checked)
        elif means and len(seen.means) == 1 and not seen.normalized:
            resolved = "counted"
        elif not (seen.means or seen.normalized or (self.num_items is not None and seen.sums)):
            resolved = "rows"
        else:
            raise ValueError(f"{self.what} adds other terms to a cross-entropy mean (a mixture-of-experts router's "
                             f"auxiliary loss, a second mean, ...), which cannot be weighted by its terms across "
                             f"micro-batches and ranks; return the sum with loss_reduction='sum' and a normalizer")
        if self.resolved is None:
            self.resolved = resolved
            self.counted_ignore_index = seen.ignore_index
        elif self.resolved != resolved:
            raise ValueError(f"{self.what} was weighted as {self.resolved!r} and is now {resolved!r}; it must be "
                             f"reduced alike in every micro-batch")
        if resolved == "counted":
            self.counted = self.counted + means[0].to(self.counted)
            return value
        return self._settled(value, rows)

    def count(self, targets, rows: int) -> float | torch.Tensor:
        """The normalizer of a "ce" or "sum" loss: the terms of the global (or this rank's)
        batch, a 0-dim tensor where they are counted from the targets (left where the targets
        are: never read on the host); 1 for a watched loss, whose terms are counted as it runs."""
        if self.kind == "ce":
            return (targets != self.ignore_index).sum()
        if self.kind == "sum":
            n = self.normalizer(targets) if callable(self.normalizer) else self.normalizer
            if torch.is_tensor(n):
                return n
            return float(n) if n is not None else 1.0
        return 1.0


def _own_loss(output) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError("loss_fn=None: the model's output must carry its loss (output.loss, HF style); pass a "
                         "loss_fn otherwise")
    return loss


def _scalar(value) -> torch.Tensor:
    if not torch.is_tensor(value) or value.dim() != 0:
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(f"loss_fn returned {shape}, not a scalar tensor: return the mean over the batch "
                         f"(or, with loss_reduction='sum', the sum)")
    return value
