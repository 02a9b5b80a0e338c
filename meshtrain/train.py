"""The training loop: build the model from the seed, apply the layout's strategies, and run
the steps. The same function runs every layout and the one-process reference (`verify`).

Each step: every data-parallel rank takes its contiguous slice of the global batch, splits
it into micro-batches, and the step runner accumulates their gradients (communication only
on the last); the loss is a sum over tokens divided by the global token count, so any layout
produces the full-batch gradient; then gradient sync, global-norm clipping, AdamW, zeroed
gradients. A step whose gradient norm is not finite is skipped, with a warning."""

from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from dataclasses import dataclass, field

import torch

from meshtrain import faults, launch
from meshtrain.board import Board
from meshtrain.comm import Comm
from meshtrain.cli.config import (Config, LayoutConfig, TrainConfig, imported_tokenizer, lr_at, strict_p2p_requested,
                                  tokens_per_sample)
from meshtrain.data.datasets import open_dataset
from meshtrain.metrics import ActivationMeter, BuildMeter, LayerProbe, StepLog
from meshtrain.optim import adamw, set_lr
from meshtrain.job import Job, parallelize
from meshtrain.loss_terms import LossTerms, cross_entropy
from meshtrain.loss import IGNORE_INDEX, cross_entropy_sum
from meshtrain.parallel.compose import Parallelized
from meshtrain.parallel.compose import parallelize as apply_strategies
from meshtrain.parallel.expert_load import max_over_mean
from meshtrain.parallel.materialize import ModelRules
from meshtrain.parallel.pipeline import trace as pipeline_trace
from meshtrain.recipe import Recipe, RecipeData, is_user_model, load_recipe
from meshtrain.replica_state import digests_wanted, replica_digest
from meshtrain.recipes.build import build_model, preset_recipe
from meshtrain.step_output import StepOutput
from meshtrain.run_folder import (Preempted, Preemption, RunRefused, checkpoint_after, resume, start_lineage,
                                  this_run)
from meshtrain.hf import HFWeights


@dataclass
class RunResult:
    losses: list[float]
    step_times: list[float]
    n_params: int
    model_state: dict
    activation_bytes: int | None  # None: not measured (train(measure_memory=False))
    activation_bytes_per_layer: int | None
    comm_per_step: dict[str, int]
    parallel: Parallelized
    data: object
    skipped_steps: list[int] = field(default_factory=list)
    trace: dict | None = None  # `train --trace`: the pipeline's measured timeline (rank 0)
    comm_detail_per_step: dict[str, dict[str, int]] = field(default_factory=dict)  # axis -> collective -> bytes
    first_step: int = 1  # the step `losses` begin at (later when resumed)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), with --eval-every
    ft: dict | None = None  # --ft-replicas: `--json`'s `ft` (replicas, failures, heals, uncommitted_steps)
    # a mixture of experts: each reported step's busiest-expert/mean load of each router
    expert_load_max_over_mean: list[list[float]] = field(default_factory=list)
    balance_losses: list[float] = field(default_factory=list)  # a mixture of experts' balancing loss, each step
    job: Job | None = None  # the trained job (the command line samples its text with it)


class NonFinite(RuntimeError):
    """A step's loss or gradient norm was not finite (every rank raises it alike)."""


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


def setup(cfg: Config, comm: Comm, *, measure_memory: bool = True, **sync_options) -> tuple[object, Job]:
    """Data, and the model with the layout's strategies applied and its optimizer: the
    configuration translated into `meshtrain.parallelize`'s arguments (`sync_options`: the
    gradient synchroniser's, for the tests' probes). `measure_memory`: the build's peak
    (`build_peak_bytes`; a meter on every operator of the build)."""
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
    with BuildMeter() if measure_memory else nullcontext() as meter:
        model, init = _model_and_init(cfg, recipe)
        loss_fn = cross_entropy if recipe.loss_fn == "cross_entropy" else recipe.loss_fn
        normalizer = loss_terms_per_step(cfg) if recipe.loss_reduction == "sum" else None
        job = parallelize(model, comm.mesh, optimizer=recipe.optimizer or optimizer_factory(tr),
                          loss_fn=loss_fn, loss_reduction=recipe.loss_reduction, normalizer=normalizer, init=init,
                          tp_plan=recipe.tp_plan if cfg.layout.tp > 1 else None, pipeline=recipe.pipeline,
                          wrap=recipe.wrap, lr_scheduler=recipe.lr_scheduler, **_layout_arguments(cfg, sync_options))
    job.parallel.build_peak_bytes = meter.peak if meter is not None else None
    return data, job


