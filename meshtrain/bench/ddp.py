"""The peer of our data parallelism: torch's DistributedDataParallel on the same model,
optimizer, process group and bucket size, driven by the same step function as ours."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

from torch.nn.parallel import DistributedDataParallel

from meshtrain.comm import Comm
from meshtrain.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import build_optimizer
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.runner import PlainRunner
from meshtrain.train import build


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
    _, model = build(cfg, mesh.device)
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"), bucket_cap_mb=cfg.layout.bucket_mb,
                                  gradient_as_bucket_view=True,
                                  device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None)
    optimizer = build_optimizer(list(model.named_parameters()), decay, cfg.train)
    # DDP averages gradients over ranks; our loss is already divided by the global token
    # count, so scale it by dp to get the same gradient.
    return Parallelized(ddp, cross_entropy_sum, PeerSync(ddp.no_sync), optimizer, PlainRunner(), comm,
                        n_params=sum(p.numel() for p in model.parameters()), loss_scale=mesh.size("dp"))
