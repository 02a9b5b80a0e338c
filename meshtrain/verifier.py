"""`meshtrain verify`: the contract that every layout trains the same model as one process.

**Lockstep, so nothing drifts.** At a few sampled steps (the first, one in the middle, the
last) the layout records its full state before the step (weights and optimizer moments,
through the collective `full_state_dict`), its synchronised gradients before clipping, and
its weights after the step. The one-process reference then starts from that very state and
takes that one step on the same global batch. Per tensor, ‖a − b‖/‖b‖ of the gradients
(`max_grad_rel_diff`; see GRAD_FLOOR for gradients that nearly cancel out) and of the
step's change of the weights (`max_update_rel_diff`), and the step's loss, must be within
the tolerances below. Every sampled step is checked as
tightly as the first, however long the run: rounding differences have no steps to grow over.
Gradients are compared directly because AdamW hides a gradient's scale (its first update is
about lr·sign(g)): a gradient halved by a double average shows as 0.5 here.

**Every rank is checked.** At each sampled step every rank's own piece of every parameter
and gradient is fingerprinted and compared with that part of the full state: replicas must
be bit-identical, and each shard must be what the full state holds where it lives.

**Trajectories, for information.** The reference also trains on its own from the seed; the
per-step losses of both runs are printed side by side, and `max_loss_rel_diff` and
`max_param_rel_diff` (weights after the sampled steps) are reported against DRIFT_TOLERANCE.
Under Adam two correct runs drift apart by rounding as steps go by, so drift alone does not
fail a layout; the lockstep checks do.

The tolerances were set from what correct code measures (README, "Verify"), with a margin."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from meshtrain.comm import Comm
from meshtrain.cli.config import Config, LayoutConfig
from meshtrain.mesh import Mesh
from meshtrain.optim import sum_of_squares
from meshtrain.parallel.compile import compile_stats
from meshtrain.parallel.fp8 import audit_findings, start_audit
from meshtrain.parallel.state import digest
from meshtrain.train import StepObserver, held_out_loss, setup, train, train_step
from meshtrain.checkpoint.folders import step_dir

# Relative differences allowed at a lockstep step (fp32), from what correct layouts measure
# (data, tensor and sequence parallelism, gpt-test and gpt-small): gradients at most 7.9e-7
# (with the floor below), step losses 2.1e-7, updates 1.9e-4 (Adam divides each gradient
# element by its own magnitude, so elements near its epsilon pass rounding on at full
# weight). Every mutant in the tests is at 2.2e-3 or more in the check that catches it.
GRAD_TOLERANCE = 1e-5
# A gradient that nearly cancels out (the last blocks' query and key weights hold 1e-4 of an
# even share of the model's gradient norm early on: softmax's Jacobian subtracts nearly equal
# terms) keeps the rounding of the activations it was computed from, relative to those, not
# to itself. Tensor parallelism reorders the sums of those activations, and such tensors
# then measure up to 1.1e-4 apart relative to themselves (gpt-small, tp=2, 30 steps). So the
# denominator is the tensor's own gradient norm, but at least GRAD_FLOOR of its share
# ‖g‖·√(n_t/N) of the whole gradient norm. A tensor whose gradient is wholly wrong still
# shows unless its gradient is below 1e-7 of its share; the update check, which Adam makes
# insensitive to a gradient's size, also catches a wrong direction in any tensor.
GRAD_FLOOR = 1e-2
UPDATE_TOLERANCE = 1e-3
STEP_LOSS_TOLERANCE = 1e-5
# The held-out loss (`job.evaluate`) after a lockstep step, against the reference's from the
# same state: a forward only, so as tight as a step's loss.
EVAL_TOLERANCE = 1e-5
# Mixed precision (bf16 compute) cannot match fp32 in lockstep: its loss curve is compared
# with the fp32 one-process run's, step by step, and must stay within this relative
# difference (the issue's 2 %; README, "Mixed precision", has what layouts measure).
CURVE_TOLERANCE = 0.02
# After a resume the full state (weights, optimizer state) must be what was saved, bit for bit:
# a checkpoint copies values, in any layout, and computes nothing.
RESUME_TOLERANCE = 0.0
# Trajectory drift that is reported, not failed: two correct runs part by rounding under Adam
# (gpt-small, dp=2, 100 steps: weights 0.25 apart in the worst tensor, losses 3e-3).
DRIFT_TOLERANCE = 1e-3


def lockstep_steps(steps: int, resume_at: int | None = None) -> list[int]:
    """The sampled steps (1-based): the first, one in the middle, the last; and with a
    resume after step K, K and K + 1 (the last step saved and the first resumed)."""
    return sorted({1, (steps + 1) // 2, steps} | ({resume_at, resume_at + 1} if resume_at else set()))


def curve_only(cfg: Config) -> bool:
    """Low-precision compute is judged by its loss curve, not in lockstep: bf16; and fp8 where
    the layout sums a micro-batch's products in another order than one process (tensor and
    context parallelism, a GPU's fp8 matmuls against the CPU's emulation), for fp8's rounding
    turns those last-bit differences into whole steps of an element (docs/verify.md). Its
    scales are audited there instead."""
    lay = cfg.layout
    return lay.precision != "fp32" or (lay.fp8 != "none" and (lay.tp > 1 or lay.cp > 1 or _on_gpu(cfg)))


def _on_gpu(cfg: Config) -> bool:
    """The layout runs on a GPU: its fp8 matmuls (`torch._scaled_mm`) sum in their own order,
    not the CPU reference's emulation's."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())


