"""The peer of our data parallelism: torch's DistributedDataParallel on the same model,
optimizer, process group and bucket size."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from meshtrain.comm import Comm
from meshtrain.config import Config
from meshtrain.metrics import ActivationMeter
from meshtrain.optim import build_optimizer
from meshtrain.train import Setup, build


class _DDPSync:
    """DDP syncs inside backward; only its no_sync is needed by the training step."""

    def __init__(self, ddp: DistributedDataParallel):
        self.no_sync = ddp.no_sync

    def finish_grad_sync(self) -> None:
        pass


def ddp_setup(cfg: Config, comm: Comm) -> Setup:
    mesh = comm.mesh
    _, model = build(cfg, mesh.device)
    ddp = DistributedDataParallel(model, process_group=mesh.group("dp"), bucket_cap_mb=cfg.layout.bucket_mb,
                                  gradient_as_bucket_view=True,
                                  device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None)
    # DDP averages gradients over ranks; our loss is already divided by the global token
    # count, so scale it by dp to get the same gradient.
    return Setup(ddp, _DDPSync(ddp), build_optimizer(model, cfg.train), ActivationMeter(model),
                 loss_scale=mesh.size("dp"))
