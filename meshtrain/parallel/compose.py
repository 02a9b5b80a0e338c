"""Strategies, applied from outside the model in one fixed order, written once here:
cut pipeline stages -> tensor-parallel plan -> activation checkpointing -> ZeRO/FSDP or
data-parallel gradient sync -> the optimizer, built on what comes out (on fp32 masters under
mixed precision, which casts the model to bf16 before everything else).
This version has pipeline, tensor (and sequence) and data parallelism (with linear layers
optionally synchronised by all-gathered rows), ZeRO 1-3 in place of plain data parallelism,
bf16 mixed precision and activation checkpointing.

`parallelize` is the one path from a plain `nn.Module`, a mesh (through its `Comm`) and a
layout to what a training loop drives, the `Parallelized` object: the CLI's loop and a
user's own loop go through it alike."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.loss import cross_entropy_sum
from meshtrain.parallel.modules import find_block_list
from meshtrain.parallel.expert_load import balancing_layers, expert_routers, pool_over_ranks, sum_sequences_over
from meshtrain.parallel.experts import apply_expert_parallel
from meshtrain.parallel.materialize import InitSpec, cast_keeping_state_fp32, materialize, to_placeholders
from meshtrain.optim import FULL_SHAPE, OptimizerFactory, check_optimizer, keep_grad_views, optimizer_from
from meshtrain.parallel.data import DataParallel
from meshtrain.parallel.dropout import DropoutKeys, FunctionalDropout, seed_dropout, split_over_cp
from meshtrain.parallel.fp8 import apply_fp8, fp8_layer_names, fp8_problem
from meshtrain.parallel.options import ConfigError, Strategies
from meshtrain.parallel.linear_gather import LinearGather, choose_linear_syncs
from meshtrain.parallel.pipeline.engine import PipelineRunner
from meshtrain.parallel.pipeline.schedules import schedule
from meshtrain.parallel.pipeline.stages import PipelinePlan, Stage
from meshtrain.parallel.precision import COMPUTE_DTYPES, MasterWeights, fp32_loss, grad_holder
from meshtrain.parallel.compile import compile_blocks
from meshtrain.parallel.context import apply_context_parallel
from meshtrain.parallel.recompute import apply_recompute
from meshtrain.parallel.runner import PlainRunner
from meshtrain.parallel.state_blocks import check_state_blocks
from meshtrain.parallel.state import (PIECE_BYTES, Entry, ParamHoldings, Piece, batches_of, full_shape, is_collector,
                                      persistent_buffers, shard_index)
from meshtrain.parallel.tensor import TensorParallelSync, TensorPlan, apply_plan, vocab_parallel_cross_entropy_sum
from meshtrain.parallel.zero import Zero
from meshtrain.parallel.zero_holdings import SplitHoldings, ZeroHoldings


class GradSyncs:
    """Several gradient synchronisers driven as one (data-parallel buckets over dp, then the
    sum over tp of what sequence parallelism leaves whole)."""

    def __init__(self, *syncs):
        self.syncs = syncs

    def no_sync(self):
        return self._entered("no_sync")

    def input_pass(self):
        return self._entered("input_pass")

    @contextmanager
    def _entered(self, context: str):
        """Every synchroniser's context manager `context`, entered together."""
        with ExitStack() as stack:
            for s in self.syncs:
                stack.enter_context(getattr(s, context)())
            yield

    def weight_grad_ready(self, p, grad) -> None:
        for s in self.syncs:
            if not hasattr(s, "owns") or s.owns(p):  # each parameter's gradient goes to its own synchroniser
                s.weight_grad_ready(p, grad)

    def end_weight_pass(self) -> None:
        for s in self.syncs:
            s.end_weight_pass()

    def finish_grad_sync(self) -> None:
        for s in self.syncs:
            s.finish_grad_sync()

    def reset(self) -> None:
        for s in self.syncs:
            s.reset()


