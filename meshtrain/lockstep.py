"""`meshtrain.verify`: a user's model, loss, optimizer and batches in a layout, checked
against one process — the same lockstep checks as `meshtrain verify` (`verifier.py`).

Every rank trains the layout on the batches. At the sampled steps (the first, one in the
middle, the last) the layout's full state before the step, its synchronised gradients
(before clipping) and its weights after are gathered to rank 0, and every rank's piece of
each tensor is compared with the full state. Rank 0 then runs the one-process reference on
its CPU: its own trajectory from `make_model()`, and from the layout's state before each
sampled step one step on the same batch with the same learning rates (and rank 0's random-number
state, for a model that draws from torch's global generator), and the batch's loss
evaluated after it (`job.evaluate`) in both. The verdict is
`verifier.compare`'s, with its tolerances, and every rank returns the same report.

With `resume_at=K` the layout saves after step K (into a temporary folder), a second job
(in `resume_layout`, on the same processes) loads it and trains on batches K+1..N, and
the whole run is compared with one process trained straight through: the lockstep steps
then include K and K+1, and the state after the load must be the state saved, bit for bit
(`verifier.compare`)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn as nn

from meshtrain.job import Job, parallelize
from meshtrain.loss_terms import cross_entropy
from meshtrain.parallel.options import parse_layout  # a layout written as text (the grammar of verify --resume-layout)
from meshtrain.mesh import Mesh
from meshtrain.verifier import LayoutRecorder, compare, join_parts, lockstep_steps, same_ranks, shared_temp_folder
from meshtrain.session import init

# What the reference run takes from the layout's arguments: nothing that splits the model.
_LAYOUT_ONLY = ("zero", "sp", "tp_plan", "pipeline", "schedule", "chunks", "microbatches", "recompute", "precision",
                "grad_dtype", "wrap", "bucket_mb", "compile", "compile_backend")
# What a resume layout keeps from the first layout's arguments when it does not name them: how
# the model is split (the plans), not whether it is.
_MODEL_PLANS = ("tp_plan", "pipeline", "wrap")
# ... and the precision, which the one-process reference trains in throughout (as the command
# line's `--resume-layout` inherits it: `cli.resume_at.RESUME_KEEPS`).
_KEPT_BY_RESUME = (*_MODEL_PLANS, "precision")
_MESH_KEYS = ("dp", "tp", "pp", "cp", "ep")


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
           resume_at: int | None = None, resume_layout: dict | str | None = None, **options) -> VerifyReport:
    """Collective: train `make_model()` on `batches` (each a global batch: (inputs, targets)
    or a dict) in a layout — `mesh` (or one `meshtrain.init(dp, tp, pp)` joins) and the
    `parallelize` arguments in `options` (zero, tp_plan, pipeline, microbatches, ...) —
    and check it against one process on rank 0's CPU. `make_model` is called after
    `torch.manual_seed(seed)` on every rank and for the reference.

    `resume_at=K`: save after step K and go on in a second job that loads it, in
    `resume_layout` — a dict of `init`'s sizes (dp, tp, pp, cp) and `parallelize`'s layout
    arguments, or the command line's string ("tp=2 zero=1 sp"); what it does not name takes
    its default, except the model's plans (tp_plan, pipeline, wrap), kept from `options`;
    an unset dp fills the world, which must be this one's — or the same layout when None."""
    if mesh is None:
        mesh = init(dp=dp, tp=tp, pp=pp, seed=seed)
    batches = [_unpack(b) for b in batches]
    if not batches:
        raise ValueError("batches: give at least one batch")
    if resume_at is not None and not (isinstance(resume_at, int) and 1 <= resume_at < len(batches)):
        raise ValueError(f"resume_at={resume_at!r}: save after a step from 1 to {len(batches) - 1} ({len(batches)} "
                         f"batches), so that steps are left to run resumed")
    if resume_layout is not None and resume_at is None:
        raise ValueError("resume_layout: it names the layout a resume continues in; give resume_at too")
    sampled = lockstep_steps(len(batches), resume_at)
    torch.manual_seed(seed)
    job = parallelize(make_model(), mesh, optimizer=optimizer, loss_fn=loss_fn, **options)
    if resume_at is None:
        layout = _record(job, batches, sampled)
    else:
        layout = _record_resumed(job, make_model, batches, sampled, resume_at, resume_layout, seed=seed,
                                 optimizer=optimizer, loss_fn=loss_fn, options=options)
    verdict = None
    if mesh.is_main:
        same = {k: v for k, v in options.items() if k not in _LAYOUT_ONLY}
        if options.get("fp8") is not None:  # fp8's scales are each micro-batch's: the layout's micro-batches
            same["microbatches"] = mesh.batch_dp * options.get("microbatches", 1)
        reference = _reference(make_model, batches, layout, seed, optimizer=optimizer, loss_fn=loss_fn, **same)
        result = compare(layout, reference)
        if result["curve_only"]:  # low precision: the loss curve against fp32, no lockstep
            worst = {"loss_curve": (result["max_loss_rel_diff"], None)}
        else:
            worst = {k: (result[f"max_{k}_rel_diff"], result.get(f"worst_{k}")) for k in ("grad", "update", "step_loss",
                                                                                            "eval")}
        verdict = VerifyReport(result["passed"], worst, result["failures"], result)
    return mesh.comm.all_gather_object(verdict)[0]