def reference_config(cfg: Config) -> Config:
    """One process, one micro-batch, on the CPU: the same model, seed and global batch — in
    the run's micro-batches where its loss is defined per forward (a pooled balancing loss:
    a plain loop with gradient accumulation pools each micro-batch) or its scales are
    (--fp8: each data-parallel rank's micro-batches, with the same linear layers in fp8)."""
    ref = copy.deepcopy(cfg)
    lay = cfg.layout
    per_forward = cfg.model.moe_balance == "pooled"
    # fp8's scales are each micro-batch's own: the reference runs the layout's micro-batches,
    # every data-parallel rank's in turn (the same rows each), with the same conversion.
    microbatches = lay.microbatches * (lay.dp if lay.fp8 != "none" else 1) if lay.fp8 != "none" or per_forward else 1
    ref.layout = LayoutConfig(dp=1, tp=1, pp=1, microbatches=microbatches, bucket_mb=lay.bucket_mb, fp8=lay.fp8,
                              fp8_emulate=lay.fp8 != "none", fp8_min_features=lay.fp8_min_features)  # a CPU: emulated
    ref.train.device = "cpu"
    return ref


class LayoutRecorder(StepObserver):
    """At each sampled step: the full state before, the synchronised gradients, the weights
    after (kept on rank 0 only), and every rank's pieces checked against them."""

    def __init__(self, steps: list[int], is_main: bool, cfg: Config | None = None, resume_at: int | None = None,
                 audit_steps: list[int] = ()):
        self.steps, self.is_main, self.records, self.problems = set(steps), is_main, {}, []
        self.audit_steps = set(audit_steps)  # fp8: every scale checked against its whole tensor's
        self.cfg = cfg  # the run's configuration, for its held-out batch
        # A run saved after step K and resumed: its full state (optimizer included) and every
        # rank's random-number state after step K, and again before step K + 1 (after the load).
        self.resume_at = resume_at

    def keep(self, step: int, **parts) -> None:
        if self.is_main:
            self.records.setdefault(step, {}).update(parts)

    def before_step(self, p, step):
        if step in self.audit_steps:
            start_audit(p.module)
        pre = p.full_state_dict() if step in self.steps else None
        if pre is not None:
            self.keep(step, pre=pre)
        if self.resume_at is not None and step == self.resume_at + 1:
            self.keep(step, restored=pre if pre is not None else p.full_state_dict(), rng_digests=rng_digests(p.comm))

    def grads_ready(self, p, step):
        if step in self.steps:
            grads = p.full_grads()
            self.keep(step, grads=grads)
            self.problems += _check_pieces(p, grads, "gradient", step, use_grad=True)

    def grad_norm(self, step, norm):
        if step in self.steps:
            self.keep(step, grad_norm=norm)

    def after_step(self, p, step, loss):
        if step in self.audit_steps:
            self.problems += [(step, f"step {step}: rank {rank}: {name}'s {cast} cast did not scale by the whole "
                                     f"tensor's amax (relative difference {diff:.2e})")
                              for rank, name, cast, diff in audit_findings(p.module, p.comm)]
        if step in self.steps:
            post = p.full_state_dict(with_optimizer=False)["model"]
            self.keep(step, post=post, loss=loss)
            self.problems += _check_pieces(p, post, "weights", step, use_grad=False)
        if step == self.resume_at:
            self.keep(step, saved=p.full_state_dict(), rng_digests=rng_digests(p.comm))

    def held_out(self, job, data, step):
        if step in self.steps and self.cfg is not None and hasattr(data, "val_batch"):
            self.keep(step, val=held_out_loss(job, data, self.cfg))


