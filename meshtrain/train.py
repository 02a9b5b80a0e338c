"""The training loop: build the model from the seed, apply the layout's strategies, and run
the steps. The same function runs every layout and the one-process reference (`verify`).

Each step: every data-parallel rank takes its contiguous slice of the global batch, splits
it into micro-batches, and the step runner accumulates their gradients (communication only
on the last); the loss is a sum over tokens divided by the global token count, so any layout
produces the full-batch gradient; then gradient sync, global-norm clipping, AdamW, zeroed
gradients. A step whose gradient norm is not finite is skipped, with a warning."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field, replace

from meshtrain import faults, launch
from meshtrain.board import Board
from meshtrain.checkpoint import folders, lineage, owner
from meshtrain.cli.run_model import imported_record
from meshtrain.comm import Comm
from meshtrain.config import (Config, LayoutConfig, TrainConfig, imported_tokenizer, lr_at, strict_p2p_requested,
                              tokens_per_sample)
from meshtrain.data.datasets import open_dataset
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.metrics import ActivationMeter, BuildMeter, LayerProbe, StepLog
from meshtrain.optim import adamw, set_lr
from meshtrain.job import Job, StepOutput, cross_entropy, parallelize
from meshtrain.loss_terms import LossTerms
from meshtrain.loss import IGNORE_INDEX, cross_entropy_sum
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.compose import parallelize as apply_strategies
from meshtrain.parallel.expert_load import max_over_mean
from meshtrain.parallel.materialize import ModelRules
from meshtrain.parallel.pipeline import trace as pipeline_trace
from meshtrain.recipe import Recipe, RecipeData, is_user_model, load_recipe
from meshtrain.recipes.build import build_model, preset_recipe
from meshtrain.hf import HFWeights
from meshtrain.checkpoint.folders import CorruptCheckpoint
from meshtrain.checkpoint.sharded import CheckpointError, read_meta


@dataclass
class RunResult:
    losses: list[float]
    step_times: list[float]
    n_params: int
    model_state: dict
    activation_bytes: int
    activation_bytes_per_layer: int | None
    comm_per_step: dict[str, int]
    parallel: Parallelized
    data: object
    skipped_steps: list[int] = field(default_factory=list)
    trace: dict | None = None  # `train --trace`: the pipeline's measured timeline (rank 0)
    comm_detail_per_step: dict[str, dict[str, int]] = field(default_factory=dict)  # axis -> collective -> bytes
    first_step: int = 1  # the step `losses` begin at (later when resumed)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), with --eval-every
    # a mixture of experts: each reported step's busiest-expert/mean load of each router
    expert_load_max_over_mean: list[list[float]] = field(default_factory=list)


class RunRefused(ValueError):
    """What a run cannot do, found once the ranks have started (every rank alike): one line."""


class NonFinite(RuntimeError):
    """A step's loss or gradient norm was not finite (every rank raises it alike)."""


class Preempted(Exception):
    """A SIGTERM reached a rank: every rank saved the state after `step` in `folder`."""

    def __init__(self, step: int, folder: Path):
        super().__init__(f"stopped by SIGTERM after step {step}; saved {folder} (resume with --resume)")
        self.step, self.folder = step, folder


class Preemption:
    """Remembers a SIGTERM instead of dying of it, until `restore` (the main thread only)."""

    def __init__(self):
        self.seen = False
        self._before = None
        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self.seen = True

    def restore(self) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)


class StepObserver:
    """Hooks into the loop at fixed points of a step (1-based `step`); every rank calls them,
    so an observer may run collectives (verify gathers the full state there)."""

    def before_step(self, p: Parallelized, step: int) -> None: ...

    def grads_ready(self, p: Parallelized, step: int) -> None:
        """Gradients are synchronised; not yet clipped."""

    def after_step(self, p: Parallelized, step: int, loss: float) -> None: ...

    def grad_norm(self, step: int, norm: float) -> None:
        """The step's global gradient norm (before clipping), as `job.update` found it."""

    def held_out(self, job: Job, data, step: int) -> None:
        """After `after_step`, with the job and its data: verify evaluates here."""


def build(cfg: Config, device):
    """The dataset and the full, unsharded model with its initial weights (one process's)."""
    data = _dataset(cfg)
    return data, model_for(cfg, data, device)


