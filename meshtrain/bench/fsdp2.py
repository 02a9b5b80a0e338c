"""The peer of our ZeRO-3: PyTorch's FSDP2, `fully_shard` applied to each block and then to
the whole model (the parameters outside the blocks form the root's group), over the dp
group, with its defaults: parameters resharded after forward, the next block's all-gather
prefetched. Its parameters, gradients and AdamW states are DTensor shards."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from torch.distributed.fsdp import fully_shard

from meshtrain.bench.ddp import PeerSync
from meshtrain.comm import Comm
from meshtrain.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import SHARDED_OVER, build_optimizer
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.runner import PlainRunner
from meshtrain.train import build


@contextmanager
def _no_gradient_sync(model):
    """FSDP2 reduce-scatters inside backward; accumulating micro-batches turns that off."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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
    return Parallelized(model, cross_entropy_sum, PeerSync(partial(_no_gradient_sync, model)), optimizer, PlainRunner(), comm, n_params,
                        loss_scale=mesh.size("dp"))
