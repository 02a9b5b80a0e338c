"""`meshtrain.parallelize`: a user's own model, optimizer and loss under every strategy, and
the `Job` that trains it one global batch at a time (`job.step`).

What `job.step` does that a user should not have to: it cuts the global batch into this
rank's rows and its micro-batches, casts floating inputs to the compute dtype, keys the
dropout masks by (step, row) so that every layout drops the same elements, weights each
micro-batch's mean loss by the number of terms it averages (so that the step's gradient is
the full batch's mean, whatever the layout), synchronises gradients, clips, steps the
optimizer and the scheduler, and zeroes the gradients.

Its pieces live beside it: `batch_rows` (this rank's rows of a batch), `global_loss` (the
loss and its count over the ranks), `model_checks` (what is checked of the model),
`function_init` (a user's `init=`), `step_output` (what a step returns)."""

from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.balancing import later_divisor, refuse_miscounted, step_tokens
from meshtrain.batch_rows import batch_rows, step_rows, take_rows
from meshtrain.comm import METRICS
from meshtrain.function_init import FunctionInit
from meshtrain.global_loss import global_mean, loss_inputs, say_how_the_loss_is_weighted
from meshtrain.loss_terms import LossTerms, accepts_loss_kwargs, cross_entropy
from meshtrain.mesh import Mesh
from meshtrain.model_checks import check_layout, check_same_weights, first_nonfinite, tied_names
from meshtrain.optim import OptimizerFactory, clip_grads_, divide_, grad_norm
from meshtrain.parallel.compose import Parallelized, parallelize as apply_strategies, set_micro_shape
from meshtrain.parallel.context import gather_sequence, shard_sequence
from meshtrain.parallel.expert_load import ExpertLoad, set_aux_scale
from meshtrain.parallel.compile import check_compilable, eager_while
from meshtrain.parallel.options import CompileOptions, Fp8Options, Strategies
from meshtrain.parallel.pipeline.stages import PipelinePlan
from meshtrain.parallel.tensor import TensorPlan
from meshtrain.parallel.token_mask import TokenMask
from meshtrain.replica_state import attach_replicas
from meshtrain.step_output import StepOutput