@dataclass
class Parallelized:
    """What the training loop drives. `module` is called for forward; `loss_fn(output,
    targets)` gives the summed loss; `grad_sync` makes gradients whole (`no_sync`,
    `finish_grad_sync`, `reset`); `optimizer` was built after sharding; `runner` runs one
    rank's micro-batches; `n_params` counts the full model; `holdings` says what this rank
    holds of each tensor (its parameters, or ZeRO's flat shards). Gradients are scaled by
    `loss_scale` (a peer that averages over ranks, like torch DDP, needs dp).

    The `full_*` methods are collective: every rank calls them, and each returns the
    full-shape tensors (gathered over the axes they are split on) as one process would hold
    them, as CPU copies."""
    module: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_sync: object
    optimizer: torch.optim.Optimizer
    runner: PlainRunner | PipelineRunner
    comm: Comm
    n_params: int
    loss_scale: float = 1.0
    dropout_keys: DropoutKeys | None = None  # set before each micro-batch's forward
    holdings: object = None  # ParamHoldings unless a strategy (ZeRO) says otherwise
    compute_dtype: torch.dtype = torch.float32  # floating inputs are cast to it (bf16 under mixed precision)
    notes: list[str] = field(default_factory=list)  # what the strategies decided, to say once at start
    compiled: bool = False  # each block's forward compiled (`parallel/compile.py`)
    build_peak_bytes: int | None = None  # the most this rank held while it built its part (train.setup)
    # a mixture of experts' routers in the whole model (name -> experts), read before a pipeline cut
    routers: dict[str, int] = field(default_factory=dict)
    balancing: int = 0  # the whole model's layers adding a balancing loss, counted before a pipeline cut
    # what a micro-batch's forward and loss run inside (a model computing its own loss: the
    # job's count of its terms, `loss_terms.LossTerms.watching`)
    loss_scope: Callable[[], AbstractContextManager] = nullcontext

    def forward_scope(self) -> AbstractContextManager:
        """What every training forward runs inside: the mode keying functional dropout."""
        return self.dropout_keys.scope() if self.dropout_keys is not None else nullcontext()

    def __post_init__(self):
        if self.holdings is None:
            self.holdings = ParamHoldings(self.module, self.optimizer, self.comm)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's module parameters under the full model's names (wrappers add no prefix)."""
        return list(self.module.named_parameters())

    @property
    def trained(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps: the parameters, or ZeRO's pieces of them."""
        return self.holdings.trained()

    def zero_grad(self) -> None:
        self.holdings.zero_grad()

    def model_state_bytes(self) -> dict:
        """Parameters, gradients, master weights, optimizer states (and gathered buffers) held here."""
        return self.holdings.state_bytes()

    def full_state_dict(self, with_optimizer: bool = True) -> dict:
        """Collective: {"model": weights (and buffers) by name, "optim": each parameter's
        optimizer state by name (left empty without `with_optimizer`)}, at full shape on the
        CPU of the mesh's rank 0; {} of both elsewhere. Tensors move one at a time, only to
        rank 0 (`to_main`)."""
        optim: dict[str, dict] = {}
        for (name, key), t in (self.to_main("optim") if with_optimizer else {}).items():
            optim.setdefault(name, {})[key] = t
        return {"model": {name: t for (name, _), t in self.to_main("model").items()}, "optim": optim}

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's gradient at full shape, as synchronised, on rank 0
        ({} elsewhere)."""
        return {name: t for (name, _), t in self.to_main("grads").items()}

    def to_main(self, kind: str) -> dict[tuple[str, str | None], torch.Tensor]:
        """Collective: the full tensors of `kind` ("model", "grads", "optim") by (name, state
        key), on rank 0's CPU (`stream_to_main`, kept): rank 0 holds the state it returns, so
        the small tensors move a batch of up to `PIECE_BYTES` at a time, not one message each."""
        entries = self.entries_of(kind)
        largest = max((math.prod(e.shape) * e.dtype.itemsize for stage in entries for e in stage), default=0)
        # A stage that forwards a batch holds it gathered, the message and a tensor: half the
        # largest tensor a batch keeps that within the two tensors a gather may hold.
        batch = min(PIECE_BYTES, largest // 2)
        return {(entry.name, entry.key): full for entry, full in self.stream_to_main(kind, entries, batch_bytes=batch)
                if full is not None}

    def entries_of(self, kind: str) -> list[list[Entry]]:
        """Collective over pp: each stage's entries of `kind` (names, shapes, dtypes), in the
        order `stream_to_main` moves them."""
        return self.comm.all_gather_object(self.holdings.entries(kind), axis="pp")

    def stream_to_main(self, kind: str, entries: list[list[Entry]],
                       batch_bytes: int = 0) -> Iterator[tuple[Entry, torch.Tensor | None]]:
        """Collective, to be run to its end on every rank: (entry, its full tensor) one at a
        time, the tensor on rank 0's CPU (None on the other ranks). Each stage assembles one
        tensor at a time on its collector (dp and tp coordinate 0; `holdings.stream`), which
        sends it to rank 0 and lets it go before the next: no rank holds more than one full
        tensor, nor does rank 0 unless its consumer keeps them. Only the entries' names,
        shapes and dtypes went to every stage (`entries_of`, objects over pp). With
        `batch_bytes`, consecutive small tensors are assembled and sent together, up to that
        many bytes a message (`state.batches_of`): for a consumer that keeps them all."""
        mesh, stage = self.comm.mesh, self.comm.mesh.coord("pp")
        collector = is_collector(self.comm)
        for s in range(mesh.size("pp")):
            if s == stage:
                stream = self.holdings.stream(kind, batch_bytes)
                if not collector or s == 0:
                    for entry, full in stream:
                        yield entry, full if collector else None
                    continue
                for run in batches_of(entries[s], batch_bytes):
                    if len(run) == 1:
                        flat = next(stream)[1].to(mesh.device)
                    else:  # each tensor copied into the message as it comes, and let go
                        sizes = [math.prod(entries[s][i].shape) for i in run]
                        flat = torch.empty(sum(sizes), dtype=entries[s][run[0]].dtype, device=mesh.device)
                        for into in flat.split(sizes):
                            full = next(stream)[1]
                            into.copy_(full.reshape(-1))
                            del full
                    for work in self.comm.exchange([(True, flat, -s, 0)], "pp", purpose=METRICS):
                        work.wait()
                    del flat
                    for i in run:
                        yield entries[s][i], None
                if list(stream):  # run to its end (a ZeRO stream starts with a collective, entries or none)
                    raise RuntimeError(f"stage {s} streamed more {kind} tensors than its entries name")
            elif stage == 0 and collector:
                for run in batches_of(entries[s], batch_bytes):
                    run_entries = [entries[s][i] for i in run]
                    sizes = [math.prod(e.shape) for e in run_entries]
                    into = torch.empty(sum(sizes), dtype=run_entries[0].dtype, device=mesh.device)
                    for work in self.comm.exchange([(False, into, s, 0)], "pp", purpose=METRICS):
                        work.wait()
                    received = into.to("cpu")
                    del into
                    for entry, piece in zip(run_entries, received.split(sizes)):
                        yield entry, piece.view(entry.shape).clone() if len(run) > 1 else piece.view(entry.shape)
                    del received

    def load_full_state_dict(self, state: dict) -> None:
        """Take weights and optimizer state from a full state (each rank keeps its part)."""
        self.holdings.load(state["model"], state.get("optim", {}))
        with torch.no_grad():
            for name, b in persistent_buffers(self.module):
                b.copy_(state["model"][name])

    def local_pieces(self) -> list[Piece]:
        """What this rank holds of each tensor. Every rank's piece must equal that part of
        the full state: replicas bit-identical, shards where they live (checked by verify)."""
        return self.holdings.pieces()


def parallelize(model: nn.Module, comm: Comm, options: Strategies, *, optimizer: OptimizerFactory, seed: int = 0,
                plan: TensorPlan | None = None, pipeline: PipelinePlan | None = None,
                micro_shape: tuple[int, int] | None = None, loss_fn=cross_entropy_sum, rows_per_step: int | None = None,
                init: InitSpec | None = None, wrap: list[str] | None = None, **dp_options) -> Parallelized:
    """Apply the strategies `options` to `model` on `comm`'s mesh (in place; it must hold the
    full weights, the same on every rank — or, with `init`, be built on the `meta` device:
    each rank then draws only what it holds, after the strategies have cut and sharded the
    structure) and build the optimizer on the result with `optimizer` (a factory given
    (name, tensor) pairs, full shapes through `optim.full_shape`). Tensor parallelism needs
    the model's `plan` (module names to styles); pipeline parallelism its `pipeline` (the
    parts before, the block list, the parts after) and, to size its transfers, `micro_shape`
    (rows of a micro-batch, sequence length; set later with `set_micro_shape` when None).
    `loss_fn(output, targets)` returns the micro-batch's summed loss; `seed` keys the dropout
    masks; `rows_per_step`: the rows a step's global batch gives each linear layer (its
    tokens), for `dp_linear_sync="auto"`'s byte counts. `wrap`: the modules ZeRO-3 gathers
    one at a time (FSDP2-style); by default each child of the block list."""
    mesh, factory = comm.mesh, optimizer
    routers = expert_routers(model)  # before a pipeline cut: every stage knows them all
    balancing = balancing_layers(model)
    ignore_index = getattr(loss_fn, "ignore_index", -100)  # the target a vocabulary-parallel loss skips
    n_params = sum(p.numel() for p in model.parameters())
    # The linear layers fp8 converts, chosen on the plain model: the same set in every layout.
    if options.fp8 is not None and (problem := fp8_problem(mesh.device, options.fp8.emulate)):
        raise ConfigError(problem)
    fp8_names = fp8_layer_names(model, options.fp8, pipeline.blocks if pipeline is not None else None, routers) \
        if options.fp8 is not None else []
    check_optimizer(factory, model, elementwise=bool(options.zero and mesh.size("dp") > 1) or mesh.size("tp") > 1)
    # Mixed precision first: every strategy below then holds, sends and shards bf16 tensors.
    compute_dtype = COMPUTE_DTYPES[options.precision]
    if compute_dtype != torch.float32:
        cast_keeping_state_fp32(model, compute_dtype)
        loss_fn = fp32_loss(loss_fn)
    if init is not None:  # parameters without storage until this rank's part is drawn
        to_placeholders(model, mesh.device)
    # Dropout masks from (seed, step, sample, site), so that every layout drops the same
    # elements: nn.Dropout modules replaced, functional calls keyed by a mode over the
    # training forwards (until the first step shows there are none; compiled blocks keep it).
    keys = DropoutKeys(seed, compiled=options.compile is not None)
    seed_dropout(model, keys)
    keys.functional = partial(FunctionalDropout, keys, {id(m): (n, m) for n, m in model.named_modules()},
                              mesh.size("tp"), mesh.size("cp"), mesh.coord("cp"))
    runner = PlainRunner()
    if mesh.size("pp") > 1:
        if pipeline is None:
            raise ValueError("pipeline parallelism needs a pipeline plan for this model (before, blocks, after)")
        stage = Stage(model, pipeline, mesh.coord("pp"), mesh.size("pp"), options.chunks,
                      list(options.stage_layers) if options.stage_layers else None)
        lists = schedule(options.schedule, mesh.size("pp"), options.microbatches, options.chunks)
        dtype = next(model.parameters()).dtype
        runner = PipelineRunner(stage, lists[mesh.coord("pp")], comm, None, dtype, strict_p2p=options.strict_p2p)
    whole = []  # parameters that sequence parallelism leaves whole: their gradients are summed over tp
    if mesh.size("tp") > 1:
        if plan is None:
            raise ValueError("tensor parallelism needs a plan for this model (module names to styles)")
        whole = apply_plan(model, plan, comm, sp=options.sp)
        if plan.vocab_parallel_loss:  # a cross-entropy (the caller checks), over logits sharded by vocabulary
            loss_fn = vocab_parallel_cross_entropy_sum(comm, ignore_index=ignore_index)
    # Context parallelism: attention by the ring, positions global (before recompute, so
    # that a recomputed block runs the ring again).
    if mesh.size("cp") > 1:
        split_over_cp(model, mesh.coord("cp"), mesh.size("cp"))
        apply_context_parallel(model, comm, options.cp_mode)
    # A mixture of experts' balancing loss sums each row's counts over the ranks holding its tokens.
    sum_sequences_over(model, comm, ("cp",) + (("tp",) if options.sp else ()))
    pool_over_ranks(model, comm, options.sp, options.microbatches)
    # Expert parallelism: each rank keeps its E/ep experts; tokens travel to them.
    experts = []
    if mesh.size("ep") > 1:
        experts = apply_expert_parallel(model, comm, split_tp=mesh.size("tp") > 1 and not options.sp,
                                        max_load=options.ep_max_load)
        mine = {id(q) for q in model.parameters()}
        whole = [q for q in whole if id(q) in mine]  # the experts it replaced are summed over edp instead
    # FP8: the chosen linear layers' matmuls in float8, with the scales of whole tensors over
    # the axes that split them (after tensor, context and expert parallelism made the parts).
    if options.fp8 is not None:
        apply_fp8(model, fp8_names, options.fp8, comm, sp=options.sp)
    # A low-bit optimizer's blocks: each tensor-parallel or expert shard whole blocks of its tensor.
    if getattr(factory, "state_block", None):
        check_state_blocks(model, factory.state_block, comm)
    # Zero-bubble: the stage's linear layers (as the plan made them) keep their weight
    # gradients for the weight pass.
    if mesh.size("pp") > 1 and options.schedule == "zb":
        runner.split_backward()
    # The blocks as cut into stages and sharded above, in runs of consecutive ones.
    if options.recompute != "none" or options.compile is not None:
        if mesh.size("pp") > 1:
            runs = [[stage.blocks._modules[str(i)] for i in ids] for ids in stage.block_ids]
        else:
            runs = [list(find_block_list(model, pipeline.blocks if pipeline is not None else None)[1])]
    # Each block's forward compiled (torchtitan's order: after TP, before checkpointing and
    # ZeRO, whose hooks then run eagerly around it).
    if options.compile is not None:
        compile_blocks([b for run in runs for b in run], options.compile)
    # Activation checkpointing.
    if options.recompute != "none":
        # (an MLP in row chunks would give fp8 two scales where one process has one)
        apply_recompute(runs, options.recompute, keys, mlp_chunks=options.compile is None and options.fp8 is None)
    # Gradients in the compute dtype, or (grad_dtype fp32) in fp32 buffers apart from the
    # bf16 tensors, which the fp32 masters then hold as their `.grad`.
    grad_dtype = torch.float32 if options.grad_dtype == "fp32" else compute_dtype
    zero_sharded = options.zero and mesh.size("dp") > 1
    expert_sync = None
    draw, fingerprint = None, None
    if init is not None:
        draw, fingerprint = partial(_draw_piece, init, comm), init.fingerprint()
        if not zero_sharded:  # ZeRO draws each group's part as it builds it
            materialize(model, draw)
    notes = []
    linear = _linear_gather(model, comm, options, rows_per_step, grad_dtype, compute_dtype, notes)
    zero, zeros = None, []
    # Under expert parallelism the experts' chunks are synchronised (and sharded) over their
    # own replicas (edp), apart from the rest over dp.
    owned = {id(q) for q in experts}
    dense = [(n, q) for n, q in model.named_parameters() if id(q) not in owned]
    expert_named = [(n, q) for n, q in model.named_parameters() if id(q) in owned]
    if zero_sharded:  # ZeRO with one dp rank has nothing to shard: plain DP
        chunks = [len(ids) for ids in stage.block_ids] if mesh.size("pp") > 1 else None
        shared = dict(bucket_mb=options.bucket_mb, grad_dtype=grad_dtype, reshard_after_forward=not options.keep_gathered,
                      blocks=wrap or (pipeline.blocks if pipeline is not None else None), draw=draw,
                      init_fingerprint=fingerprint, align=getattr(factory, "state_block", None) or 1)
        sync = zero = Zero(model, comm, options.zero, runs=chunks, params=dense, **shared, **dp_options)
        zeros = [zero]
        if experts:
            runs = _runs_holding(stage, owned) if mesh.size("pp") > 1 else None
            expert_sync = Zero(model, comm, options.zero, axis="edp", runs=runs, params=expert_named, **shared)
            zeros.append(expert_sync)
        if options.zero == 3 and isinstance(runner, PipelineRunner):
            runner.upcoming = partial(_expect_all, zeros)  # prefetch what the stage's next instruction runs first
        if draw is not None:  # any parameter ZeRO does not train
            materialize(model, draw)
        trained = [(name, value) for z in zeros for name, value, _, _ in z.pieces]
    else:
        sync = DataParallel(model, comm, axis="dp", bucket_mb=options.bucket_mb, grad_dtype=grad_dtype,
                            elsewhere=linear.params if linear else [], init_fingerprint=fingerprint, params=dense,
                            **dp_options)
        if experts:  # each chunk of experts summed over its own replicas
            expert_sync = DataParallel(model, comm, axis="edp", bucket_mb=options.bucket_mb, grad_dtype=grad_dtype,
                                       init_fingerprint=fingerprint, params=expert_named)
        trained = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    mark_full_shapes(model, trained, comm)
    zero_grads = partial(_zero_grads, zeros)
    if compute_dtype == torch.float32:
        optimizer = optimizer_from(factory, trained)
        if zero is not None:
            keep_grad_views(optimizer, zero_grads)
    else:  # fp32 masters; they hold the gradients too when those live apart in fp32
        grads = None
        if grad_dtype != compute_dtype:
            owners = [s for s in (linear, expert_sync) if s is not None] + [sync]
            grads = {t: g for z in zeros for t, g in z.piece_grads.items()} if zero is not None else {
                t: next(s for s in owners if s.owns(t)).grad_view(t) for _, t in trained}
        optimizer = MasterWeights(trained, partial(optimizer_from, factory), grads=grads,
                                  zero_buffers=zero_grads if zero is not None else None)
    holdings = None
    if zero is not None:
        if options.zero < 3:
            for z in zeros:
                optimizer.register_step_post_hook(lambda *_, z=z: z.gather_params())
        holdings = ZeroHoldings(model, optimizer, comm, zero, params=dense)
        if len(zeros) > 1:
            holdings = SplitHoldings([holdings, ZeroHoldings(model, optimizer, comm, zeros[1], params=expert_named,
                                                             buffers=False)])
    syncs = [sync] + [s for s in (linear, expert_sync) if s is not None]
    if whole:  # summed over tp wherever their gradients live
        tensors = zero.pieces_of(whole) if zero is not None else whole
        syncs.append(TensorParallelSync([grad_holder(optimizer, t) for t in tensors], comm))
    grad_sync = syncs[0] if len(syncs) == 1 else GradSyncs(*syncs)
    p = Parallelized(model, loss_fn, grad_sync, optimizer, runner, comm, n_params, dropout_keys=keys,
                        holdings=holdings, compute_dtype=compute_dtype, notes=notes,
                        compiled=options.compile is not None, routers=routers, balancing=balancing)
    if micro_shape is not None:
        set_micro_shape(p, pipeline, *micro_shape, options.sp)
    return p


def _zero_grads(zeros: list[Zero]) -> None:
    for z in zeros:
        z.zero_grad()


def _expect_all(zeros: list[Zero], upcoming) -> None:
    for z in zeros:
        z.expect(upcoming)


def _runs_holding(stage: Stage, owned: set[int]) -> list[int]:
    """Per chunk of a pipeline stage, how many of its blocks hold parameters in `owned` (the
    experts' ZeRO-3 units)."""
    def holds(i: int) -> bool:
        return any(id(q) in owned for q in stage.blocks._modules[str(i)].parameters())
    return [sum(holds(i) for i in ids) for ids in stage.block_ids]


def mark_full_shapes(model: nn.Module, trained: list[tuple[str, torch.Tensor]], comm: Comm) -> None:
    """Give every tensor the optimizer will step (a parameter, a shard, a ZeRO piece) the full
    shape of its parameter (`optim.full_shape`), for the user's optimizer factory."""
    params = dict(model.named_parameters())
    for name, t in trained:
        if not hasattr(t, FULL_SHAPE):  # ZeRO's pieces have theirs
            setattr(t, FULL_SHAPE, full_shape(params[name], comm))


def set_micro_shape(p: "Parallelized", pipeline: PipelinePlan, rows: int, seq: int, sp: bool) -> None:
    """Size a pipeline's transfers for micro-batches of `rows` samples of `seq` positions
    (under sequence parallelism each rank sends its 1/tp of the sequence)."""
    if isinstance(p.runner, PipelineRunner):
        tp = p.comm.mesh.size("tp")
        p.runner.activation_shape = pipeline.activation_shape(rows, seq // tp if sp else seq)


def _draw_piece(init: InitSpec, comm: Comm, name: str, p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of parameter `name` (`p`: its placeholder, tensor-parallel shard spec
    and all): the full one-process value drawn, sliced, cast and moved — one at a time. A
    spec that can read a piece alone (`piece(name, index)`: a weight file's slices) is asked."""
    index = shard_index(p, comm)
    if hasattr(init, "piece"):
        piece = init.piece(name, index)
    else:
        full = init.full_value(name)
        piece = full[index] if index is not None else full
    return torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(piece)


def _linear_gather(model: nn.Module, comm: Comm, options: Strategies, rows: int | None, grad_dtype: torch.dtype,
                   compute_dtype: torch.dtype, notes: list[str]) -> LinearGather | None:
    """The linear layers `dp_linear_sync` puts on the all-gather path, and their
    synchroniser (None when none is). The choice of each layer goes into `notes`."""
    mode, n = options.dp_linear_sync, comm.mesh.size("dp")
    if mode == "allreduce" or n == 1:
        return None
    if rows is None:
        raise ValueError(f"dp_linear_sync={mode!r} needs the rows a step gives each linear layer (rows_per_step)")
    if options.zero or comm.mesh.size("tp") > 1 or comm.mesh.size("pp") > 1:
        if mode == "allgather":
            raise ValueError("--dp-linear-sync allgather is built for plain data parallelism, not with ZeRO, "
                             "tensor or pipeline parallelism")
        notes.append("--dp-linear-sync auto: every linear layer all-reduces (the all-gather path is built for "
                     "plain data parallelism only)")
        return None
    size = torch.tensor([], dtype=grad_dtype).element_size()
    choices = choose_linear_syncs(model, mode, rows, n, grad_size=size,
                                  activation_size=torch.tensor([], dtype=compute_dtype).element_size())
    notes.extend(f"--dp-linear-sync {mode}: {c.describe()}" for c in choices)
    if all(c.sync == "allreduce" for c in choices):
        return None
    return LinearGather(model, comm, choices, grad_dtype=grad_dtype)
