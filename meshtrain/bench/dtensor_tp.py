"""The peer of our tensor (and sequence) parallelism: PyTorch's DTensor tensor parallelism,
`parallelize_module`, on the same GPT, data and tp group, set up as torchtitan does so the
peer is at its best:

- q, k, v and the MLP's fc are `ColwiseParallel`, the projections `RowwiseParallel`;
- under SP, `PrepareModuleInput` on attention and MLP all-gathers their input once (q, k
  and v share it), the norms are `SequenceParallel`, the projections reduce-scatter;
- the token embedding is `RowwiseParallel` (vocabulary-parallel); under SP its output is
  then cut to this rank's chunk of the sequence (an all-reduce where ours reduce-scatters:
  the learned positions are added to the whole sequence inside the embedding module);
- the head is `ColwiseParallel` with vocabulary-sharded DTensor logits, and the loss is
  `loss_parallel` cross-entropy.

It is driven by the same step function as ours; DTensor reduces the gradients of the
parameters it replicates by itself (so its synchroniser is an empty `GradSyncs`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.models.llama import Llama
from meshtrain.optim import SHARDED_OVER, adamw
from meshtrain.parallel.compose import GradSyncs, Parallelized
from meshtrain.parallel.runner import PlainRunner
from meshtrain.train import build


def dtensor_plan(n_layers: int, sp: bool) -> dict:
    seq, whole = Shard(1), Replicate()
    between = seq if sp else whole  # the residual stream's layout between regions
    plan = {
        "embed.tok": RowwiseParallel(input_layouts=whole, output_layouts=whole),
        "head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["embed"] = PrepareModuleOutput(output_layouts=whole, desired_output_layouts=seq, use_local_output=True)
        plan["norm"] = SequenceParallel()
    for i in range(n_layers):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(), f"{b}.attn.v": ColwiseParallel(),
            f"{b}.attn.proj": RowwiseParallel(output_layouts=between),
            f"{b}.mlp.fc": ColwiseParallel(), f"{b}.mlp.proj": RowwiseParallel(output_layouts=between),
        })
        if sp:
            plan.update({
                f"{b}.ln1": SequenceParallel(), f"{b}.ln2": SequenceParallel(),
                f"{b}.attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
                f"{b}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
            })
    return plan


def llama_dtensor_plan(n_layers: int, sp: bool) -> dict:
    """The same split for meshtrain's Llama: q, k, v, gate, up by columns, o and down by rows,
    the embedding by rows (vocabulary), the head by columns into a vocabulary-sharded loss;
    under SP the RMSNorms run on the sequence-sharded stream."""
    seq, whole = Shard(1), Replicate()
    between = seq if sp else whole
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=between),
        "norm": SequenceParallel() if sp else None,
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(n_layers):
        b = f"layers.{i}"
        plan.update({f"{b}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
        plan.update({f"{b}.mlp.gate_proj": ColwiseParallel(), f"{b}.mlp.up_proj": ColwiseParallel(),
                     f"{b}.self_attn.o_proj": RowwiseParallel(output_layouts=between),
                     f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=between)})
        if sp:
            plan.update({f"{b}.input_layernorm": SequenceParallel(), f"{b}.post_attention_layernorm": SequenceParallel(),
                         f"{b}.self_attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
                         f"{b}.mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,))})
    return {k: v for k, v in plan.items() if v is not None}


def _loss_parallel_cross_entropy_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.reshape(-1), reduction="sum")


class _LossParallelRunner(PlainRunner):
    """Our runner inside `loss_parallel`, which must hold for forward and backward alike."""

    def run(self, p, micro_batch, count, normalizer):
        with loss_parallel():
            total = torch.zeros((), device=p.comm.mesh.device)
            for i in range(count):
                inputs, targets = micro_batch(i)
                loss = p.loss_fn(p.module(inputs), targets) / normalizer
                loss.backward()
                total += loss.detach().full_tensor()
            return total


def dtensor_tp_setup(cfg: Config, comm: Comm) -> Parallelized:
    mesh = comm.mesh
    _, model = build(cfg, mesh.device)
    n_params = sum(p.numel() for p in model.parameters())
    plan = llama_dtensor_plan(len(model.layers), cfg.layout.sp) if isinstance(model, Llama) else \
        dtensor_plan(len(model.blocks), cfg.layout.sp)
    parallelize_module(model, mesh.device_mesh("tp"), plan)
    for p in model.parameters():  # our clipping sums the squared norms of shards over tp
        if any(isinstance(pl, Shard) for pl in getattr(p, "placements", ())):
            setattr(p, SHARDED_OVER, ("tp",))
    optimizer = adamw(cfg.train.lr, cfg.train.weight_decay)(list(model.named_parameters()))
    return Parallelized(model, _loss_parallel_cross_entropy_sum, GradSyncs(), optimizer, _LossParallelRunner(), comm,
                        n_params)
