"""The default loss: cross-entropy summed over every prediction (tokens, or images for the
MLP). Summed, not averaged: the training step divides by the global number of loss terms,
so micro-batches and data-parallel ranks add up to exactly the full-batch gradient.

It is PyTorch's `cross_entropy` written as one autograd function so that it holds less:
`F.cross_entropy` keeps the log-softmax for backward, and its backward holds three
logits-sized tensors at once (the log-softmax, its gradient, the logits' gradient); this
one keeps the logits and a log-sum-exp per row, and never holds more than two (the logits
and one working tensor: the shifted exponentials in forward, the gradient in backward).
With a large vocabulary the loss is where a recomputing run peaks."""

import torch


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top = logits.detach().amax(dim=-1, keepdim=True)
        lse = (logits - top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
        ctx.save_for_backward(logits, targets, lse)
        return (lse - logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        g = (logits - lse.unsqueeze(-1)).exp_()  # softmax
        g.scatter_add_(-1, targets.unsqueeze(-1), torch.full_like(lse, -1.0).unsqueeze(-1))
        return g.mul_(grad), None


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _CrossEntropySum.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