def _record(job: Job, batches: list, sampled: list[int], *, first_step: int = 1, resume_at: int | None = None) -> dict:
    """Collective: the layout's losses and, at each sampled step, what `meshtrain verify`
    records (`verifier.LayoutRecorder`), the learning rates the step used and the random-number
    state it began with (on rank 0). `batches` are steps `first_step`, `first_step` + 1, ..."""
    p, mesh, fp8 = job.parallel, job.mesh, job.options.fp8 is not None
    # bf16, and fp8 over sums in another order than one process's (tp, cp), by the loss curve (`verifier.curve_only`)
    curve_only = job.options.precision != "fp32" or (fp8 and (mesh.size("tp") > 1 or mesh.size("cp") > 1))
    recorder = LayoutRecorder([] if curve_only else sampled, mesh.is_main, resume_at=resume_at,
                              audit_steps=sampled if fp8 else ())
    losses = []
    for step, (inputs, targets) in enumerate(batches, start=first_step):
        recorder.before_step(p, step)
        if step in recorder.steps:
            recorder.keep(step, rng_state=torch.get_rng_state())
        loss = job.backward(inputs, targets)
        recorder.grads_ready(p, step)
        if step in recorder.steps:
            recorder.keep(step, lrs=[g["lr"] for g in job.optimizer.param_groups])
        out = job.update(loss)
        recorder.grad_norm(step, out.grad_norm)
        recorder.after_step(p, step, loss)
        if step in recorder.steps:  # the step's batch evaluated after it: `job.evaluate` in the layout
            recorder.keep(step, val=job.evaluate(inputs, targets))
        losses.append(loss)
    return {"losses": losses, "steps": recorder.records, "problems": recorder.problems, "curve_only": curve_only}


def _record_resumed(job: Job, make_model, batches: list, sampled: list[int], at: int, resume_layout, *, seed: int,
                    optimizer, loss_fn, options: dict) -> dict | None:
    """Collective: steps 1..`at` in `job`, saved into a temporary folder; a second job in
    `resume_layout` loads it and takes the rest; rank 0 returns the joined record."""
    mesh = job.mesh
    folder = shared_temp_folder(mesh.comm)
    try:
        first = _record(job, batches[:at], sampled, resume_at=at)
        job.save(Path(folder, f"step-{at}"))
        mesh_b, options_b, described = _second_layout(mesh, options, resume_layout, seed)
        torch.manual_seed(seed)
        resumed_job = parallelize(make_model(), mesh_b, optimizer=optimizer, loss_fn=loss_fn, **options_b)
        resumed_job.load(Path(folder, f"step-{at}"))
        resumed = _record(resumed_job, batches[at:], sampled, first_step=at + 1, resume_at=at)
    finally:
        if mesh.is_main:
            shutil.rmtree(folder, ignore_errors=True)
    if not mesh.is_main:
        return None
    return join_parts(first, resumed, at, described, same_ranks(mesh.sizes, mesh_b.sizes))


def _second_layout(mesh: Mesh, options: dict, resume_layout, seed: int) -> tuple[Mesh, dict, dict | None]:
    """The mesh and `parallelize` arguments `resume_layout` names (see `verify`), and how to
    report it; one line (ValueError) for an unknown key or a world it does not fill."""
    if resume_layout is None:
        return mesh, dict(options), None
    if isinstance(resume_layout, str):
        given = parse_layout(resume_layout, flag="resume_layout")
        if isinstance(given.get("stage_layers"), str):
            given["stage_layers"] = [int(n) for n in given["stage_layers"].split(",")]
    elif isinstance(resume_layout, dict):
        given = dict(resume_layout)
    else:
        raise TypeError(f"resume_layout: pass a dict of layout arguments or a string such as \"tp=2 zero=1\", not "
                        f"{type(resume_layout).__name__}")
    sizes = {k: given.pop(k) for k in _MESH_KEYS if k in given}
    kept = {k: v for k, v in options.items() if k not in _LAYOUT_ONLY or k in _KEPT_BY_RESUME}
    if all(sizes.get(k, 1) == mesh.size(k) for k in ("tp", "pp", "cp", "ep")) and sizes.get("dp") in (None, mesh.batch_dp):
        mesh_b = mesh
    else:
        try:
            mesh_b = init(dp=sizes.get("dp"), tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1),
                          ep=sizes.get("ep", 1), device=mesh.device.type, seed=seed)
        except ValueError as e:
            raise ValueError(f"resume_layout: {e} (the resumed job runs in these processes)") from None
    described = {"dp": mesh_b.batch_dp, "tp": mesh_b.size("tp"), "pp": mesh_b.size("pp"), "cp": mesh_b.cp,
                 "ep": mesh_b.size("ep"), "precision": kept.get("precision", "fp32"), **given}
    return mesh_b, {**kept, **given}, described


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
        if "rng_state" in rec:  # a model drawing from torch's generator draws what the layout's rank 0 drew
            torch.set_rng_state(rec["rng_state"])
        inputs, targets = batches[step - 1]
        loss = job.backward(inputs, targets)
        grads = job.parallel.full_grads()
        for group, lr in zip(job.optimizer.param_groups, rec["lrs"]):
            group["lr"] = lr
        out = job.update(loss)
        lockstep[step] = {"loss": loss, "grads": grads, "grad_norm": out.grad_norm, "post": job.parallel.full_state_dict(with_optimizer=False)["model"],
                          "val": job.evaluate(inputs, targets)}
    return {"losses": losses, "trajectory": trajectory, "steps": lockstep}