def rng_digests(comm: Comm) -> list[str]:
    """Collective: a fingerprint of every rank's torch random-number state (CPU, and CUDA's
    where it is in use), in rank order."""
    state = torch.get_rng_state().numpy().tobytes()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state += torch.cuda.get_rng_state().numpy().tobytes()
    mine = hashlib.sha256(state).hexdigest()[:16]
    return comm.all_gather_object(mine) if comm.mesh.world_size > 1 else [mine]


def _check_pieces(p, full: dict[str, torch.Tensor], what: str, step: int,
                  use_grad: bool) -> list[tuple[int, str]]:
    """Collective. Every rank fingerprints its piece of each tensor; rank 0 compares each
    fingerprint with that part of the full tensor and returns what differs."""
    mine = []
    for piece in p.local_pieces():
        local = piece.grad if use_grad else piece.value
        if local is not None:
            mine.append((piece.name, piece.where, digest(local)))
    every = p.comm.all_gather_object(mine)
    if not p.comm.mesh.is_main:
        return []
    problems, expected = [], {}
    for rank, pieces in enumerate(every):
        for name, where, d in pieces:
            if name not in full:
                problems.append((step, f"step {step}: rank {rank} holds {name} ({what}), which the full state lacks"))
                continue
            key = (name, repr(where))
            if key not in expected:
                expected[key] = digest(where.take(full[name]))
            if d != expected[key]:
                problems.append((step, f"step {step}: rank {rank}'s {name} ({what}) differs from the full "
                                       f"state (replicas must be bit-identical, shards equal where they live)"))
    return problems


def record(cfg: Config, comm: Comm, label: str, *, resume_at: int | None = None,
           part: str | None = None) -> dict | None:
    """Run the layout (every rank calls this); rank 0 returns its losses and, per sampled
    step, the full state before, the gradients, the weights after, and the problems found.
    With `resume_at` K, one part of a run resumed after step K (`part_config` makes its
    configuration): "first" runs steps 1..K and saves; "resumed" loads and runs K+1..N."""
    sampled = [] if curve_only(cfg) else lockstep_steps(cfg.train.steps, resume_at)
    audited = lockstep_steps(cfg.train.steps, resume_at) if cfg.layout.fp8 != "none" else []
    recorder = LayoutRecorder(sampled, comm.mesh.is_main, cfg, resume_at=resume_at, audit_steps=audited)
    if part is None:  # verify writes nothing into --out (which `train` claims): a folder of its own
        folder = shared_temp_folder(comm, prefix="meshtrain-verify-")
        try:
            result = train(_with_out(cfg, folder), comm, observer=recorder, progress=label, measure_memory=False)
        finally:
            if comm.mesh.is_main:
                shutil.rmtree(folder, ignore_errors=True)
    else:
        if comm.mesh.is_main:
            Path(cfg.train.out).mkdir(parents=True, exist_ok=True)  # the part's own folder, in the temporary one
        result = train(cfg, comm, observer=recorder, progress=label, stop_after=resume_at if part == FIRST else None,
                       measure_memory=False)
    if not comm.mesh.is_main:
        return None
    return {"losses": result.losses, "steps": recorder.records, "problems": recorder.problems,
            "curve_only": curve_only(cfg), "compiled": compile_stats() if result.parallel.compiled else None}