def optimizer_factory(tr):
    """--optimizer's factory: AdamW, or torchao's low-bit AdamW, with --lr and --weight-decay."""
    if tr.optimizer == "adamw":
        return adamw(tr.lr, tr.weight_decay)
    from meshtrain.lowbit import low_bit_adamw
    return low_bit_adamw(tr.optimizer, tr.lr, tr.weight_decay)


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
                compile=lay.compile, compile_backend=lay.compile_backend, ep_max_load=lay.ep_max_load,
                fp8=lay.fp8_options())


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


def real_positions(targets: torch.Tensor) -> torch.Tensor:
    """--pad-documents' rows: the input positions that are not padding (a row's first, and
    each whose previous target is not IGNORE_INDEX: padding follows a document's last
    target), as transformers' attention mask marks them for its balancing loss."""
    real = torch.ones_like(targets, dtype=torch.bool)
    real[:, 1:] = targets[:, :-1] != IGNORE_INDEX
    return real


def train_step(job: Job, data, step: int, cfg: Config, *, observer: StepObserver | None = None,
               meter: ActivationMeter | None = None) -> StepOutput:
    """One optimizer step on the global batch of `step` (0-based): its global mean loss,
    and whether the optimizer stepped (not when the gradient norm is not finite)."""
    tr = cfg.train
    if job.lr_scheduler is None:  # a user's recipe may bring its own
        set_lr(job.optimizer, lr_at(step, tr))
    job.steps = step  # dropout masks are keyed by the step
    inputs, targets = data.batch(step, tr.batch_size, slice(0, tr.batch_size))  # replica groups: the live ones' rows
    mask = real_positions(targets) if tr.pad_documents and job.parallel.balancing else None
    loss = job.backward(inputs, targets, meter=meter, token_mask=mask)
    if observer:
        observer.grads_ready(job.parallel, step + 1)
    faults.inject("term", job.mesh.rank, step + 1)
    return job.update(loss)


