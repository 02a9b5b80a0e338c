"""What is checked of a user's model, each with one line that says what to change: before
the strategies touch it, that the layout can split it (`check_layout`) and that every rank
holds the same one (`check_same_weights`); after a step whose gradient norm is not finite,
the first weight or gradient that is not (`first_nonfinite`). `tied_names`: the names a
tied parameter is reachable under, which the full state lists."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.loss_terms import LossTerms
from meshtrain.mesh import Mesh
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.context import attention_cores
from meshtrain.parallel.pipeline.stages import PipelinePlan
from meshtrain.parallel.state import digest
from meshtrain.parallel.tensor import TensorPlan, check_plan


def check_layout(model: nn.Module, mesh: Mesh, loss: LossTerms, tp_plan: TensorPlan | None,
                 pipeline: PipelinePlan | None, chunks: int, init) -> None:
    """`parallelize`'s arguments against the mesh's axes, before anything changes: a plan for
    tp > 1 that fits the model (and a loss its vocabulary-sharded head can compute), a model
    whose attention cp can split and a loss outside it, a pipeline plan for pp > 1, and
    `init` for a model on the meta device."""
    if mesh.size("tp") > 1:
        if tp_plan is None:
            raise ValueError(f"tp_plan: tp={mesh.size('tp')} needs a plan of the model's module names to styles")
        check_plan(model, tp_plan, mesh.size("tp"))
        if tp_plan.vocab_parallel_loss and (not loss.is_cross_entropy or loss.label_smoothing):
            raise ValueError("loss_fn: the tp_plan shards the head by vocabulary, so the loss is meshtrain's "
                             "vocabulary-parallel cross-entropy (no logits gathered); pass loss_fn=meshtrain."
                             "cross_entropy (no label smoothing), or keep the head whole in the plan")
    if mesh.size("cp") > 1:
        attention_cores(model)
        if loss.kind == "own":
            raise ValueError("loss_fn=None under context parallelism: a model computing its own loss shifts its "
                             "labels inside its forward, which a cp rank's share of each sequence cannot do; pass "
                             "a loss_fn and targets shifted outside the model")
    if mesh.size("pp") > 1:
        if pipeline is None:
            raise ValueError(f"pipeline: pp={mesh.size('pp')} needs a PipelinePlan (before, blocks, after)")
        pipeline.check(model, mesh.size("pp") * chunks)
    if init is None and any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("init: the model is on the meta device (no weights); pass init=fn(name, tensor, generator) "
                         "that fills each parameter, or build the model on a real device")


def check_same_weights(model: nn.Module, mesh: Mesh) -> None:
    """Collective over the world: every rank was given the same full model (the same values
    of every parameter and buffer), before any strategy splits it. One line names the first
    tensor that differs and a rank it differs on."""
    if mesh.world_size == 1:
        return
    mine = [(n, digest(t)) for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.device.type != "meta"]
    every = mesh.comm.all_gather_object(mine)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            names = dict(every[0])
            bad = next((n for n, d in theirs if names.get(n) != d), "the parameter list")
            raise ValueError(f"model: rank {rank}'s {bad} differs from rank 0's; build the model alike on every rank "
                             f"(torch.manual_seed(same seed) before constructing it), or on the meta device with init=")


def first_nonfinite(p: Parallelized) -> str | None:
    """Collective: the first weight that holds an inf or a NaN, else the first gradient that
    does (in rank order, then this rank's order), as "weight NAME" or "the gradient of NAME"."""
    pieces = p.local_pieces()
    bad = lambda t: t is not None and not bool(torch.isfinite(t).all())  # noqa: E731
    mine = [next((f"weight {x.name}" for x in pieces if bad(x.value)), None),
            next((f"the gradient of {x.name}" for x in pieces if bad(x.grad)), None)]
    found = p.comm.all_gather_object(mine)
    return next((rank[i] for i in (0, 1) for rank in found if rank[i] is not None), None)


def tied_names(module: nn.Module) -> dict[str, str]:
    """{another name: the first name} of each parameter reachable under several names (a tied
    head): `named_parameters` gives the first name only, torch's `state_dict` every one."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases
