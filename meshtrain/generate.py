"""Sampling text from a model: temperature and top-k, one token at a time — from a whole
model in one process (`sample`), or from any source of next-token logits (`sample_with`:
the sharded job at the end of a run, where each rank runs the same loop)."""

from __future__ import annotations

from typing import Callable, Collection

import torch
import torch.nn as nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], n_new: int, max_seq_len: int, *, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0, stop: Collection[int] = ()) -> list[int]:
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return sample_with(lambda window: model(torch.tensor([window], device=device))[0, -1], prompt, n_new,
                           max_seq_len, temperature=temperature, top_k=top_k, seed=seed, stop=stop)
    finally:
        model.train(was_training)


def sample_with(next_logits: Callable[[list[int]], torch.Tensor | None], prompt: list[int], n_new: int,
                max_seq_len: int, *, temperature: float = 0.8, top_k: int = 50, seed: int = 0,
                agree: Callable[[int], int] | None = None, stop: Collection[int] = ()) -> list[int]:
    """Up to `n_new` tokens after `prompt`: `next_logits(window)` gives the logits [vocab] of
    the token after the last `max_seq_len` ids (None on a rank that holds no output: a
    pipeline's other stages), and `agree(token)` (-1 from such a rank) the token every rank
    takes. A token of `stop` (the end-of-text ids) ends the text, and is its last token, as in
    transformers' `generate`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt or [0])
    start = len(ids)
    for _ in range(n_new):
        logits = next_logits(ids[-max_seq_len:])
        token = -1 if logits is None else _choose(logits.float().cpu(), gen, temperature, top_k)
        ids.append(agree(token) if agree is not None else token)
        if ids[-1] in stop:
            break
    return ids[start:]


def _choose(logits: torch.Tensor, gen: torch.Generator, temperature: float, top_k: int) -> int:
    logits = logits / max(temperature, 1e-5)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = -float("inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