def _dataset(cfg: Config):
    tr = cfg.train
    kind = "mlp" if tr.data == "digits" else "gpt"  # images, or token ids
    return open_dataset(tr.data, kind, tr.vocab_size, tr.seq_len, tr.seed, tokenizer=imported_tokenizer(cfg),
                        pad_documents=tr.pad_documents)


def _data_facts(data) -> dict:
    """What a preset's structure takes from its data: the vocabulary, or the inputs and classes."""
    return {k: getattr(data, k) for k in ("vocab_size", "n_inputs", "n_classes") if hasattr(data, k)}


def recipe_for(cfg: Config, data) -> Recipe:
    """The configured preset as a recipe for `data` (its vocabulary, or its inputs and classes)."""
    m = cfg.model
    return preset_recipe(m.name, dropout=m.dropout, attention=m.attention, mlp_hidden=m.mlp_hidden,
                         moe=m.moe_options(), **_data_facts(data))


def initial_weights(cfg: Config, model, recipe: Recipe):
    """What each rank draws its part of the weights from: the recipe's (the seed's rules), or
    --init-from's files."""
    if cfg.model.init_from:
        return HFWeights(cfg.model.init_from, model)
    return recipe.init.spec(model, cfg.train.seed) if isinstance(recipe.init, ModelRules) else recipe.init


def model_for(cfg: Config, data, device):
    """The configured model for `data`: with its initial weights, or on `meta` its structure."""
    m = cfg.model
    return build_model(m.name, cfg.train.seed, dropout=m.dropout, attention=m.attention, mlp_hidden=m.mlp_hidden,
                       moe=m.moe_options(), device=device, **_data_facts(data))


def exact_fp32_on_cuda() -> None:
    """fp32 on a GPU as on the CPU: no TF32 in matrix products or cuDNN (verify holds a CUDA
    run to the CPU reference). torch ≥ 2.9 says it with `fp32_precision`, older with `allow_tf32`."""
    import torch
    for backend in (torch.backends.cuda.matmul, torch.backends.cudnn):
        if hasattr(backend, "fp32_precision"):
            backend.fp32_precision = "ieee"
        else:
            backend.allow_tf32 = False


def setup(cfg: Config, comm: Comm, **sync_options) -> tuple[object, Job]:
    """Data, and the model with the layout's strategies applied and its optimizer: the
    configuration translated into `meshtrain.parallelize`'s arguments (`sync_options`: the
    gradient synchroniser's, for the tests' probes)."""
    if comm.mesh.device.type == "cuda" and cfg.layout.precision == "fp32":
        exact_fp32_on_cuda()
    tr = cfg.train
    comm.mesh.attach(comm, seed=tr.seed)
    if is_user_model(cfg.model.name):
        recipe = load_recipe(cfg.model.name)
        data = RecipeData(recipe.batch) if recipe.batch is not None else _dataset(cfg)
    else:
        data = _dataset(cfg)
        recipe = recipe_for(cfg, data)
    with BuildMeter() as meter:
        model, init = _model_and_init(cfg, recipe)
        loss_fn = cross_entropy if recipe.loss_fn == "cross_entropy" else recipe.loss_fn
        normalizer = loss_terms_per_step(cfg) if recipe.loss_reduction == "sum" else None
        job = parallelize(model, comm.mesh, optimizer=recipe.optimizer or adamw(tr.lr, tr.weight_decay),
                          loss_fn=loss_fn, loss_reduction=recipe.loss_reduction, normalizer=normalizer, init=init,
                          tp_plan=recipe.tp_plan if cfg.layout.tp > 1 else None, pipeline=recipe.pipeline,
                          wrap=recipe.wrap, lr_scheduler=recipe.lr_scheduler, **_layout_arguments(cfg, sync_options))
    job.parallel.build_peak_bytes = meter.peak
    return data, job


def _model_and_init(cfg: Config, recipe: Recipe):
    """The recipe's model and what its weights are drawn from. With `init` (every preset) no
    rank builds the whole model: the structure on `meta`, cut and sharded by the strategies,
    then each rank draws only its part (`parallel.materialize`). Without, it is built whole on
    every rank after `torch.manual_seed(--seed)`."""
    import torch

    if recipe.init is None:
        torch.manual_seed(cfg.train.seed)
        return recipe.make_model(), None
    with torch.device("meta"):
        model = recipe.make_model()
    return model, initial_weights(cfg, model, recipe)


