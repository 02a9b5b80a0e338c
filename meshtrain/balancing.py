"""A mixture of experts' balancing loss weighed once per step by its tokens, whatever the
main loss's kind and normalizer.

The runner back-propagates each micro-batch's loss either already divided by the step's
normalizer (a cross-entropy passed directly, or a sum with its normalizer) or as a sum whose
gradients the step divides at its end by what the loss counted as it ran (a watched loss:
its cross-entropy's terms, its rows, or 1 when the model divided by `num_items_in_batch`;
`loss_terms.py`). A MoE layer's balancing loss joins the gradients inside that same
backward, so its weight per token carries that later division:

    loss_scale × D / N     (D: what the step divides its gradients by at its end;
                            N: the step's tokens)

and the gradient is that of `mean loss + coef × (balancing loss's mean over the step's
tokens)`, as a plain loop adds it. D must be known before the first backward. For a loss
counted as it runs it is predicted from the targets it is given (those that are not the
ignore index its cross-entropy uses), and compared with the count once the step has it: a
step whose count differs is refused before its update (`Job.update`)."""

from __future__ import annotations

import torch

from meshtrain.comm import METRICS
from meshtrain.loss_terms import LossTerms, labels_for_count
from meshtrain.mesh import Mesh


def step_tokens(inputs, rows: str, mesh: Mesh, comm, mask: torch.Tensor | None = None) -> torch.Tensor:
    """N: the global batch's tokens, the positions of its inputs' first two dimensions
    (rows × sequence; a [rows] input: a token per row) — or those `mask` keeps — as a 0-dim
    float64 device tensor."""
    if mask is not None:
        return _global(mask.sum(), rows, mesh, comm)
    x = _token_tensor(inputs)
    if not torch.is_tensor(x) or x.dim() == 0:
        raise ValueError("a mixture of experts' balancing loss is a mean over the batch's tokens: pass the "
                         "inputs as a [rows, sequence, ...] tensor (or a dict holding input_ids)")
    n = x.shape[0] * (x.shape[1] if x.dim() > 1 else 1) * (mesh.size("dp") if rows == "local" else 1)
    return torch.tensor(float(n), dtype=torch.float64, device=mesh.device)


def later_divisor(terms: LossTerms, module, mesh: Mesh, comm, inputs, targets, rows: str) -> torch.Tensor:
    """D: what the step will divide its gradients by once its micro-batches ran (a 0-dim
    float64 device tensor): 1 for a loss the runner divides itself or a model dividing by
    `num_items_in_batch`; the global batch's rows for a loss weighted by rows; for a counted
    cross-entropy mean, its targets that are not its ignore index (predicted: `Job.update`
    checks it)."""
    one = torch.ones((), dtype=torch.float64, device=mesh.device)
    if not terms.watched or terms.resolved == "normalized":
        return one
    if terms.resolved == "rows":
        return one * _token_tensor(inputs).shape[0] * (mesh.size("dp") if rows == "local" else 1)
    labels = targets if terms.kind == "mean" else (labels_for_count(module, inputs) if isinstance(inputs, dict)
                                                   else None)
    if not torch.is_tensor(labels):
        raise ValueError(f"{terms.what} is a cross-entropy mean counted as it runs, and a mixture of experts' "
                         f"balancing loss is weighed before the backward by that count: pass the labels in the "
                         f"batch (or return the loss divided by num_items_in_batch)")
    if labels.is_floating_point():  # class probabilities: a term per sample
        n = torch.tensor(labels.numel() // max(labels.shape[-1], 1))
    else:
        n = (labels != terms.counted_ignore_index).sum()
    return _global(n, rows, mesh, comm)


def _token_tensor(inputs):
    """The batch's tensor of tokens: the inputs, or a dict's input_ids (else its first tensor)."""
    if isinstance(inputs, dict):
        return inputs.get("input_ids", next((v for v in inputs.values() if torch.is_tensor(v)), None))
    return inputs


def _global(n: torch.Tensor, rows: str, mesh: Mesh, comm) -> torch.Tensor:
    """A count of the batch as float64 on the device: the global batch's as it is, or under
    rows="local" this rank's share summed over dp (a cp group passed one share between it)."""
    n = n.to(mesh.device, torch.float64)
    if rows == "local":
        comm.all_reduce(n, "dp", purpose=METRICS)
        n = n / mesh.size("cp")
    return n


def refuse_miscounted(terms: LossTerms, counted: float, predicted: float) -> None:
    """The step's count of its cross-entropy's terms differed from what its targets predicted
    (the cross-entropy was given other targets: shifted, masked further): refused in one line."""
    raise ValueError(f"{terms.what}: its cross-entropy counted {counted:g} terms this step, but its targets hold "
                     f"{predicted:g} that are not {terms.counted_ignore_index} — a mixture of experts' balancing "
                     f"loss is weighed before the backward from the targets; give the cross-entropy the targets "
                     f"as they are, or pass loss_reduction='sum' with a normalizer")
