"""The training loop: build the model from the seed, apply the layout's strategies, and run
the steps. The same function runs every layout and the one-process reference (`verify`).

Each step: every data-parallel rank takes its contiguous slice of the global batch, splits
it into micro-batches, and accumulates their gradients (communication only on the last);
the loss is a sum over tokens divided by the global token count, so any layout produces the
full-batch gradient; then gradient sync, global-norm clipping, AdamW, zeroed gradients."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.comm import METRICS, Comm
from meshtrain.config import Config, lr_at, tokens_per_sample
from meshtrain.data.datasets import open_dataset
from meshtrain.metrics import ActivationMeter, StepLog, model_state_bytes
from meshtrain.models import build_model, count_params
from meshtrain.optim import build_optimizer, clip_grad_norm_, set_lr
from meshtrain.parallel import full_state_dict, parallelize


@dataclass
class RunResult:
    losses: list[float]
    step_times: list[float]
    n_params: int
    model_state: dict
    activation_bytes: int
    comm_per_step: dict[str, int]
    model: nn.Module
    data: object
    snapshots: dict[int, dict] = field(default_factory=dict)  # step -> full state (rank 0)


def build(cfg: Config, device):
    """The dataset and the full, unsharded model built from the seed."""
    tr = cfg.train
    data = open_dataset(tr.data, cfg.model.name, tr.vocab_size, tr.seq_len, tr.seed)
    if cfg.model.name == "mlp":
        model = build_model("mlp", tr.seed, n_inputs=data.n_inputs, n_classes=data.n_classes, device=device)
    else:
        model = build_model(cfg.model.name, tr.seed, vocab_size=data.vocab_size, device=device)
    return data, model


def loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every prediction (tokens, or images for the MLP)."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


@dataclass
class Setup:
    """What one training step needs. `model` is what forward is called on; `grad_sync` is
    the data-parallel synchroniser (or None); gradients are scaled by `loss_scale` (a peer
    that averages over ranks, like torch DDP, needs dp)."""
    model: nn.Module
    grad_sync: object | None
    optimizer: torch.optim.Optimizer
    meter: ActivationMeter
    loss_scale: float = 1.0

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


def setup(cfg: Config, comm: Comm, **dp_options):
    """Data, model with the layout's strategies applied, optimizer."""
    data, model = build(cfg, comm.mesh.device)
    grad_sync = parallelize(model, comm, cfg.layout, **dp_options)
    return data, Setup(model, grad_sync, build_optimizer(model, cfg.train), ActivationMeter(model))


def train_step(s: Setup, data, step: int, cfg: Config, comm: Comm) -> float:
    """One optimizer step on the global batch of `step`; returns the global mean loss."""
    mesh, tr, lay = comm.mesh, cfg.train, cfg.layout
    set_lr(s.optimizer, lr_at(step, tr))
    local = tr.batch_size // mesh.size("dp")
    micro = local // lay.microbatches
    global_count = tr.batch_size * tokens_per_sample(cfg)
    total = torch.zeros((), device=mesh.device)
    for i in range(lay.microbatches):
        start = mesh.coord("dp") * local + i * micro
        inputs, targets = (t.to(mesh.device) for t in data.batch(step, tr.batch_size, slice(start, start + micro)))
        last = i == lay.microbatches - 1
        with (s.grad_sync.no_sync() if s.grad_sync and not last else nullcontext()):
            with s.meter:
                loss = loss_sum(s.model, inputs, targets) / global_count
            (loss * s.loss_scale if s.loss_scale != 1 else loss).backward()
        total += loss.detach()
    if s.grad_sync:
        s.grad_sync.finish_grad_sync()
    clip_grad_norm_(s.params, tr.clip, comm)
    s.optimizer.step()
    s.model.zero_grad(set_to_none=False)  # keep gradient buffers (DP buckets) in place
    comm.all_reduce(total, "dp", purpose=METRICS)
    return total.item()


def train(cfg: Config, comm: Comm, *, snapshot_steps=(), progress: str | None = None,
          step_log: StepLog | None = None, **dp_options) -> RunResult:
    mesh, tr = comm.mesh, cfg.train
    data, s = setup(cfg, comm, **dp_options)
    tokens_per_step = tr.batch_size * tokens_per_sample(cfg)
    bar = None
    if progress and mesh.is_main:
        from tqdm import tqdm
        bar = tqdm(total=tr.steps, desc=progress, file=sys.stderr, unit="step", dynamic_ncols=True)

    losses, times, comm_per_step, snapshots = [], [], {}, {}
    for step in range(tr.steps):
        sent_before = comm.totals()
        t0 = time.perf_counter()
        loss = train_step(s, data, step, cfg, comm)
        dt = time.perf_counter() - t0
        comm_per_step = {k: round(v - sent_before.get(k, 0.0)) for k, v in comm.totals().items()}
        losses.append(loss)
        times.append(dt)
        if step + 1 in snapshot_steps:
            snapshots[step + 1] = full_state_dict(s.model) if mesh.is_main else None
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
            bar.update()
        if step_log is not None:
            step_log.write({"step": step + 1, "loss": loss, "lr": lr_at(step, tr), "step_time_s": dt,
                            "tokens_per_s": tokens_per_step / dt})
    if bar is not None:
        bar.close()
    for axis in ("dp", "tp", "pp"):
        comm_per_step.setdefault(axis, 0)
    return RunResult(losses=losses, step_times=times, n_params=count_params(s.model),
                     model_state=model_state_bytes(s.model, s.optimizer), activation_bytes=s.meter.peak,
                     comm_per_step=comm_per_step, model=s.model, data=data, snapshots=snapshots)
