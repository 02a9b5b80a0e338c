"""The peer of our pipeline: `torch.distributed.pipelining` on the same GPT, cut into the same
stages (our `Stage` split: same blocks per stage, embedding first, norm and head last), the
same pp group, schedule, number of micro-batches and data.

Each virtual stage becomes a module of its own wrapped in a `PipelineStage`; the schedules
are torch's `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B` and
`ScheduleInterleavedZeroBubble` (the last two take the list of this rank's stages). Our loss
is already divided by the global token count, so the schedules run with `scale_grads=False`
(their default divides the gradients by the number of micro-batches once more). Driven by
the same step function as ours: clipping and AdamW are shared code."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.loss import cross_entropy_sum
from meshtrain.optim import adamw
from meshtrain.parallel.compose import GradSyncs, Parallelized
from meshtrain.parallel.pipeline.stages import Stage
from meshtrain.recipes import pipeline_plan_of
from meshtrain.train import build

SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI = {"interleaved": ScheduleInterleaved1F1B, "zb": ScheduleInterleavedZeroBubble}


class _VirtualStage(nn.Module):
    """One virtual stage's parts in order, as the module torch's `PipelineStage` wraps."""

    def __init__(self, stage: Stage, chunk: int):
        super().__init__()
        self.parts = nn.ModuleList(stage.parts(chunk))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x


class _TorchScheduleRunner:
    """Hands the whole batch (the micro-batches joined back) to torch's schedule, which
    splits it again: inputs on the first stage, targets on the last."""

    def __init__(self, schedule, first: bool, last: bool):
        self.schedule, self.first, self.last = schedule, first, last
        self.normalizer = 1.0

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(output, targets) / self.normalizer

    def run(self, p, micro_batch, count: int, normalizer: float) -> torch.Tensor:
        self.normalizer = normalizer
        batches = [micro_batch(i) for i in range(count)]
        inputs, targets = (torch.cat(parts) for parts in zip(*batches))
        losses: list[torch.Tensor] = []
        self.schedule.step(*([inputs] if self.first else []), target=targets if self.last else None,
                           losses=losses if self.last else None)
        total = torch.zeros((), device=p.comm.mesh.device)
        for loss in losses:
            total += loss.detach()
        return total


def torch_pp_setup(cfg: Config, comm: Comm) -> Parallelized:
    mesh, lay = comm.mesh, cfg.layout
    _, model = build(cfg, mesh.device)
    n_params = sum(q.numel() for q in model.parameters())
    stage = Stage(model, pipeline_plan_of(cfg.model.spec()), mesh.coord("pp"), lay.pp, lay.chunks,
                  lay.stage_layer_counts())
    torch_stages = [PipelineStage(_VirtualStage(stage, c), stage.virtual(c), lay.pp * lay.chunks, mesh.device,
                                  group=mesh.group("pp")) for c in range(lay.chunks)]
    runner = _TorchScheduleRunner(None, stage.is_first(0), stage.is_last(lay.chunks - 1))
    if lay.schedule in SINGLE:
        schedule = SINGLE[lay.schedule](torch_stages[0], lay.microbatches, runner.loss, scale_grads=False)
    else:
        schedule = MULTI[lay.schedule](torch_stages, lay.microbatches, runner.loss, scale_grads=False)
    runner.schedule = schedule
    optimizer = adamw(cfg.train.lr, cfg.train.weight_decay)(list(model.named_parameters()))
    return Parallelized(model, cross_entropy_sum, GradSyncs(), optimizer, runner, comm, n_params)