def train(cfg: Config, comm: Comm, *, observer: StepObserver | None = None, progress: str | None = None,
          step_log: StepLog | None = None, trace: bool = False, stop_after: int | None = None,
          measure_memory: bool = True, **sync_options) -> RunResult:
    """`stop_after` K: end after step K (its checkpoint written when --save-every says so),
    the schedule still that of --steps: `verify --resume-at K` runs the rest resumed.
    `measure_memory`: the build's peak and the first step's activation peak, per rank and
    per layer (their meters cost Python time on every operator of the build and of that
    step: verify, which reports neither, leaves it off; they are then None)."""
    mesh, tr = comm.mesh, cfg.train
    data, job = setup(cfg, comm, measure_memory=measure_memory, **sync_options)
    if tr.eval_every and not hasattr(data, "val_batch"):
        raise RunRefused("--eval-every: this model's recipe brings its own batches, which have no held-out split; "
                         "evaluate in your own loop with job.evaluate")
    p = job.parallel
    if mesh.is_main and not cfg.ft.replica_id:  # replica groups: group 0 speaks
        for note in p.notes:
            print(f"meshtrain: {note}", file=sys.stderr)
    # A run that writes into OUT (its log, checkpoints) or resumes from it owns it; verify's
    # and bench's runs neither read nor write it.
    writes_out = bool(tr.save_every) or comm.any_rank(step_log is not None)  # rank 0 keeps the log
    run_id = this_run(cfg, comm) if writes_out or tr.resume or tr.resume_from else ""
    start, resumed_from = resume(job, cfg, run_id)
    replicas = replica_groups(cfg, job, start)
    tries: dict[int, list[dict]] = {}  # replica groups: each try of a step not yet logged (its quorum)
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

    meter = ActivationMeter() if measure_memory else None
    probe = LayerProbe(p.module, meter) if meter is not None else None
    # With checkpoints on, a SIGTERM (a scheduler's preemption) reaches ranks at different
    # steps: each step the flag rides on the gradient norm's all-reduce (`Job.stop_signal`),
    # and every rank saves after the first step whose update any had seen it by.
    preemption = Preemption() if tr.save_every else None
    job.stop_signal = (lambda: preemption.seen) if preemption is not None else None
    board = Board(Path(tr.out), comm) if tr.tensorboard else None
    try:
        losses, times, comm_per_step, comm_detail, skipped, val_losses = [], [], {}, {}, [], []
        expert_load_ratios: list[list[float]] = []  # a mixture of experts': each step's max/mean load per router
        balance_losses: list[float] = []  # and the balancing loss each step added

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
            if out.balance_loss is not None:  # logged beside the loss, which is the main loss alone
                balance_losses.append(out.balance_loss.item())
                balance["balance_loss"] = balance_losses[-1]
            if board is not None:
                board.step(step + 1, loss=loss, lr=lr_at(step, tr), tokens_per_s=tokens_per_step / dt,
                           grad_norm=out.grad_norm, val_loss=val,
                           **{k: balance[k] for k in ("expert_load_max_over_mean", "balance_loss") if k in balance})
            if step_log is not None:
                step_log.write({"step": step + 1, "loss": loss, "lr": lr_at(step, tr), "step_time_s": dt,
                                "tokens_per_s": tokens_per_step / dt, **({"val_loss": val} if val is not None else {}),
                                **balance, **_ft_fields(tries.pop(step + 1, []))})

        pending = None  # the last step, reported after the next one started
        step, first = start, True
        while step < tr.steps:
            quorum = None
            if replicas is not None:  # the live groups; a joining group heals here (the step is then its peer's)
                t_quorum = time.perf_counter()
                step, quorum = job.begin_step(), job.quorum
                if step >= tr.steps:
                    job.quorum = None
                    break
            if observer:
                observer.before_step(p, step + 1)
            sent_before = comm.detailed_totals()
            t0 = time.perf_counter()
            # The activation peak is measured on the first step (the meter costs Python time per op).
            out = train_step(job, data, step, cfg, observer=observer, meter=meter if first else None)
            if first:
                if probe is not None:
                    probe.close()
                launch.set_collective_timeout(mesh, tr.timeout)  # built and stepped once: the steady bound
                first = False
            dt = time.perf_counter() - t0
            if quorum is not None:
                tries.setdefault(step + 1, []).append({"live": quorum.live, "quorum_s": round(quorum.wait_s, 4),
                                                       "healed_s": quorum.healed_s,
                                                       "step_s": round(time.perf_counter() - t_quorum, 4)})
                if not out.committed:  # a group failed during the step: trained again by the next quorum
                    if mesh.is_main and not cfg.ft.replica_id:
                        print(f"meshtrain: step {step + 1} not committed (a replica group failed during it); "
                              f"trained again", file=sys.stderr)
                    continue
                if digests_wanted():
                    tries[step + 1][-1]["digest"] = replica_digest(job)
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
            step += 1
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
                         model_state=p.model_state_bytes(), activation_bytes=meter.peak if meter else None,
                         activation_bytes_per_layer=probe.bytes if probe else None,
                         comm_per_step=comm_per_step, parallel=p, data=data, skipped_steps=skipped, trace=traced,
                         comm_detail_per_step=comm_detail, val_losses=val_losses,
                         expert_load_max_over_mean=expert_load_ratios, balance_losses=balance_losses, job=job,
                         ft=replicas.report() if replicas is not None else None)
    finally:
        if replicas is not None:
            replicas.shutdown()
        if preemption is not None:
            preemption.restore()
            job.stop_signal = None
        if board is not None:
            board.close()


def _ft_fields(tries: list[dict]) -> dict:
    """A committed step's quorum in its log line (replica groups): the live groups, the wait
    for the quorum, the tries it took (a group lost during one is trained again), a heal."""
    if not tries:
        return {}
    done = tries[-1]
    return {"ft_live": done["live"], "ft_quorum_s": done["quorum_s"], "ft_tries": len(tries),
            "ft_stall_s": round(sum(s["step_s"] for s in tries) - done["step_s"] + done["quorum_s"], 4),
            **({"ft_healed_s": round(done["healed_s"], 4)} if done["healed_s"] is not None else {}),
            **({"ft_digest": done["digest"]} if "digest" in done else {})}


def replica_groups(cfg: Config, job: Job, start: int):
    """`--ft-replicas R`: this rank's torchft manager (`meshtrain.replicas`), the job's state
    registered for healing a group that joins, the quorum starting at `start`; else None."""
    if not cfg.ft.replicas:
        return None
    from meshtrain.replica_state import attach_replicas
    from meshtrain.replicas import FtOptions
    ft = cfg.ft
    attach_replicas(job, FtOptions(replicas=ft.replicas, replica_id=ft.replica_id or 0, lighthouse=ft.lighthouse,
                                   timeout_s=ft.timeout, quorum_timeout_s=ft.quorum_timeout, bucket_mb=ft.bucket_mb))
    job.steps = start  # the quorum starts at the resumed step (`Job.begin_step`)
    return job.replicas


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