def _layout_arguments(cfg: Config, sync_options: dict) -> dict:
    """`meshtrain.parallelize`'s arguments from the layout and training flags."""
    lay, tr = cfg.layout, cfg.train
    return dict(clip_grad_norm=tr.clip, zero=lay.zero, precision=lay.precision, grad_dtype=lay.grad_dtype,
                recompute=lay.recompute, sp=lay.sp, schedule=lay.schedule, chunks=lay.chunks,
                microbatches=lay.microbatches, stage_layers=lay.stage_layer_counts(), bucket_mb=lay.bucket_mb,
                keep_gathered=lay.keep_gathered, dp_linear_sync=lay.dp_linear_sync,
                rows_per_step=tr.batch_size * tokens_per_sample(cfg), strict_p2p=strict_p2p_requested(),
                sync_options=sync_options, cp_mode=lay.cp_mode,
                compile=lay.compile, compile_backend=lay.compile_backend)


def job_for(p: Parallelized, cfg: Config) -> Job:
    """A `Job` around strategies built elsewhere (the benchmarks' PyTorch-native peers), so
    they run the very loop ours runs: the configured loss normaliser, clipping, micro-batches."""
    p.comm.mesh.attach(p.comm, seed=cfg.train.seed)
    return Job(p, p.comm.mesh, LossTerms(cross_entropy_sum, "sum", loss_terms_per_step(cfg)),
               cfg.layout.strategies(), None, cfg.train.clip, None)


def parallelize_config(model, comm: Comm, layout: LayoutConfig, train: TrainConfig, *, rows_per_sample: int = 1,
                       **options) -> Parallelized:
    """The strategies as the command line's configuration asks, on a model of the tests' own
    (no Job: the caller drives the parts): the layout's strategies, its AdamW (betas
    0.9/0.95), the seed's dropout masks, the pipeline's transfers sized for the batch."""
    micro_rows = train.batch_size // (layout.dp or 1) // layout.microbatches
    return apply_strategies(model, comm, layout.strategies(strict_p2p=strict_p2p_requested()),
                            optimizer=adamw(train.lr, train.weight_decay), seed=train.seed,
                            micro_shape=(micro_rows, train.seq_len), rows_per_step=train.batch_size * rows_per_sample,
                            **options)


def loss_terms_per_step(cfg: Config):
    """What every rank divides its summed loss by: the number of loss terms (tokens, or
    images) in the global batch, so the gradients of all ranks and micro-batches sum to the
    full-batch mean's gradient. With --pad-documents that number varies: a function counting
    the targets that are not padding, which the Job calls on the global batch's targets."""
    if cfg.train.pad_documents:
        return count_targets
    return cfg.train.batch_size * tokens_per_sample(cfg)


def count_targets(targets) -> torch.Tensor:
    """The targets a loss counts: those that are not IGNORE_INDEX (padding), a 0-dim tensor
    where the targets are (never read on the host)."""
    return (targets != IGNORE_INDEX).sum()


def train_step(job: Job, data, step: int, cfg: Config, *, observer: StepObserver | None = None,
               meter: ActivationMeter | None = None) -> StepOutput:
    """One optimizer step on the global batch of `step` (0-based): its global mean loss,
    and whether the optimizer stepped (not when the gradient norm is not finite)."""
    tr = cfg.train
    if job.lr_scheduler is None:  # a user's recipe may bring its own
        set_lr(job.optimizer, lr_at(step, tr))
    job.steps = step  # dropout masks are keyed by the step
    inputs, targets = data.batch(step, tr.batch_size, slice(0, tr.batch_size))
    loss = job.backward(inputs, targets, meter=meter)
    if observer:
        observer.grads_ready(job.parallel, step + 1)
    return job.update(loss)


