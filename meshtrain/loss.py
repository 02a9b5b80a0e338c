"""The default loss: cross-entropy summed over every prediction (tokens, or images for the
MLP). Summed, not averaged: the training step divides by the global number of loss terms,
so micro-batches and data-parallel ranks add up to exactly the full-batch gradient.

It is PyTorch's `cross_entropy` written as one autograd function so that it holds less:
`F.cross_entropy` keeps the log-softmax for backward, and its backward holds three
logits-sized tensors at once (the log-softmax, its gradient, the logits' gradient); this
one keeps the logits and a log-sum-exp per row, and never holds more than two (the logits
and one working tensor: the shifted exponentials in forward, the gradient in backward).
With a large vocabulary the loss is where a recomputing run peaks.

Targets equal to `ignore_index` (IGNORE_INDEX, -100: --pad-documents' padding) add nothing
to the sum, and their rows of the gradient are zero."""

import torch

IGNORE_INDEX = -100  # the target a loss skips: padding


class _CrossEntropySum(torch.autograd.Function):
    # The targets are saved as given (no copy kept per micro-batch); the ignored ones are
    # masked in forward and found again in backward. Masking always costs two token-sized
    # passes beside the logits' vocabulary-sized ones, and never asks the device whether any
    # target is ignored (`ignored.any()` would make the host wait once per micro-batch).
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        top = logits.detach().amax(dim=-1, keepdim=True)
        lse = (logits - top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        ignored = targets == ignore_index
        picked = logits.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
        return (lse - picked).masked_fill_(ignored, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        ignored = targets == ctx.ignore_index
        g = (logits - lse.unsqueeze(-1)).exp_()  # softmax
        g.scatter_add_(-1, targets.masked_fill(ignored, 0).unsqueeze(-1), torch.full_like(lse, -1.0).unsqueeze(-1))
        g.mul_(grad)
        return g.masked_fill_(ignored.unsqueeze(-1), 0.0), None, None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Σ of −log softmax(logits)[target] over the targets that are not `ignore_index`."""
    return _CrossEntropySum.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index)