def _with_out(cfg: Config, folder) -> Config:
    out = copy.deepcopy(cfg)
    out.train.out = str(folder)
    return out


# ---- verify --resume-at K: saved after step K, resumed (in another layout) ------------------

FIRST, RESUMED = "first", "resumed"


def part_config(cfg: Config, second: Config, part: str, folder: Path) -> Config:
    """The configuration of one part of `verify --resume-at K`: the first (the layout `cfg`,
    steps 1..K, saved after K into `folder`/first) or the resumed (`second`, from that
    checkpoint, into `folder`/resumed). Both keep --steps N, so the schedule is the
    uninterrupted run's."""
    at = cfg.train.resume_at
    out = copy.deepcopy(cfg if part == FIRST else second)
    out.train.out, out.train.keep, out.train.resume, out.train.resume_from = str(Path(folder, part)), None, False, None
    out.train.save_every = at if part == FIRST else None
    if part == RESUMED:
        out.train.resume_from = str(step_dir(Path(folder, FIRST), at))
    return out


def same_ranks(first: dict[str, int], second: dict[str, int]) -> bool:
    """Whether two layouts' meshes are alike (every axis the same size): a checkpoint gives
    each rank its own random-number state back only then."""
    axes = ("pp", "dp", "cp", "tp", "ep")
    return {a: first.get(a, 1) for a in axes} == {a: second.get(a, 1) for a in axes}


def mesh_sizes(lay: LayoutConfig) -> dict[str, int]:
    return {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep}


def join_parts(first: dict, resumed: dict, at: int, layout, ranks_alike: bool) -> dict:
    """One record of a run saved after step `at` and resumed: both parts' losses and
    sampled steps, and what the resume check compares (`compare`): the full state and the
    random-number states after step `at`, and after the load (those only where the same
    ranks resumed: `ranks_alike`). `layout`: what to report as the resumed layout."""
    steps = {**first["steps"], **resumed["steps"]}
    saved, restored = steps[at].pop("saved"), steps[at + 1].pop("restored")
    rng_saved, rng_restored = steps[at].pop("rng_digests"), steps[at + 1].pop("rng_digests")
    steps = {step: rec for step, rec in steps.items() if rec}  # not lockstep-checked (low precision): no step record
    return {"losses": first["losses"] + resumed["losses"], "steps": steps,
            "problems": first["problems"] + resumed["problems"],
            "curve_only": first["curve_only"] or resumed["curve_only"],  # a part judged by its curve: the run too
            "compiled": resumed.get("compiled") or first.get("compiled"),  # counted in these processes: both parts
            "resume": {"at": at, "layout": layout, "saved": saved, "restored": restored,
                       "rng": (rng_saved, rng_restored) if ranks_alike else None}}


def shared_temp_folder(comm: Comm, prefix: str = "meshtrain-verify-resume-") -> Path:
    """Collective: a new temporary folder made by rank 0, its name given to every rank
    (under a launcher across hosts, TMPDIR must name a shared filesystem)."""
    name = tempfile.mkdtemp(prefix=prefix) if comm.mesh.is_main else None
    return Path(comm.all_gather_object(name)[0] if comm.mesh.world_size > 1 else name)


def record_resumed(cfg: Config, second: Config, comm: Comm, label: str) -> dict | None:
    """Collective: both parts of `verify --resume-at K` in these processes (under a launcher,
    or one process): the first layout runs steps 1..K and saves into a temporary folder, the
    second (`second`, on a mesh of the same world) loads it and runs K+1..N; rank 0 returns
    the joined record (`join_parts`)."""
    at = cfg.train.resume_at
    folder = shared_temp_folder(comm)
    try:
        first = record(part_config(cfg, second, FIRST, folder), comm, f"{label}, steps 1-{at}", resume_at=at,
                       part=FIRST)
        alike = same_ranks(mesh_sizes(cfg.layout), mesh_sizes(second.layout))
        comm_b = comm if alike else Comm(mesh_like(second.layout, comm.mesh))
        resumed = record(part_config(cfg, second, RESUMED, folder), comm_b, f"{label}, resumed", resume_at=at,
                         part=RESUMED)
    finally:
        if comm.mesh.is_main:
            shutil.rmtree(folder, ignore_errors=True)
    if not comm.mesh.is_main:
        return None
    return join_parts(first, resumed, at, second.layout.summary(), alike)