def train(cfg: Config, comm: Comm, *, observer: StepObserver | None = None, progress: str | None = None,
          step_log: StepLog | None = None, trace: bool = False, stop_after: int | None = None,
          **sync_options) -> RunResult:
    """`stop_after` K: end after step K (its checkpoint written when --save-every says so),
    the schedule still that of --steps: `verify --resume-at K` runs the rest resumed."""
    mesh, tr = comm.mesh, cfg.train
    data, job = setup(cfg, comm, **sync_options)
    if tr.eval_every and not hasattr(data, "val_batch"):
        raise RunRefused("--eval-every: this model's recipe brings its own batches, which have no held-out split; "
                         "evaluate in your own loop with job.evaluate")
    p = job.parallel
    if mesh.is_main:
        for note in p.notes:
            print(f"meshtrain: {note}", file=sys.stderr)
    # A run that writes into OUT (its log, checkpoints) or resumes from it owns it; verify's
    # and bench's runs neither read nor write it.
    writes_out = bool(tr.save_every) or comm.any_rank(step_log is not None)  # rank 0 keeps the log
    run_id = this_run(cfg, comm) if writes_out or tr.resume or tr.resume_from else ""
    start, resumed_from = resume(job, cfg, run_id)
    # The resume is accepted on every rank: only now does anything in OUT change.
    if writes_out:
        start_lineage(comm, Path(tr.out), run_id, start, resumed_from)
    if step_log is not None:
        step_log.start(start)
    recorder = pipeline_trace.Recorder(mesh.device) if trace else None
    if recorder:
        p.runner.recorder = recorder
    tokens_per_step = tr.batch_size * tokens_per_sample(cfg)
    bar = None
    if progress and mesh.is_main:
        from tqdm import tqdm
        bar = tqdm(total=tr.steps, initial=start, desc=progress, file=sys.stderr, unit="step", dynamic_ncols=True)

    meter = ActivationMeter()
    probe = LayerProbe(p.module, meter)
    # With checkpoints on, a SIGTERM (a scheduler's preemption) reaches ranks at different
    # steps: each step the flag is all-reduced, and every rank saves at the first step any saw it.
    preemption = Preemption() if tr.save_every else None
    board = Board(Path(tr.out), comm) if tr.tensorboard else None
    try:
        losses, times, comm_per_step, comm_detail, skipped, val_losses = [], [], {}, {}, [], []
        expert_load_ratios: list[list[float]] = []  # a mixture of experts': each step's max/mean load per router

        def report(step: int, out: StepOutput, dt: float, val: float | None) -> None:
            """A step's numbers, read after the next step was started (its loss read then waits
            for nothing the device has not done): the losses, the bar, the board, the log."""
            loss = out.loss
            losses.append(loss)
            if out.stepped and not math.isfinite(loss):
                if not tr.skip_nonfinite:
                    raise NonFinite(f"step {step + 1}: the loss is {loss:g} and the gradient norm {out.grad_norm:g}; "
                                    f"lower --lr, or pass --skip-nonfinite to skip such steps")
                skipped.append(step + 1)
            if observer:
                observer.grad_norm(step + 1, out.grad_norm)
                observer.after_step(p, step + 1, loss)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
                bar.update()
            balance = {}
            if out.expert_load is not None:  # a mixture of experts: how evenly each router spread the step's tokens
                ratios = max_over_mean(out.expert_load)
                expert_load_ratios.append(ratios)
                balance = {"expert_load_max_over_mean": max(ratios), "expert_load_max_over_mean_per_layer": ratios}
            if board is not None:
                board.step(step + 1, loss=loss, lr=lr_at(step, tr), tokens_per_s=tokens_per_step / dt,
                           grad_norm=out.grad_norm, val_loss=val, **({"expert_load_max_over_mean": max(ratios)}
                                                                      if balance else {}))
            if step_log is not None:
                step_log.write({"step": step + 1, "loss": loss, "lr": lr_at(step, tr), "step_time_s": dt,
                                "tokens_per_s": tokens_per_step / dt, **({"val_loss": val} if val is not None else {}),
                                **balance})

        pending = None  # the last step, reported after the next one started
        for step in range(start, tr.steps):
            if observer:
                observer.before_step(p, step + 1)
            sent_before = comm.detailed_totals()
            t0 = time.perf_counter()
            # The activation peak is measured on the first step (the meter costs Python time per op).
            out = train_step(job, data, step, cfg, observer=observer, meter=meter if step == start else None)
            if step == start:
                probe.close()
                launch.set_collective_timeout(mesh, tr.timeout)  # built and stepped once: the steady bound
            dt = time.perf_counter() - t0
            comm_detail = _per_axis({k: v - sent_before.get(k, 0.0) for k, v in comm.detailed_totals().items()})
            comm_per_step = {axis: sum(kinds.values()) for axis, kinds in comm_detail.items()}
            times.append(dt)
            if not out.stepped:  # known now: the norm was read to decide the skip
                if not tr.skip_nonfinite:
                    raise NonFinite(f"step {step + 1}: the loss is {out.loss:g} and the gradient norm {out.grad_norm:g}"
                                    + (f"; the first tensor that is not: {out.nonfinite}" if out.nonfinite else "")
                                    + "; lower --lr, or pass --skip-nonfinite to skip such steps")
                skipped.append(step + 1)
            if pending is not None:
                report(*pending)
            pending = None
            if observer:  # verify compares each step as it ends
                observer.held_out(job, data, step + 1)
            val = validate(job, data, cfg, step + 1)
            if val is not None:
                val_losses.append((step + 1, val))
            pending = (step, out, dt, val)
            if observer:
                report(*pending)
                pending = None
            try:
                checkpoint_after(job, cfg, data, step + 1, preemption, run_id)
            except Preempted:
                if pending is not None:  # the step it saved is logged before the run stops
                    report(*pending)
                raise
            if stop_after is not None and step + 1 >= stop_after:
                break
        job.wait_for_saves()  # an --async-save in flight: written and committed before the run ends
        if pending is not None:
            report(*pending)
        if bar is not None:
            bar.close()
        for axis in ("dp", "tp", "pp", "cp", "ep", "edp"):  # every axis --json names, 0 when unused
            comm_per_step.setdefault(axis, 0)
            comm_detail.setdefault(axis, {})
        traced = _gather_trace(cfg, comm, p.runner, recorder) if recorder else None
        return RunResult(losses=losses, step_times=times, n_params=p.n_params, first_step=start + 1,
                         model_state=p.model_state_bytes(), activation_bytes=meter.peak,
                         activation_bytes_per_layer=probe.bytes,
                         comm_per_step=comm_per_step, parallel=p, data=data, skipped_steps=skipped, trace=traced,
                         comm_detail_per_step=comm_detail, val_losses=val_losses,
                         expert_load_max_over_mean=expert_load_ratios)
    finally:
        if preemption is not None:
            preemption.restore()
        if board is not None:
            board.close()


