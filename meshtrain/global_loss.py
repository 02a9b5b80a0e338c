"""A step's loss over the global batch, around this rank's share of it (`loss_terms.py`
weighs each share): what the model's forward is passed beside the batch (a transformers
model's `num_items_in_batch`), the global mean and count summed over the ranks, and what
the first step checks and says of how a loss is weighted."""

from __future__ import annotations

import sys

import torch

from meshtrain.comm import METRICS
from meshtrain.loss import IGNORE_INDEX
from meshtrain.loss_terms import LossTerms, labels_for_count
from meshtrain.mesh import Mesh
from meshtrain.parallel.compose import Parallelized


def loss_inputs(terms: LossTerms, p: Parallelized, mesh: Mesh, inputs, rows: str, passes_num_items: bool) -> dict:
    """What the model's forward is passed beside the batch, and the loss's counts reset:
    a model that takes `num_items_in_batch` (transformers', `passes_num_items`) gets the
    global batch's count of its labels, as transformers' Trainer counts them."""
    labels = None
    if terms.kind == "own" and passes_num_items and isinstance(inputs, dict):
        labels = labels_for_count(p.module, inputs)
    if labels is None:
        terms.start_step(None, mesh.device)
        return {}
    n = (labels != IGNORE_INDEX).sum().to(mesh.device)
    if rows == "local":  # each rank passed its share: the shares' counts summed (a cp group shares one)
        n = n.double()
        p.comm.all_reduce(n, "dp", purpose=METRICS)
        n = (n / mesh.size("cp")).round().long()
    terms.start_step(n, mesh.device)
    return {"num_items_in_batch": n}


def global_mean(terms: LossTerms, p: Parallelized, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Collective: the global batch's mean loss from every rank's share `total`, and the
    number of terms a watched loss counted as it ran (1 when it counted none: a model
    divided by `num_items_in_batch`; None when no loss is watched: the shares were already
    divided by the global count), both 0-dim device tensors. The loss lives on
    the last pipeline stage of each replica, so both are summed over pp and dp (× cp).
    Nothing is read on the host but on the step that checks a model's own division by
    `num_items_in_batch` (the first)."""
    if not terms.watched:
        for axis in ("pp", "dp"):
            p.comm.all_reduce(total, axis, purpose=METRICS)
        return total, None
    sums = torch.stack([total.double(), terms.counted, terms.checked])
    for axis in ("pp", "dp"):
        p.comm.all_reduce(sums, axis, purpose=METRICS)
    total, counted, checked = sums.unbind()
    if not terms.settled:  # the first step: the model's own division checked (a stage may hold no loss)
        _check_num_items(terms, p, checked.item())
    counted = torch.where(counted > 0, counted, torch.ones_like(counted))  # 0: the shares were normalised
    return total / counted, counted


def _check_num_items(terms: LossTerms, p: Parallelized, checked: float) -> None:
    expected = terms.num_items.item() if terms.num_items is not None else None
    if checked and checked != expected:
        p.zero_grad()  # the step is refused whole: nothing accumulates into the next
        raise ValueError(f"loss_fn=None: the model divided its summed loss by num_items_in_batch = {expected:g} "
                         f"(its labels that are not -100, counted as transformers' Trainer counts them), but "
                         f"its cross-entropy had {checked:g} terms; pass shift_labels in the batch, or set "
                         f"model.accepts_loss_kwargs = False for meshtrain to count the terms itself")


def say_how_the_loss_is_weighted(terms: LossTerms, p: Parallelized, mesh: Mesh, inputs, targets) -> None:
    """Collective, once: a watched loss weighted by rows while its targets hold the
    ignore index trains another model than a plain loop's mean; the first step says so."""
    if terms.resolved != "rows":
        return
    held = targets if terms.kind == "mean" else (inputs.get("labels") if isinstance(inputs, dict) else None)
    ignored = torch.is_tensor(held) and not held.is_floating_point() and bool((held == IGNORE_INDEX).any())
    if p.comm.any_rank(ignored) and mesh.is_main:
        print(f"meshtrain: warning: {terms.what} is a mean meshtrain cannot see into (no cross-entropy or "
              f"NLL mean inside), so each micro-batch's mean is weighted by its rows; its targets hold the "
              f"ignore index {IGNORE_INDEX}, so micro-batches and ranks with more of them weigh differently "
              f"from a plain loop's mean: compute it with F.cross_entropy or F.nll_loss, or pass "
              f"loss_reduction='sum' with a normalizer", file=sys.stderr)
