"""`meshtrain.verify`: a user's model, loss, optimizer and batches in a layout, checked
against one process — the same lockstep checks as `meshtrain verify` (`verifier.py`).

Every rank trains the layout on the batches. At the sampled steps (the first, one in the
middle, the last) the layout's full state before the step, its synchronised gradients
(before clipping) and its weights after are gathered to rank 0, and every rank's piece of
each tensor is compared with the full state. Rank 0 then runs the one-process reference on
its CPU: its own trajectory from `make_model()`, and from the layout's state before each
sampled step one step on the same batch with the same learning rates, and the batch's loss
evaluated after it (`job.evaluate`) in both. The verdict is
`verifier.compare`'s, with its tolerances, and every rank returns the same report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn

from meshtrain.job import Job, cross_entropy, parallelize
from meshtrain.mesh import Mesh
from meshtrain.verifier import LayoutRecorder, compare, lockstep_steps

# What the reference run takes from the layout's arguments: nothing that splits the model.
_LAYOUT_ONLY = ("zero", "sp", "tp_plan", "pipeline", "schedule", "chunks", "microbatches", "recompute", "precision",
                "grad_dtype", "wrap", "bucket_mb")


@dataclass
class VerifyReport:
    """`passed`: every lockstep check within tolerance; `worst`: the largest relative
    difference of each check, with where it was (`{"grad": (value, "step 1: fc.weight
    gradient"), ...}`; under bf16 only `loss_curve`, the loss curve against fp32 one
    process); `failures`: what failed, first first; `result`: every figure."""
    passed: bool
    worst: dict[str, tuple[float, str | None]]
    failures: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else f"FAIL ({self.failures[0]})"
        worst = ", ".join(f"{k} {v:.2e}" for k, (v, _) in self.worst.items())
        return f"{verdict}: worst relative differences {worst}"


def _unpack(batch) -> tuple:
    """(inputs, targets) from a pair, or (dict, None) from a batch dict."""
    if isinstance(batch, dict):
        return batch, None
    inputs, targets = batch
    return inputs, targets


def verify(make_model: Callable[[], nn.Module], batches: Iterable, *, optimizer, loss_fn=cross_entropy,
           mesh: Mesh | None = None, dp: int | None = None, tp: int = 1, pp: int = 1, seed: int = 0,
           **options) -> VerifyReport:
    """Collective: train `make_model()` on `batches` (each a global batch: (inputs, targets)
    or a dict) in a layout — `mesh` (or one `meshtrain.init(dp, tp, pp)` joins) and the
    `parallelize` arguments in `options` (zero, tp_plan, pipeline, microbatches, ...) —
    and check it against one process on rank 0's CPU. `make_model` is called after
    `torch.manual_seed(seed)` on every rank and for the reference."""
    if mesh is None:
        from meshtrain.session import init
        mesh = init(dp=dp, tp=tp, pp=pp, seed=seed)
    batches = [_unpack(b) for b in batches]
    if not batches:
        raise ValueError("batches: give at least one batch")
    sampled = lockstep_steps(len(batches))
    torch.manual_seed(seed)
    job = parallelize(make_model(), mesh, optimizer=optimizer, loss_fn=loss_fn, **options)
    layout = _record(job, batches, sampled)
    verdict = None
    if mesh.is_main:
        reference = _reference(make_model, batches, layout, seed, optimizer=optimizer, loss_fn=loss_fn,
                               **{k: v for k, v in options.items() if k not in _LAYOUT_ONLY})
        result = compare(layout, reference)
        if result["curve_only"]:  # low precision: the loss curve against fp32, no lockstep
            worst = {"loss_curve": (result["max_loss_rel_diff"], None)}
        else:
            worst = {k: (result[f"max_{k}_rel_diff"], result.get(f"worst_{k}")) for k in ("grad", "update", "step_loss",
                                                                                            "eval")}
        verdict = VerifyReport(result["passed"], worst, result["failures"], result)
    return mesh.comm.all_gather_object(verdict)[0]


def _record(job: Job, batches: list, sampled: list[int]) -> dict:
    """Collective: the layout's losses and, at each sampled step, what `meshtrain verify`
    records (`verifier.LayoutRecorder`) and the learning rates the step used (on rank 0)."""
    p, curve_only = job.parallel, job.options.precision != "fp32"
    recorder, losses = LayoutRecorder([] if curve_only else sampled, job.mesh.is_main), []
    for step, (inputs, targets) in enumerate(batches, start=1):
        recorder.before_step(p, step)
        loss = job.backward(inputs, targets)
        recorder.grads_ready(p, step)
        if step in recorder.steps:
            recorder.keep(step, lrs=[g["lr"] for g in job.optimizer.param_groups])
        job.update(loss)
        recorder.after_step(p, step, loss)
        if step in recorder.steps:  # the step's batch evaluated after it: `job.evaluate` in the layout
            recorder.keep(step, val=job.evaluate(inputs, targets))
        losses.append(loss)
    return {"losses": losses, "steps": recorder.records, "problems": recorder.problems, "curve_only": curve_only}


def _reference(make_model, batches: list, layout: dict, seed: int, **options) -> dict:
    """One process on the CPU: its own trajectory from the seed, and one lockstep step from
    the layout's state before each sampled step."""
    mesh = Mesh.single(torch.device("cpu"))
    mesh.seed = seed

    def fresh() -> Job:
        torch.manual_seed(seed)
        return parallelize(make_model().to("cpu"), mesh, **options)

    job, losses, trajectory = fresh(), [], {}
    for i, (inputs, targets) in enumerate(batches):
        losses.append(job.step(inputs, targets).loss)
        if i + 1 in layout["steps"]:
            trajectory[i + 1] = job.parallel.full_state_dict(with_optimizer=False)["model"]
    lockstep = {}
    for step, rec in sorted(layout["steps"].items()):
        job = fresh()
        job.parallel.load_full_state_dict(rec["pre"])
        job.steps = step - 1  # dropout masks are keyed by the step
        inputs, targets = batches[step - 1]
        loss = job.backward(inputs, targets)
        grads = job.parallel.full_grads()
        for group, lr in zip(job.optimizer.param_groups, rec["lrs"]):
            group["lr"] = lr
        job.update(loss)
        lockstep[step] = {"loss": loss, "grads": grads, "post": job.parallel.full_state_dict(with_optimizer=False)["model"],
                          "val": job.evaluate(inputs, targets)}
    return {"losses": losses, "trajectory": trajectory, "steps": lockstep}