def validate(job: Job, data, cfg: Config, step: int) -> float | None:
    """Collective, after `step`: the mean loss over --eval-batches global batches of the
    held-out split (the same batches every time), when --eval-every says so; else None."""
    tr = cfg.train
    if not tr.eval_every or (step % tr.eval_every and step != tr.steps):
        return None
    return sum(held_out_loss(job, data, cfg, k) for k in range(tr.eval_batches)) / tr.eval_batches


def held_out_loss(job: Job, data, cfg: Config, k: int = 0) -> float:
    """Collective: the mean loss of held-out batch k (`job.evaluate`, every layout alike)."""
    size = cfg.train.batch_size
    return job.evaluate(*data.val_batch(k, size, slice(0, size)))


# ---- checkpoints ----------------------------------------------------------------------------

def run_identity(cfg: Config) -> dict:
    """What a resumed run must share with the run that saved: what defines the trained model —
    the model, the data, the global batch (the step is then the position in the data), the
    seed, dropout, and the optimizer's learning rate, warm-up, weight decay and clipping. The
    layout may differ, and so may `--steps` (the schedule is re-derived from it: `resume`)."""
    tr = cfg.train
    return {"model": cfg.model.name, "data": tr.data, "vocab_size": tr.vocab_size, "batch_size": tr.batch_size,
            "seq_len": tr.seq_len, "seed": tr.seed, "dropout": cfg.model.dropout, "pad_documents": tr.pad_documents,
            "lr": tr.lr, "warmup": tr.warmup, "weight_decay": tr.weight_decay, "clip": tr.clip}


def this_run(cfg: Config, comm: Comm) -> str:
    """Collective: the id of the run, as rank 0 knows it — from the command line, which
    claimed OUT before any rank started (`checkpoint.owner.claim`), or claimed here for a
    caller of `train` that did not (the same refusals, as `RunRefused`)."""
    run = None
    if comm.mesh.is_main:
        tr = cfg.train
        try:
            run = os.environ.get(owner.RUN_ID_ENV) or owner.claim(
                Path(tr.out), resume=tr.resume, resume_from=tr.resume_from, overwrite=tr.overwrite, log=_say,
                restarted=faults.restart_count() > 0)
        except owner.OwnerError as e:
            run = RunRefused(str(e))
    if comm.mesh.world_size > 1:
        run = comm.all_gather_object(run)[0]
    if isinstance(run, RunRefused):
        raise run
    return run


