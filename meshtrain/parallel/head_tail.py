"""How context parallelism splits a sequence: into 2·cp equal chunks, cp rank r holding
chunks r and 2·cp−1−r (head-tail, so every rank has as much causal attention work). Pure
positions, apart from the strategies that use them (the ring, keyed dropout)."""

from __future__ import annotations

import torch


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2·cp chunks of a sequence that cp rank `rank` holds (head-tail)."""
    return rank, 2 * cp - 1 - rank


def sequence_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of the tokens cp rank `rank` holds, in its order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2·cp = {2 * cp} equal chunks; use a "
                         f"multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp)])
