"""The peer of our ZeRO-1: torch's `ZeroRedundancyOptimizer` (AdamW states partitioned over
the dp group) on a `DistributedDataParallel` model: DDP all-reduces the gradients, each rank
steps its partition, and the updated parameters are broadcast, 3Ψ where ours moves 2Ψ
(reduce-scatter, all-gather)."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from meshtrain.bench.ddp import PeerSync
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.runner import PlainRunner
from meshtrain.parallel.state import ParamHoldings, model_state_bytes
from meshtrain.train import build


class _PartitionedStates(ParamHoldings):
    """ZeroRedundancyOptimizer keeps this rank's states in its inner optimizer."""

    def state_bytes(self) -> dict:
        return model_state_bytes(list(self.module.parameters()), self.optimizer.optim)


def zero1_setup(cfg: Config, comm: Comm) -> Parallelized:
    mesh, tr = comm.mesh, cfg.train
    _, model = build(cfg, mesh.device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]  # as optim.adamw decides
    rest = [p for p in model.parameters() if p.dim() < 2]
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"), bucket_cap_mb=cfg.layout.bucket_mb,
                                  gradient_as_bucket_view=True,
                                  device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None)
    optimizer = ZeroRedundancyOptimizer(
        [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        optimizer_class=torch.optim.AdamW, process_group=mesh.group("dp"), lr=tr.lr, betas=(0.9, 0.95), eps=1e-8)
    p = Parallelized(ddp, cross_entropy_sum, PeerSync(ddp.no_sync), optimizer, PlainRunner(), comm, n_params,
                     loss_scale=mesh.size("dp"))  # DDP averages over ranks: see bench/ddp.py
    p.holdings = _PartitionedStates(ddp, optimizer, comm)
    return p