def checkpoint_after(job: Job, cfg: Config, data, step: int, preemption: Preemption | None, run_id: str) -> None:
    """Collective, after `step` (1-based): its checkpoint when --save-every says so, and when
    any rank has seen a SIGTERM (then `Preempted`, on every rank)."""
    tr, rank = cfg.train, job.mesh.rank
    faults.inject("kill", rank, step)
    faults.inject("term", rank, step)
    due = bool(tr.save_every) and (step % tr.save_every == 0 or step == tr.steps)
    if due:
        save(job, cfg, data, step, run_id, background=tr.async_save)
    if preemption is not None and job.parallel.comm.any_rank(preemption.seen):
        if not due:
            save(job, cfg, data, step, run_id)
        job.wait_for_saves()
        folder, out = folders.step_dir(Path(tr.out), step), Path(tr.out)
        stopped = {"by": "SIGTERM", "step": step, "saved": str(folder), "at": time.time()}
        # What meshtrain's launcher reads to exit 0 after a clean stop.
        _on_rank_0(job.parallel.comm, f"writing {out / owner.RUN_FILE}",
                   lambda: owner.write_run(out, {**owner.read_run(out), "stopped": stopped}))
        raise Preempted(step, folder)


def save(job: Job, cfg: Config, data, step: int, run_id: str, background: bool = False) -> None:
    """Collective: the sharded checkpoint OUT/step-N; then this run's oldest beyond --keep
    removed. `background` (--async-save): written by a thread once the state is staged, the
    prune run there too, after the commit."""
    out, folder, main = Path(cfg.train.out), folders.step_dir(Path(cfg.train.out), step), job.mesh.is_main
    t0 = time.perf_counter()
    tokenizer = Path(getattr(data, "folder", None) or "", TOKENIZER_FILE)

    def then(comm) -> None:
        _on_rank_0(comm, f"writing {out / owner.RUN_FILE}", lambda: lineage.record_head(out, folder))
        if cfg.train.keep:  # the head's history: never a newer checkpoint of another branch
            folders.prune(out, cfg.train.keep, comm, run=run_id, upto=step)
        if main:
            print(f"meshtrain: saved {folder} in {time.perf_counter() - t0:.1f} s"
                  + (" (in the background)" if background else ""), file=sys.stderr)

    blocked = job.save(folder, run=run_identity(cfg), run_id=run_id, layout_flags=cfg.layout.short(),
                       config=cfg.to_dict(), vocab_size=getattr(data, "vocab_size", None),
                       files=[tokenizer] if tokenizer.is_file() else [], background=background, then=then,
                       **imported_record(cfg))
    if background and main:
        print(f"meshtrain: saving {folder} in the background (the step blocked {blocked:.2f} s)", file=sys.stderr)


def _on_rank_0(comm: Comm, doing: str, write) -> None:
    """Collective: `write()` on rank 0, then every rank raises if it failed (no rank is left
    waiting in a collective for one that left)."""
    error = None
    if comm.mesh.is_main:
        try:
            write()
        except Exception as e:
            error = e
    folders.decide(comm, error, doing)


def _say(msg: str) -> None:
    print(f"meshtrain: {msg}", file=sys.stderr)


def resume(job: Job, cfg: Config, run_id: str) -> tuple[int, str | None]:
    """Collective: with --resume or --resume-from, or after a restart, load the checkpoint
    (any layout's) that `lineage.resume_plan` names — the run's head and its history below it,
    a damaged one passed by for the one before — and return its step and folder; else (0,
    None). Everything that can refuse it is checked before the state is loaded, and nothing in
    OUT is written here: a refused resume leaves OUT as it was."""
    tr, comm = cfg.train, job.parallel.comm
    restarted = faults.restart_count() > 0
    if not (tr.resume or tr.resume_from or restarted):
        return 0, None
    say = _say if job.mesh.is_main else (lambda msg: None)
    plan = _on_rank_0_value(comm, lambda: lineage.resume_plan(
        Path(tr.out), run_id, resume=tr.resume, resume_from=tr.resume_from, restarted=restarted,
        job=lineage.job_id()))
    for folder in plan.folders:
        problem = folders.check(folder, comm)
        if problem is None:
            try:
                meta = _checked_load(job, cfg, folder)
                break
            except CorruptCheckpoint as e:  # a box failing its checksum as it loaded
                if plan.named:
                    raise
                problem = str(e).removeprefix(f"{folder}: ")
        if plan.named:
            raise CheckpointError(f"--resume-from {folder}: {problem}")
        say(f"checkpoint {folder}: {problem}; trying the one before")
    else:
        if plan.empty == "error":
            raise CheckpointError(f"--resume: no good checkpoint of run {run_id or '(unnamed)'} in {tr.out} "
                                  f"(write them with --save-every N)")
        if restarted:
            say(f"restart {faults.restart_count()}: no checkpoint of this run in {tr.out} yet; starting over")
        return 0, None
    planned = (meta.get("config") or {}).get("train", {}).get("steps")
    if isinstance(planned, int) and planned != tr.steps and job.lr_scheduler is None:
        say(f"--steps {tr.steps}: the saved run planned {planned}; its learning-rate schedule is re-derived from "
            f"{tr.steps} (at step {meta['steps'] + 1}: {lr_at(meta['steps'], tr):.3g}, where the saved plan had "
            f"{lr_at(meta['steps'], replace(tr, steps=planned)):.3g})")
    say(f"resumed from {folder} (step {meta['steps']}, saved as {meta.get('layout_flags', '?')})")
    return meta["steps"], str(folder)


