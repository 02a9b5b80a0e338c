"""Sampling text from a model: temperature and top-k, one token at a time."""

from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], n_new: int, max_seq_len: int, *, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0) -> list[int]:
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt or [0]], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    for _ in range(n_new):
        logits = model(ids[:, -max_seq_len:])[0, -1].float().cpu() / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt.to(device).view(1, 1)], dim=1)
    model.train(was_training)
    return ids[0, len(prompt or [0]):].tolist()
