"""The peer of our ZeRO-3: PyTorch's FSDP2, `fully_shard` applied to each block and then to
the whole model (the parameters outside the blocks form the root's group), over the dp
group, with its defaults: parameters resharded after forward, the next block's all-gather
prefetched. Its parameters, gradients and AdamW states are DTensor shards."""

from __future__ import annotations

from contextlib import contextmanager

from torch.distributed.fsdp import fully_shard

from meshtrain.comm import Comm
from meshtrain.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import SHARDED_OVER, build_optimizer
from meshtrain.parallel import Parallelized
from meshtrain.parallel.runner import PlainRunner
from meshtrain.train import build


class _FSDPSync:
    """FSDP2 reduce-scatters inside backward; accumulating micro-batches turns that off."""

    def __init__(self, model):
        self._model = model

    @contextmanager
    def no_sync(self):
        self._model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._model.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        pass

    def reset(self) -> None:
        pass


def fsdp2_setup(cfg: Config, comm: Comm) -> Parallelized:
    mesh = comm.mesh
    _, model = build(cfg, mesh.device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = {n for n, p in model.named_parameters() if p.dim() >= 2}
    dp_mesh = mesh.device_mesh("dp")
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for p in model.parameters():  # our clipping sums the squared norms of the shards over dp
        setattr(p, SHARDED_OVER, ("dp",))
    optimizer = build_optimizer(list(model.named_parameters()), decay, cfg.train)
    # FSDP2 averages gradients over ranks; our loss is already divided by the global token count.
    return Parallelized(model, cross_entropy_sum, _FSDPSync(model), optimizer, PlainRunner(), comm, n_params,
                        loss_scale=mesh.size("dp"))