class Job:
    """A model parallelized on a mesh with its optimizer: `step` trains on a global batch,
    `forward` evaluates, `save`/`load` write and read the full state. `module` is this rank's
    part of the model (parameters under their full names), `optimizer` the user's optimizer
    (over fp32 masters under bf16; over ZeRO's pieces under ZeRO), `lr_scheduler` the one the
    factory made, `parallel` what the strategies built."""

    def __init__(self, parallel: Parallelized, mesh: Mesh, loss: LossTerms, options: Strategies,
                 pipeline: PipelinePlan | None, clip_grad_norm: float | None, lr_scheduler,
                 num_items: bool = False):
        self.parallel, self.mesh, self._loss, self.options, self._pipeline = parallel, mesh, loss, options, pipeline
        self.clip_grad_norm = clip_grad_norm
        self.optimizer = getattr(parallel.optimizer, "inner", parallel.optimizer)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.steps = 0  # optimizer steps taken (dropout masks are keyed by it)
        self._saver = None  # the background saver, made by the first `save(background=True)`
        self._expert_load = ExpertLoad(parallel.module, parallel.comm, options.sp, parallel.routers)  # a MoE's
        self._passes_num_items = num_items  # the model's forward takes num_items_in_batch
        self._miscount = None  # a counted loss's step count and its prediction, when a balancing loss used it
        self.stop_signal: Callable[[], bool] | None = None  # a poll (train's: a SIGTERM seen on this rank)
        self.stop_requested = False  # some rank's poll said so at the last update (read with its norm)
        self._token_mask = TokenMask(parallel.dropout_keys, mesh, options.sp)  # a MoE's balancing tokens
        self.replicas = None  # `meshtrain.replicas.ReplicaGroups`: gradients summed over live replica groups
        self.quorum = None  # and the step's quorum (`ReplicaGroups.begin_step`), set before each backward
        self._load_table = None  # under replica groups, a MoE's load table summed over them (`backward`)
        if loss.kind == "own":  # the model computes its loss in its forward: watched there
            parallel.loss_scope = loss.watching
        loss.row_share = 1 / mesh.size("cp")

    @property
    def module(self) -> nn.Module:
        return self.parallel.module

    # ---- training -----------------------------------------------------------------------

    def step(self, inputs, targets=None, *, rows: str = "global", check: bool = False,
             token_mask: torch.Tensor | None = None) -> StepOutput:
        """One optimizer step on a batch: `inputs` (a tensor, or a dict of the model's keyword
        arguments) and `targets` (None when the model returns its own loss). `rows="global"`:
        every rank passes the same global batch; `rows="local"`: each passes only its
        data-parallel share, `inputs[mesh.rows(global_batch_size)]` — checked across ranks on
        the first step and whenever `check=True` (an object gather over the world)."""
        loss = self.backward(inputs, targets, rows=rows, check=check, token_mask=token_mask)
        return self.update(loss)

    def begin_step(self) -> int:
        """The number (0-based) of the step to train next. Under replica groups (`init(ft=)`)
        it asks for the quorum of live groups first: a joining group takes a live one's state
        here, the number then its peer's; a step that was not committed is the same number
        again. A fault-tolerant loop is `while (k := job.begin_step()) < steps:
        job.step(*batch(k))`, `batch(k)` the global batch of step k (the live groups' rows of
        it are trained)."""
        if self.replicas is None:
            return self.steps
        if self.quorum is None and self.replicas.step == 0:  # before the first quorum: a loaded job's step
            self.replicas.set_step(self.steps)
        self.quorum = self.replicas.begin_step()
        self.steps = self.replicas.step
        return self.steps

    def backward(self, inputs, targets=None, *, rows: str = "global", meter=None,
                 check: bool = False, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The first half of `step`: forward and backward over this rank's micro-batches and
        the gradient sync, the gradients those of the global batch's mean; returns that mean
        (a 0-dim tensor on the device: nothing is read on the host). `update` is the second
        half. `token_mask` [rows, sequence] (rows as `inputs`'): for a mixture of experts,
        the positions its balancing loss counts (False: padding, as an attention mask says)."""
        p, mesh, m = self.parallel, self.mesh, self.options.microbatches
        if self.replicas is not None:  # the live groups' rows of the global batch
            if self.quorum is None:
                raise RuntimeError("replica groups: ask job.begin_step() for the step's number before each "
                                   "job.step (it forms the quorum of live groups, and heals a joining one)")
            live = batch_rows(inputs) // self.replicas.options.replicas * self.quorum.live
            inputs, targets = take_rows(inputs, slice(0, live)), take_rows(targets, slice(0, live))
            token_mask = take_rows(token_mask, slice(0, live))
        if isinstance(inputs, dict) and mesh.size("pp") > 1:
            raise ValueError("a batch dict under pipeline parallelism: pass inputs and targets tensors (the stages "
                             "send one tensor between them)")
        mine, offset, count = self._rows_of(inputs, targets, rows, check)
        micro = (mine.stop - mine.start) // m
        if self._pipeline is not None and mesh.size("pp") > 1:
            x = inputs[:micro]
            tokens = x.shape[1] // mesh.size("cp") if x.dim() > 1 else 1  # a cp rank sends its tokens only
            set_micro_shape(p, self._pipeline, micro, tokens, self.options.sp)
        extra = loss_inputs(self._loss, p, mesh, inputs, rows, self._passes_num_items)

        def micro_batch(i: int):
            at = slice(mine.start + i * micro, mine.start + (i + 1) * micro)
            if p.dropout_keys is not None:
                p.dropout_keys.start(self.steps, slice(offset + i * micro, offset + (i + 1) * micro))
            x, y = self._to_device(take_rows(inputs, at)), self._to_device(take_rows(targets, at), cast=False)
            if mesh.size("cp") > 1:  # this rank's tokens of every sequence
                x, y = self._sequence_shard(x), self._sequence_shard(y)
            return {**x, **extra} if extra else x, (micro if self._loss.kind == "own" else y)

        predicted = self._weigh_balancing(inputs, targets, rows, mine, offset, extra, token_mask) \
            if p.balancing else None
        with meter if meter is not None else nullcontext(), eager_while(meter is not None and p.compiled):
            total = p.runner.run(p, micro_batch, m, count)  # the command line's activation meter, eagerly
        if p.dropout_keys is not None:
            p.dropout_keys.settle()
        p.grad_sync.finish_grad_sync()
        loss, counted = global_mean(self._loss, p, total)
        grads = [t.grad for t in {id(t): t for t in p.trained if t.grad is not None}.values()]
        if counted is not None:  # the runner back-propagated sums: the gradients of the mean, once, before clipping
            if self.quorum is not None:  # the count of every live group's rows
                self.replicas.sum_([counted], self.steps + 1)
            divide_(grads, counted)
        if self.quorum is not None:  # each group's share of the live groups' mean: summed over them
            self._load_table = self._expert_load.step_table()  # a MoE's load: its routers' biases move from all groups'
            self.replicas.sum_([*grads, loss, *([self._load_table] if self._load_table is not None else [])],
                               self.steps + 1)
        if predicted is not None and self._loss.resolved == "counted":  # checked with the norm, in `update`
            self._miscount = torch.stack([counted.double(), predicted])
        if not self._loss.settled:  # the first step says how a watched loss is weighted
            say_how_the_loss_is_weighted(self._loss, p, mesh, inputs, targets)
        self._loss.settled = True
        return loss

    def update(self, loss: torch.Tensor) -> StepOutput:
        """The second half of `step`: clip, step the optimizer and the scheduler, zero the
        gradients. A step whose gradient norm is not finite is skipped, with a warning.
        Reading the norm to decide that is the step's one host sync (docs/host-syncs.md)."""
        p = self.parallel
        poll = None
        if self.stop_signal is not None:  # summed over the world in the norm's all-reduces
            poll = torch.tensor([float(self.stop_signal())], dtype=torch.float64, device=self.mesh.device)
        norm_t = grad_norm(p.trained, p.comm, world_sum=poll)
        also = [t for t in (poll, self._miscount) if t is not None]
        if also:  # read with the norm: one host sync still
            norm, *read = torch.cat([norm_t.double().reshape(1), *also]).tolist()
            if poll is not None:
                self.stop_requested, read = read[0] > 0, read[1:]
            if self._miscount is not None:
                self._miscount, (counted, predicted) = None, read
                if counted != predicted:
                    p.zero_grad()
                    refuse_miscounted(self._loss, counted, predicted)
        else:
            norm = norm_t.item()  # the skip decision: the host waits for the backward here
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        committed = self.replicas.commit() if self.quorum is not None else True  # torchft's vote, every step
        stepped, nonfinite = math.isfinite(norm) and committed, None
        if stepped:
            clip_grads_(p.trained, self.clip_grad_norm or 0.0, norm_t)
            p.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        elif committed:
            nonfinite = first_nonfinite(p)
            if self.mesh.is_main:
                print(f"meshtrain: warning: step {self.steps + 1}: the gradient norm is not finite "
                      f"(first: {nonfinite}); step skipped", file=sys.stderr)
        p.zero_grad()
        load, balance = self._expert_load.finish_step(stepped, self._load_table)  # the biases moved from the global load
        self._load_table = None
        self.quorum = None
        if committed:
            self.steps += 1
        return StepOutput(loss=loss, grad_norm=norm, lr=lr, stepped=stepped, nonfinite=nonfinite, expert_load=load,
                          balance_loss=balance if p.balancing else None, committed=committed)

    def _weigh_balancing(self, inputs, targets, rows: str, mine: slice, offset: int, extra: dict,
                         token_mask: torch.Tensor | None) -> torch.Tensor:
        """Set the MoE layers' balancing weight for the step (`balancing.py`): the gradient of
        a mean over the step's tokens (those `token_mask` keeps), whatever the loss; a pooled
        loss once per forward, as a plain loop's micro-batches add it. A watched loss not yet
        seen is first run once without gradients on this rank's first micro-batch, so that its
        division is known before the first backward. Returns the divisor predicted."""
        p, mesh = self.parallel, self.mesh
        if self._loss.watched and self._loss.resolved is None:
            self._resolve_loss(inputs, targets, mine, extra)
        divisor = later_divisor(self._loss, p.module, mesh, p.comm, inputs, targets, rows)
        mask = token_mask.to(mesh.device, torch.bool) if token_mask is not None else None
        self._token_mask.set_step(mask, offset if rows == "local" else 0)
        for layer in p.module.modules():
            if hasattr(layer, "token_mask"):
                layer.token_mask = self._token_mask.current if mask is not None else None
        tokens, forwards = step_tokens(inputs, rows, mesh, p.comm, mask), self.options.microbatches
        set_aux_scale(p.module, (p.loss_scale * divisor / tokens).float(), (1 / tokens).float(),
                      (p.loss_scale * divisor / forwards).float(), 1 / forwards)
        return divisor

    def _resolve_loss(self, inputs, targets, mine: slice, extra: dict) -> None:
        """Collective over pp: a watched loss's first call, on this rank's first micro-batch
        in evaluation mode, without gradients; every stage then knows how it resolved."""
        p, terms = self.parallel, self._loss
        self._evaluated_loss(inputs, targets, slice(mine.start, mine.start + (mine.stop - mine.start)
                                                    // self.options.microbatches), extra)
        seen = [s for s in p.comm.all_gather_object((terms.resolved, terms.counted_ignore_index), axis="pp")
                if s[0] is not None]
        terms.resolved, terms.counted_ignore_index = seen[0]
        terms.start_step(terms.num_items, self.mesh.device)  # what it counted is not the step's

    def _rows_of(self, inputs, targets, rows: str, check: bool = False) -> tuple[slice, int, object]:
        """(this rank's rows of what it was passed, where they start in the global batch, the
        global count of loss terms): `batch_rows.step_rows`."""
        share = self.quorum.share if self.quorum is not None else (0, 1)
        mine, offset, count = step_rows(self.mesh, self.parallel.comm, self._loss, self.options.microbatches, inputs,
                                        targets, batch_rows(inputs), rows, check, share)
        if self.quorum is not None and self._loss.kind == "sum" and not callable(self._loss.normalizer):
            count = count * self.quorum.live / self.replicas.options.replicas  # the global batch's, of the rows trained
        return mine, offset, count

    def _sequence_shard(self, batch):
        """Context parallelism: this cp rank's two chunks (head-tail) of every sequence of a
        [rows, seq, ...] tensor (or of each in a dict)."""
        if isinstance(batch, dict):
            return {k: self._sequence_shard(v) for k, v in batch.items()}
        if not torch.is_tensor(batch) or batch.dim() < 2:
            raise ValueError("context parallelism: inputs and targets must be [rows, sequence, ...] tensors")
        return shard_sequence(batch, self.mesh.coord("cp"), self.mesh.size("cp"))

    def _to_device(self, batch, cast: bool = True):
        """On this rank's device; floating tensors in the compute dtype (inputs only)."""
        if batch is None or isinstance(batch, int):
            return batch
        if isinstance(batch, dict):
            return {k: self._to_device(v, cast) for k, v in batch.items()}
        if not torch.is_tensor(batch):
            return batch
        if cast and batch.is_floating_point():
            return batch.to(self.mesh.device, dtype=self.parallel.compute_dtype)
        return batch.to(self.mesh.device)

    # ---- evaluation -----------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, inputs):
        """The model's output on `inputs` in evaluation mode (dropout off), without gradients.
        Under pipeline parallelism the output is on the last stage's ranks (None on the
        others); under a vocabulary-parallel head the logits are gathered whole over tp;
        under context parallelism each cp rank runs its tokens and the output is the whole
        sequence again, in its original order ([rows, sequence, ...] outputs)."""
        out = self._output(self._to_device(inputs))
        if out is None:
            return None
        if getattr(self.parallel, "vocab_sharded", False) and self.mesh.size("tp") > 1:
            out = self.parallel.comm.gather_along(out.contiguous(), "tp", out.dim() - 1, purpose=METRICS)
        if self.mesh.size("cp") > 1:
            if not torch.is_tensor(out) or out.dim() < 2:
                raise ValueError("job.forward under context parallelism gathers a [rows, sequence, ...] tensor "
                                 f"output; the model returned {type(out).__name__}")
            out = gather_sequence(out, self.parallel.comm)
        return out

    def evaluate(self, inputs, targets=None, *, rows: str = "global") -> float:
        """The mean loss of a batch (the global one, or with `rows="local"` this rank's share)
        in evaluation mode, forward only, in every layout, its terms counted as in `step`:
        held-out validation."""
        p = self.parallel
        mine, _, count = self._rows_of(inputs, targets, rows)
        extra = loss_inputs(self._loss, p, self.mesh, inputs, rows, self._passes_num_items)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        # fp8's scales are a forward's own: its forwards take the training micro-batches' rows
        m = self.options.microbatches if self.options.fp8 is not None else 1
        micro = (mine.stop - mine.start) // m
        for i in range(m):
            loss = self._evaluated_loss(inputs, targets, slice(mine.start + i * micro, mine.start + (i + 1) * micro),
                                        extra)
            if loss is not None:  # the last pipeline stage's ranks
                total += loss.double() / count
        return global_mean(self._loss, p, total)[0].item()

    def _evaluated_loss(self, inputs, targets, rows: slice, extra: dict) -> torch.Tensor | None:
        """The loss of the batch's `rows` in evaluation mode, without gradients, as the job's
        loss weighs it (None on pipeline stages but the last)."""
        p = self.parallel
        x = self._to_device(take_rows(inputs, rows))
        with torch.no_grad(), p.loss_scope():
            out = self._output({**x, **extra} if extra else x)
            if out is None:
                return None
            y = rows.stop - rows.start
            if self._loss.kind != "own":
                y = self._to_device(take_rows(targets, rows), cast=False)
                y = self._sequence_shard(y) if self.mesh.size("cp") > 1 else y
            return p.loss_fn(out, y)

    def _output(self, x):
        """The module's output in evaluation mode on this rank's tokens of `x` (on the
        device; its cp shard taken here); None on pipeline stages but the last. Compiled
        blocks run eagerly here: their graphs were traced with gradients on, and a forward
        without them would make dynamo compile every block again (docs/compile.md)."""
        if isinstance(x, dict) and self.mesh.size("pp") > 1:
            raise ValueError("a batch dict under pipeline parallelism; pass the input tensor")
        if self.mesh.size("cp") > 1:
            x = self._sequence_shard(x)
        module, was_training = self.module, self.module.training
        module.eval()
        try:
            with eager_while(self.parallel.compiled):
                if self.mesh.size("pp") > 1:  # each virtual stage in turn
                    seq = x.shape[1] if x.dim() > 1 else 1
                    seq = seq // self.mesh.size("tp") if self.options.sp else seq
                    return self.parallel.runner.forward_only(x, self._pipeline.activation_shape(x.shape[0], seq))
                return module(**x) if isinstance(x, dict) else module(x)
        finally:
            module.train(was_training)

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Collective: the full state ("model", "optim" by parameter name, "steps", and the
        scheduler's) on the mesh's rank 0 ({} of each elsewhere). "model" holds every name
        torch's `state_dict` has: a tied parameter (a head that is the embedding) under each
        of its names, the same tensor."""
        state = self.parallel.full_state_dict()
        model = state["model"]
        for part in self.parallel.comm.all_gather_object(tied_names(self.module)):  # every stage's ties
            model.update({alias: model[name] for alias, name in part.items() if name in model})
        state["steps"] = self.steps
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Every rank passes the full state (`state_dict`'s, or a plain model's `state_dict`
        under "model"); each keeps its part. A tied parameter is read under its first name,
        or under another of its names when that one is missing."""
        model = dict(state["model"])
        for alias, name in tied_names(self.module).items():
            if name not in model and alias in model:
                model[name] = model[alias]
        self.parallel.load_full_state_dict({**state, "model": model})
        self.steps = state.get("steps", 0)
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def save(self, directory, *, files=(), background: bool = False, then=None, pinned: bool | None = None,
             **meta) -> float:
        """Collective: a sharded checkpoint in `directory` (every rank writes what it owns;
        written whole or not at all; `checkpoint.sharded`). `meta`: JSON-able facts to keep
        beside the state (read back by `load`); `files`: paths copied in beside it (a tokenizer).
        `background`: return once the state is copied aside, and write it in a thread
        (`checkpoint.background`; `wait_for_saves` joins it, the next save waits for it), then
        run `then(comm)` there with the save's own communicator (a prune); the copy goes to one
        host arena per rank, `pinned` (None: when the state is on a GPU; False: pageable, for a
        host short of pinnable memory), fixed at the first background save. Returns the
        seconds the call blocked."""
        from meshtrain.checkpoint.sharded import save_checkpoint
        t0 = time.perf_counter()
        self.wait_for_saves()  # one save at a time: the previous one committed first
        if background and self._saver is None:
            from meshtrain.checkpoint.background import BackgroundSaver
            self._saver = BackgroundSaver(self.parallel.comm, pin=pinned)
        save_checkpoint(self.parallel, Path(directory), {**meta, "steps": self.steps}, files=files,
                        lr_scheduler=self.lr_scheduler, saver=self._saver if background else None, then=then)
        return time.perf_counter() - t0

    def wait_for_saves(self) -> None:
        """Collective: until a background save in flight is written and committed (its
        failure raised here, on every rank alike)."""
        if self._saver is not None:
            self._saver.wait()

    def load(self, directory, *, check: bool = True) -> dict:
        """Collective: the state `save` wrote, in any layout (each rank reads only the parts it
        keeps); returns the facts saved beside it. The folder's checksums are verified first
        unless `check=False` (the caller just did). Each optimizer group gets the
        hyper-parameters saved for its parameters' names, and the scheduler this rank's state
        (`sharded.lr_scheduler_state`)."""
        from meshtrain.checkpoint.sharded import load, load_checkpoint, lr_scheduler_state
        self.wait_for_saves()
        meta = (load_checkpoint if check else load)(self.parallel, Path(directory))
        self.steps = meta["steps"]
        scheduler = lr_scheduler_state(self.parallel, meta) if self.lr_scheduler is not None else None
        if scheduler is not None:
            self.lr_scheduler.load_state_dict(scheduler)
        return meta


def parallelize(model: nn.Module, mesh: Mesh, *, optimizer: OptimizerFactory, loss_fn=cross_entropy,
                loss_reduction: str = "mean", normalizer=None, zero: int = 0, precision: str = "fp32",
                grad_dtype: str | None = None, recompute: str = "none", sp: bool = False,
                tp_plan: TensorPlan | None = None, pipeline: PipelinePlan | None = None, schedule: str = "1f1b",
                chunks: int = 1, microbatches: int = 1, clip_grad_norm: float | None = None,
                lr_scheduler: Callable | None = None, wrap: list[str] | None = None, init=None,
                bucket_mb: float = 25.0, keep_gathered: bool = False, dp_linear_sync: str = "allreduce",
                stage_layers: list[int] | None = None, rows_per_step: int | None = None, strict_p2p: bool = False,
                sync_options: dict | None = None, cp_mode: str = "ring", compile: bool = False,
                compile_backend: str = "inductor", ep_max_load: float | None = None, fp8=None) -> Job:
    """Apply the strategies to `model` (in place) on `mesh` (`meshtrain.init`) and build the
    optimizer on what each rank holds.

    `model`: a plain module built alike on every rank (checked). `optimizer`: a factory
    called with (name, tensor) pairs — parameters, their shards or ZeRO's flat pieces, with
    full shapes through `meshtrain.full_shape` — returning a torch optimizer; under ZeRO or
    tp > 1 one that steps each element on its own (SGD, Adam, AdamW, ...). `loss_fn(output,
    targets)`: a mean over its terms (cross-entropy means are weighted by their non-ignored
    targets, other means by rows); None when the model's output carries `.loss`; with
    `loss_reduction="sum"`, a sum, divided by `normalizer` (a number or a function of the
    targets). `zero`: ZeRO stage 1-3 over dp (`wrap`: the modules stage 3 gathers one at a
    time; by default each child of the largest ModuleList or Sequential). `precision`:
    "fp32" or "bf16" (fp32 masters; `grad_dtype` "fp32" (default) or "compute").
    `recompute`: none | full | selective | segments[:K]. `tp_plan`: module names to styles
    (`meshtrain.TensorPlan`), with `sp` for sequence parallelism. `pipeline`: the parts
    before the blocks, the block list, the parts after (`meshtrain.PipelinePlan`), run by
    `schedule` with `chunks` per rank. `microbatches`: per data-parallel rank and step.
    `clip_grad_norm`: the global norm's bound. `lr_scheduler`: a factory taking the optimizer.
    `init`: for a model built on the meta device, `fn(name, tensor, generator)` that fills a
    parameter's full tensor in place (the generator is seeded from the mesh's seed and the
    name), so each rank draws only what it keeps.

    Finer controls: `bucket_mb` (data parallelism's buckets), `keep_gathered` (ZeRO-3 keeps
    a block gathered from forward to backward), `dp_linear_sync` ("allreduce", "allgather" or
    "auto" per linear layer, which needs `rows_per_step`: the rows a step gives each linear
    layer), `stage_layers` (blocks per virtual pipeline stage), `strict_p2p` (check pipeline
    transfers under NCCL's rules on gloo), `sync_options` (passed to the gradient
    synchroniser: the tests' probes). On a mesh with cp > 1 (context parallelism) every
    sequence is split over the cp ranks and attention runs by `cp_mode`: "ring" (keys and
    values around the ring) or "ulysses" (all-to-all to whole heads). `compile`: each block's
    forward compiled by `torch.compile` with `compile_backend` ("inductor", "aot_eager" or
    "eager"), in torchtitan's order (docs/compile.md); pass the plain model, not one
    `torch.compile` returned. `ep_max_load`: on a mesh with ep > 1, the most rows a rank's
    experts may receive in a MoE layer, as a multiple of the balanced share; a routing
    that would send more stops every rank alike with one line (`experts.LoadOverBound`)
    before the rows move. `fp8`: "tensorwise" or "rowwise" (or `meshtrain.Fp8Options`, with
    `emulate` and `min_features`): the linear layers in the block list run their matmuls in
    float8 on torchao's recipe, with whole tensors' scales under every layout (needs torchao:
    `pip install 'meshtrain[fp8]'`; docs/fp8.md)."""
    options = Strategies(zero=zero, precision=precision, grad_dtype=grad_dtype or "fp32", recompute=recompute,
                         sp=sp, schedule=schedule, chunks=chunks, microbatches=microbatches, bucket_mb=bucket_mb,
                         keep_gathered=keep_gathered, dp_linear_sync=dp_linear_sync,
                         stage_layers=tuple(stage_layers) if stage_layers else None, strict_p2p=strict_p2p,
                         cp_mode=cp_mode, compile=CompileOptions(compile_backend) if compile else None,
                         ep_max_load=ep_max_load, fp8=Fp8Options.of(fp8))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: {type(model).__name__} is not a torch.nn.Module")
    check_compilable(model, options.compile)
    if not isinstance(mesh, Mesh):
        raise TypeError("mesh: pass what meshtrain.init() returned")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError("lr_scheduler: pass a factory taking the optimizer, e.g. "
                        "`lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10)`")
    loss = LossTerms(loss_fn, loss_reduction, normalizer)
    check_layout(model, mesh, loss, tp_plan, pipeline, chunks, init)
    check_same_weights(model, mesh)
    if init is not None and not hasattr(init, "full_value"):  # a spec (InitSpec, hf.HFWeights) is used as is
        init = FunctionInit.of(model, init, mesh.seed)
    num_items = loss.kind == "own" and accepts_loss_kwargs(model)  # before a strategy wraps anything
    parallel = apply_strategies(model, mesh.comm, options, optimizer=optimizer, seed=mesh.seed, plan=tp_plan,
                                pipeline=pipeline, loss_fn=loss, wrap=wrap, init=init,
                                rows_per_step=rows_per_step, **(sync_options or {}))
    parallel.vocab_sharded = bool(tp_plan is not None and tp_plan.vocab_parallel_loss)
    job = Job(parallel, mesh, loss, options, pipeline, clip_grad_norm, lr_scheduler, num_items=num_items)
    if getattr(mesh, "ft", None) is not None:  # init(ft=...): one of R replica groups
        attach_replicas(job, mesh.ft)
    return job