def mesh_like(lay: LayoutConfig, mesh: Mesh) -> Mesh:
    """Collective: a mesh of `lay`'s sizes over the processes of `mesh` (the one-process
    mesh when there is no process group)."""
    if mesh.world_size == 1 and lay.world_size == 1:
        return Mesh.single(mesh.device)
    return Mesh.build(lay.pp, lay.dp, lay.tp, mesh.device, cp=lay.cp, ep=lay.ep)


class _TrajectoryRecorder(StepObserver):
    def __init__(self, steps):
        self.steps, self.params = set(steps), {}

    def after_step(self, p, step, loss):
        if step in self.steps:
            self.params[step] = p.full_state_dict(with_optimizer=False)["model"]


class _GradRecorder(StepObserver):
    def grads_ready(self, p, step):
        self.grads = p.full_grads()


def reference_trajectory(cfg: Config, sampled: list[int]) -> dict:
    """The one-process run from the seed on the CPU: its losses and its weights after each
    sampled step — the same for every layout verified against `cfg` and these steps."""
    ref = reference_config(cfg)
    comm = Comm(Mesh.single(torch.device("cpu")))
    trajectory = _TrajectoryRecorder(sampled)
    folder = tempfile.mkdtemp(prefix="meshtrain-verify-reference-")  # not --out, which `train` claims
    try:
        losses = train(_with_out(ref, folder), comm, observer=trajectory, progress="reference",
                       measure_memory=False).losses
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"losses": losses, "trajectory": trajectory.params}


def run_reference(cfg: Config, layout: dict, trajectory: dict | None = None) -> dict:
    """The one-process reference on the CPU: its own trajectory from the seed (or the
    `reference_trajectory` given, computed once for several layouts), then one lockstep
    step from the layout's state before each sampled step."""
    ref = reference_config(cfg)
    comm = Comm(Mesh.single(torch.device("cpu")))
    sampled = sorted(layout["steps"])
    if trajectory is None:
        trajectory = reference_trajectory(cfg, sampled)
    data, job = setup(ref, comm, measure_memory=False)
    lockstep = {}
    for step in sampled:
        job.parallel.load_full_state_dict(layout["steps"][step]["pre"])
        grads = _GradRecorder()
        out = train_step(job, data, step - 1, ref, observer=grads)
        lockstep[step] = {"loss": out.loss, "grads": grads.grads, "grad_norm": out.grad_norm,
                          "post": job.parallel.full_state_dict(with_optimizer=False)["model"]}
        if "val" in layout["steps"][step]:
            lockstep[step]["val"] = held_out_loss(job, data, ref)
    return {**trajectory, "steps": lockstep}


def against_reference(cfg: Config, layout: dict, json_mode: bool) -> int:
    """Run the reference here, compare, report; returns the exit code."""
    return report(cfg, compare(layout, run_reference(cfg, layout)), json_mode)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def _floored_rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), floor, 1e-30)