def start_lineage(comm: Comm, out: Path, run_id: str, start: int, resumed_from: str | None) -> None:
    """Collective, once a resume at `start` is accepted (or a fresh run begins): rank 0 moves
    aside what the run's history no longer holds (`lineage.roll_back`: its checkpoints newer
    than `start`, and their log), then writes run.json with the head (the resumed checkpoint,
    or none) and this job's id, which restarts follow."""
    def write() -> None:
        rolled = lineage.roll_back(out, run_id, start)
        if rolled is not None:
            aside, later = rolled
            _say(f"rolled back to step {start}: moved this run's later checkpoints (step "
                 f"{', '.join(map(str, later))}) and their log records into {aside}")
        owner.write_run(out, {**owner.started_record(run_id, resumed_from=resumed_from, step=start),
                              lineage.HEAD: lineage.head_name(out, resumed_from), lineage.JOB: lineage.job_id()})
    _on_rank_0(comm, f"writing {out / owner.RUN_FILE}", write)


def _on_rank_0_value(comm: Comm, decide):
    """Collective: what `decide()` returns on rank 0, on every rank (one decision, so every rank
    reads the same checkpoints)."""
    value = decide() if comm.mesh.is_main else None
    return comm.all_gather_object(value)[0] if comm.mesh.world_size > 1 else value


def _checked_load(job: Job, cfg: Config, folder: Path) -> dict:
    """Collective: the checkpoint in `folder` (checked good: `folders.check`) loaded, once
    what the run's identity and --steps ask of it hold; its saved facts."""
    tr, meta = cfg.train, read_meta(folder)
    saved, mine = meta.get("run", {}), run_identity(cfg)
    for key in mine:
        if key in saved and saved[key] != mine[key]:
            raise CheckpointError(f"{folder} was saved by a run with {key} {saved[key]!r}, not {mine[key]!r}; "
                                  f"resume with the same model, data, global batch and optimizer settings "
                                  f"(the layout and --steps may differ)")
    if meta["steps"] >= tr.steps:
        raise CheckpointError(f"{folder} is at step {meta['steps']}, and --steps is {tr.steps}: nothing left to "
                              f"train; raise --steps")
    return job.load(folder, check=False)


def _per_axis(sent: dict[tuple[str, str], float]) -> dict[str, dict[str, int]]:
    """{(axis, collective): bytes} as {axis: {collective: bytes}}, rounded, zeros left out."""
    out: dict[str, dict[str, int]] = {}
    for (axis, kind), nbytes in sorted(sent.items()):
        if round(nbytes):
            out.setdefault(axis, {})[kind] = round(nbytes)
    return out


def _gather_trace(cfg: Config, comm: Comm, runner, recorder) -> dict:
    """Collective over pp: every stage's timeline (and the p2p time) in one object."""
    lay = cfg.layout
    p2p_s = pipeline_trace.measure_p2p(comm, "pp", runner.activation_shape, runner.dtype)
    stages_steps = comm.all_gather_object(recorder.steps, axis="pp")
    return {"schedule": lay.schedule, "pp": lay.pp, "microbatches": lay.microbatches, "chunks": lay.chunks,
            "model": cfg.model.name, "layout": lay.short(), "p2p_s": p2p_s,
            "steps": [list(stage_spans) for stage_spans in zip(*stages_steps)]}
