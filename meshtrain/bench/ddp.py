"""The peer of our data parallelism: torch's DistributedDataParallel on the same model,
optimizer, process group and bucket size, driven by the same step function as ours.

Under `--precision bf16` it runs as ours does: the model in bf16, AdamW on fp32 masters
(`MasterWeights`), the loss in fp32, and gradients reduced over dp in the `--grad-dtype`
(DDP's own `_MixedPrecision` needs CUDA events, so an fp32 reduction is a comm hook here).
One difference stays: DDP accumulates micro-batches in its bf16 buckets, ours in fp32."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import adamw
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.precision import COMPUTE_DTYPES, MasterWeights, fp32_loss
from meshtrain.parallel.runner import PlainRunner
from meshtrain.train import build


def peer_dtypes(cfg: Config) -> tuple[torch.dtype, torch.dtype]:
    """The compute dtype and the dtype gradients are reduced in, as our layout has them."""
    compute = COMPUTE_DTYPES[cfg.layout.precision]
    return compute, torch.float32 if cfg.layout.grad_dtype == "fp32" else compute


def peer_loss(cfg: Config):
    return cross_entropy_sum if cfg.layout.precision == "fp32" else fp32_loss(cross_entropy_sum)


def _all_reduce_in(dtype: torch.dtype):
    """A DDP comm hook: each bucket averaged over the group in `dtype`, then copied back."""
    def hook(group, bucket):
        buffer = bucket.buffer()
        wide = buffer.to(dtype).div_(group.size())
        work = dist.all_reduce(wide, group=group, async_op=True)
        return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))
    return hook


class PeerSync:
    """A peer that syncs inside backward (DDP, FSDP2): the step needs only its `no_sync`,
    a context manager of the peer's."""

    def __init__(self, no_sync: Callable[[], AbstractContextManager]):
        self._no_sync = no_sync

    def no_sync(self):
        return self._no_sync()

    def finish_grad_sync(self) -> None:
        pass

    def reset(self) -> None:
        pass


def ddp_setup(cfg: Config, comm: Comm) -> Parallelized:
    mesh = comm.mesh
    compute, reduce = peer_dtypes(cfg)
    _, model = build(cfg, mesh.device)
    model.to(compute)
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"), bucket_cap_mb=cfg.layout.bucket_mb,
                                  gradient_as_bucket_view=True,
                                  device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None)
    named = list(model.named_parameters())
    if compute == torch.float32:
        optimizer = adamw(cfg.train.lr, cfg.train.weight_decay)(named)
    else:
        optimizer = MasterWeights(named, adamw(cfg.train.lr, cfg.train.weight_decay))
        if reduce != compute:
            ddp.register_comm_hook(mesh.group("dp"), _all_reduce_in(reduce))
    # DDP averages gradients over ranks; our loss is already divided by the global token
    # count, so scale it by dp to get the same gradient.
    return Parallelized(ddp, peer_loss(cfg), PeerSync(ddp.no_sync), optimizer, PlainRunner(), comm,
                        n_params=sum(p.numel() for p in model.parameters()), loss_scale=mesh.size("dp"),
                        compute_dtype=compute)