def _grad_floors(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """GRAD_FLOOR of each tensor's even share of the whole gradient norm, ‖g‖·√(n_t/N) (the
    norm summed as clipping's is: `optim.sum_of_squares`)."""
    total = sum(g.numel() for g in grads.values())
    norm = math.sqrt(sum_of_squares(grads.values(), torch.device("cpu")).item())
    return {n: GRAD_FLOOR * norm * math.sqrt(g.numel() / total) for n, g in grads.items()}


def _rel_scalar(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def _same_names(a: dict, b: dict, what: str, step: int) -> str | None:
    if a.keys() != b.keys():
        return f"step {step}: the {what} have different names: {sorted(set(a) ^ set(b))[:5]}"
    for name in b:
        if a[name].shape != b[name].shape:
            return f"step {step}: {name} ({what}) has shape {tuple(a[name].shape)}, not {tuple(b[name].shape)}"
    return None


def compare(layout: dict, reference: dict) -> dict:
    """The verdict: lockstep gradients, updates and losses within tolerance at every
    sampled step, and no rank's piece different from the full state. The first failure is
    named (step, then tensor in model order); trajectory drift is reported alongside."""
    worst = {kind: (0.0, None) for kind in ("grad", "plain_grad", "update", "step_loss", "eval", "param", "resume",
                                            "grad_norm")}
    failures = list(layout["problems"])
    by_gradient: set[str] = set()  # tensors whose update was not judged: their gradient is below the floor

    def note(kind: str, value: float, step: int, where: str, tolerance: float | None):
        if value >= worst[kind][0]:
            worst[kind] = (value, where)
        if tolerance is not None and value > tolerance:
            failures.append((step, f"{where}: relative difference {value:.2e} > {tolerance:g}"))

    resume = layout.get("resume")
    if resume is not None:  # before step K + 1's lockstep checks: a bad resume is the cause of what follows
        failures += _check_resume(resume, note)
    for step in sorted(reference["steps"]):
        lay, ref = layout["steps"][step], reference["steps"][step]
        mismatch = (_same_names(lay["grads"], ref["grads"], "gradients", step)
                    or _same_names(lay["post"], ref["post"], "weights", step))
        if mismatch:
            failures.append((step, mismatch))
            continue
        pre, floors = lay["pre"]["model"], _grad_floors(ref["grads"])
        for name in ref["post"]:  # in model order: the first bad tensor is named first
            below_floor = False
            if name in ref["grads"]:
                note("grad", _floored_rel(lay["grads"][name], ref["grads"][name], floors[name]), step,
                     f"step {step}: {name} gradient", GRAD_TOLERANCE)
                note("plain_grad", _rel(lay["grads"][name], ref["grads"][name]), step,
                     f"step {step}: {name} gradient", None)
                below_floor = ref["grads"][name].double().norm().item() < floors[name]
            # A gradient below the floor (zero up to rounding: a key bias under softmax) is
            # judged by the gradient check alone: Adam would magnify its rounding to a full step.
            if below_floor:
                by_gradient.add(name)
            else:
                note("update", _rel(lay["post"][name] - pre[name], ref["post"][name] - pre[name]), step,
                     f"step {step}: {name} update", UPDATE_TOLERANCE)
        note("step_loss", _rel_scalar(lay["loss"], ref["loss"]), step, f"step {step}: loss", STEP_LOSS_TOLERANCE)
        if "grad_norm" in lay and "grad_norm" in ref:  # what clipping scales by: each gradient counted once
            note("grad_norm", _rel_scalar(lay["grad_norm"], ref["grad_norm"]), step, f"step {step}: gradient norm "
                 f"{lay['grad_norm']:.6g} vs {ref['grad_norm']:.6g}", GRAD_TOLERANCE)
        if "val" in lay and "val" in ref:
            note("eval", _rel_scalar(lay["val"], ref["val"]), step, f"step {step}: held-out loss after the step "
                 f"(job.evaluate) {lay['val']:.6f} vs {ref['val']:.6f}", EVAL_TOLERANCE)
        for name, ref_t in reference["trajectory"].get(step, {}).items():
            if name in lay["post"] and lay["post"][name].shape == ref_t.shape:
                note("param", _rel(lay["post"][name], ref_t), step, f"{name} after step {step}", None)
    loss_diffs = [_rel_scalar(a, b) for a, b in zip(layout["losses"], reference["losses"])]
    if layout.get("curve_only"):
        failures += [(i + 1, f"step {i + 1}: loss {layout['losses'][i]:.6f} vs fp32 {reference['losses'][i]:.6f}: "
                             f"relative difference {d:.2e} > {CURVE_TOLERANCE:g}")
                     for i, d in enumerate(loss_diffs) if d > CURVE_TOLERANCE]
    failures = [text for _, text in sorted(failures, key=lambda f: f[0])]  # by step; stable within one
    return {
        "lockstep_steps": sorted(reference["steps"]),
        "max_grad_rel_diff": worst["grad"][0], "worst_grad": worst["grad"][1],
        "max_grad_plain_rel_diff": worst["plain_grad"][0], "worst_plain_grad": worst["plain_grad"][1],
        "max_update_rel_diff": worst["update"][0], "worst_update": worst["update"][1],
        "judged_by_gradient": sorted(by_gradient),
        "max_step_loss_rel_diff": worst["step_loss"][0], "max_eval_rel_diff": worst["eval"][0],
        "max_grad_norm_rel_diff": worst["grad_norm"][0],
        "max_loss_rel_diff": max(loss_diffs), "max_param_rel_diff": worst["param"][0], "worst_param": worst["param"][1],
        "drifted": max(loss_diffs) > DRIFT_TOLERANCE or worst["param"][0] > DRIFT_TOLERANCE,
        "tolerances": {"grad": GRAD_TOLERANCE, "grad_floor": GRAD_FLOOR, "update": UPDATE_TOLERANCE, "step_loss": STEP_LOSS_TOLERANCE,
                       "eval": EVAL_TOLERANCE,
                       "drift": DRIFT_TOLERANCE, "curve": CURVE_TOLERANCE, "resume": RESUME_TOLERANCE},
        "curve_only": bool(layout.get("curve_only")),
        "resume_at": resume["at"] if resume else None, "resume_layout": resume["layout"] if resume else None,
        "max_resume_rel_diff": worst["resume"][0] if resume else None,
        "worst_resume": worst["resume"][1] if worst["resume"][0] else None,
        "resume_rng_checked": bool(resume and resume["rng"] is not None),
        "losses": {"layout": layout["losses"], "reference": reference["losses"]}, "loss_rel_diffs": loss_diffs,
        "first_failure": failures[0] if failures else None, "failures": failures[:20],
        "passed": not failures,
        "compile": layout.get("compiled"),  # rank 0's graphs and graph breaks, when the layout was compiled
    }


def _state_entries(state: dict) -> dict[str, torch.Tensor]:
    """A full state's tensors by what to call them: "NAME (weights)", "NAME (optimizer KEY)"."""
    entries = {f"{name} (weights)": t for name, t in state["model"].items()}
    for name, keys in state.get("optim", {}).items():
        entries.update({f"{name} (optimizer {key})": t for key, t in keys.items() if torch.is_tensor(t)})
    return entries


def _check_resume(resume: dict, note) -> list[tuple[int, str]]:
    """The state after the resume against the state saved after step K: every tensor within
    RESUME_TOLERANCE (`note`, which fails it), and each rank's random-number state where the
    same ranks resumed. Returns the failures `note` does not record."""
    at, failures = resume["at"], []
    saved, restored = _state_entries(resume["saved"]), _state_entries(resume["restored"])
    if saved.keys() != restored.keys():
        odd = sorted(set(saved) ^ set(restored))
        failures.append((at + 1, f"step {at + 1}: after the resume the state has other tensors than the one saved "
                                 f"after step {at}: {odd[:5]}"))
    for what in [w for w in saved if w in restored]:  # in model order
        a, b = restored[what], saved[what]
        if a.shape != b.shape:
            failures.append((at + 1, f"step {at + 1}: {what} is {tuple(a.shape)} after the resume, {tuple(b.shape)} "
                                     f"as saved after step {at}"))
        else:
            note("resume", _rel(a, b), at + 1, f"step {at + 1}: {what} after the resume vs as saved after step {at}",
                 RESUME_TOLERANCE)
    if resume["rng"] is not None:
        for rank, (before, after) in enumerate(zip(*resume["rng"])):
            if before != after:
                failures.append((at + 1, f"step {at + 1}: rank {rank}'s random-number state after the resume is not "
                                         f"the one it saved after step {at} (the same ranks resumed: each gets its own "
                                         f"back)"))
    return failures


def report(cfg: Config, result: dict, json_mode: bool) -> int:
    """Print the side-by-side losses and the verdict; returns the exit code."""
    out = sys.stderr if json_mode else sys.stdout
    lockstep = set(result["lockstep_steps"])
    print(f"{'step':>5}  {'layout':>12}  {'reference':>12}  {'rel diff':>9}   (* lockstep-checked)", file=out)
    losses = result["losses"]
    for i, (a, b, d) in enumerate(zip(losses["layout"], losses["reference"], result["loss_rel_diffs"])):
        print(f"{i + 1:>4}{'*' if i + 1 in lockstep else ' '}  {a:>12.8f}  {b:>12.8f}  {d:>9.2e}", file=out)
    tol = result["tolerances"]
    if result["curve_only"]:
        why = "low precision" if cfg.layout.precision != "fp32" else "fp8 over sums in another order; scales audited"
        print(f"loss curve vs the {'fp32 ' if cfg.layout.precision != 'fp32' else ''}one-process run ({why}: no "
              f"lockstep): max_loss_rel_diff "
              f"{result['max_loss_rel_diff']:.2e} (≤ {tol['curve']:g})", file=out)
    else:
        print(f"lockstep at steps {sorted(lockstep)}: max_grad_rel_diff {result['max_grad_rel_diff']:.2e} "
              f"(≤ {tol['grad']:g}; largest: {result['worst_grad']}; unfloored "
              f"{result['max_grad_plain_rel_diff']:.2e}), max_update_rel_diff {result['max_update_rel_diff']:.2e} "
              f"(≤ {tol['update']:g}; largest: {result['worst_update']}), step losses "
              f"{result['max_step_loss_rel_diff']:.2e} (≤ {tol['step_loss']:g}), held-out losses "
              f"{result['max_eval_rel_diff']:.2e} (≤ {tol['eval']:g}), gradient norms "
              f"{result['max_grad_norm_rel_diff']:.2e} (≤ {tol['grad']:g})", file=out)
    if result["judged_by_gradient"]:
        print(f"judged by their gradients alone (below {GRAD_FLOOR:g} of their share of the gradient norm, where "
              f"Adam's update is rounding's sign): {', '.join(result['judged_by_gradient'])}", file=out)
    if result["resume_at"] is not None:
        at, rng = result["resume_at"], "and every rank's random-number state " if result["resume_rng_checked"] else ""
        worst = result["max_resume_rel_diff"]
        print(f"resumed after step {at}: the state before step {at + 1} {rng}against the state saved after step {at}: "
              f"max_resume_rel_diff {worst:.2e} (≤ {RESUME_TOLERANCE:g}; "
              f"{'largest: ' + str(result['worst_resume']) if worst else 'bit for bit'})", file=out)
    drift = "drifted beyond" if result["drifted"] else "within"
    print(f"trajectories (information; correct runs drift apart by rounding under Adam): max_loss_rel_diff "
          f"{result['max_loss_rel_diff']:.2e}, max_param_rel_diff {result['max_param_rel_diff']:.2e} "
          f"(largest: {result['worst_param']}), {drift} {tol['drift']:g}", file=out)
    for failure in result["failures"]:
        print(f"  {failure}", file=out)
    if result.get("compile") is not None:
        c = result["compile"]
        print(f"compiled ({cfg.layout.compile_backend}): {c['graphs']} graphs, {c['graph_breaks']} graph breaks on "
              f"rank 0" + "".join(f"; {n}× {reason}" for reason, n in c["break_reasons"].items()), file=out)
    verdict = "PASS" if result["passed"] else f"FAIL (first: {result['first_failure']})"
    what = f"{verdict}: {cfg.model.name} with {cfg.layout.short()}"
    if result["resume_at"] is None:
        print(f"{what} vs one process, {cfg.train.steps} steps", file=out)
    else:
        again = cfg.train.resume_layout or "the same layout"
        print(f"{what}, saved after step {result['resume_at']} and resumed in {again}, vs one process trained "
              f"straight through, {cfg.train.steps} steps", file=out)
    if json_mode:
        keys = ("curve_only", "lockstep_steps", "max_grad_rel_diff", "worst_grad", "max_grad_plain_rel_diff", "worst_plain_grad",
                "max_update_rel_diff", "worst_update", "judged_by_gradient",
                "max_step_loss_rel_diff", "max_eval_rel_diff", "max_grad_norm_rel_diff", "max_loss_rel_diff", "max_param_rel_diff", "worst_param", "drifted",
                "tolerances", "first_failure", "failures", "passed", "losses", "resume_at", "resume_layout",
                "max_resume_rel_diff", "worst_resume", "compile")
        print(json.dumps({"steps": cfg.train.steps, "layout": cfg.layout.summary(),
                          **{k: result[k] for k in keys}}), flush=True)
    return 0 if result["passed"] else 1
