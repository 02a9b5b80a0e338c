"""`meshtrain.init`: join the ranks a launcher started (torchrun, srun, mpirun), or run as
one process, and lay them out on the device mesh."""

from __future__ import annotations

import atexit
import os

from meshtrain import launch
from meshtrain.mesh import Mesh


def init(dp: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, device: str = "auto", seed: int = 0,
         timeout: float | None = None, ft=None) -> Mesh:
    """The device mesh of this job. Under torchrun, srun or mpirun this process joins the
    others (gloo on CPU, NCCL with one GPU per local rank); from a plain shell it is the
    whole job, one process. `dp=None` fills the world: world ÷ (tp·pp·cp). `ep`: a mixture
    of experts' experts split over ep ranks folded over dp·cp·tp (it adds no ranks, and must
    divide dp·cp·tp). `device`: auto
    (CUDA when present), cpu or cuda. `seed` keys what must agree across layouts (dropout
    masks, weights drawn for a meta-device model). `timeout`: seconds any collective may
    wait before the job ends with an error (default 5 minutes). A process group that the
    caller already made (`torch.distributed.init_process_group`) is used as it is.
    `ft=meshtrain.FaultTolerance(replicas=R)`: these ranks are one of R replica groups, fault
    tolerant on torchft (docs/fault-tolerance.md); the jobs `parallelize` makes on the mesh
    sum their gradients over the live groups, and a loop asks `job.begin_step()` for each
    step's number."""
    import torch.distributed as dist

    ft = ft.resolved() if ft is not None else None  # one line for a missing group id or lighthouse, before joining
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: use an integer ≥ 1")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: use auto, cpu or cuda")
    renv = launch.detect()
    if dist.is_initialized():
        world = dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif renv is not None:
        world, local_rank, local_world = renv.world_size, renv.local_rank, renv.local_world_size
    else:
        world, local_rank, local_world = 1, 0, 1
    dp = _fill_dp(dp, tp * cp, pp, world)
    if (dp * cp * tp) % ep:
        raise ValueError(f"ep={ep} does not divide dp·cp·tp = {dp}·{cp}·{tp} = {dp * cp * tp}: expert parallelism "
                         "folds over those ranks")
    torch_device = launch.choose_device(device, local_rank, local_world)
    if world == 1 and not dist.is_initialized():
        mesh = Mesh.single(torch_device)
    else:
        if not dist.is_initialized():
            launch.init_distributed(renv, torch_device, timeout_s=timeout)
            atexit.register(launch.let_collective_threads_finish)
        mesh = Mesh.build(pp, dp, tp, torch_device, cp=cp, ep=ep)
    mesh.seed = seed
    mesh.ft = ft
    return mesh


def _fill_dp(dp: int | None, tp: int, pp: int, world: int) -> int:
    """dp, filled from the world when None; one line when the axes do not multiply to it."""
    if dp is None:
        if world % (tp * pp):
            raise ValueError(f"tp·pp = {tp}·{pp} does not divide the {world} processes; choose tp and pp whose "
                             f"product divides {world}")
        return world // (tp * pp)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r}: use an integer ≥ 1, or None to fill the world")
    if dp * tp * pp != world:
        raise ValueError(f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp}, but {world} process(es) run; "
                         f"start {dp * tp * pp} (torchrun --nproc-per-node={dp * tp * pp}) or pass dp=None")
    return dp
