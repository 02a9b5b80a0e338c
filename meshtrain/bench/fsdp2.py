"""The peer of our ZeRO-3: PyTorch's FSDP2, `fully_shard` applied to each block and then to
the whole model (the parameters outside the blocks form the root's group), over the dp
group, with its defaults: parameters resharded after forward, the next block's all-gather
prefetched. Its parameters, gradients and AdamW states are DTensor shards. Under
`--precision bf16` its `MixedPrecisionPolicy` computes in bf16 and reduce-scatters in the
`--grad-dtype`, on fp32 sharded parameters (which are then its master weights)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshtrain.bench.ddp import PeerSync, peer_dtypes, peer_loss
from meshtrain.comm import Comm
from meshtrain.parallel.modules import find_block_list
from meshtrain.cli.config import Config
from meshtrain.optim import SHARDED_OVER, adamw
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
    dp_mesh = mesh.device_mesh("dp")
    compute, reduce = peer_dtypes(cfg)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
    for block in find_block_list(model)[1]:  # the GPT's blocks, the Llama's layers
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    for p in model.parameters():  # our clipping sums the squared norms of the shards over dp
        setattr(p, SHARDED_OVER, ("dp",))
    optimizer = adamw(cfg.train.lr, cfg.train.weight_decay)(list(model.named_parameters()))
    # FSDP2 averages gradients over ranks; our loss is already divided by the global token count.
    return Parallelized(model, peer_loss(cfg), PeerSync(partial(_no_gradient_sync, model)), optimizer, PlainRunner(),
                        comm, n_params, loss_scale=mesh.size("dp"), compute_dtype=compute)
