"""Tensor parallelism (Megatron-LM) and sequence parallelism (Korthikanti et al.), applied
to a plain model from outside by a plan.

A plan maps module names to styles. `apply_plan` replaces each named module by its parallel
twin, sharding the *full, seeded* weights, so every layout starts from the same model:

    COLUMN  nn.Linear split by output features: input whole, output sharded, no communication
    ROW     nn.Linear split by input features: input sharded, output summed over tp
            (all-reduce; under SP a reduce-scatter along the sequence), bias added after
    VOCAB   nn.Embedding split by vocabulary rows: masked lookup, then summed like ROW
    REGION  where activations enter a tensor-parallel region (attention, MLP, the head): the
            input is copied (identity forward, all-reduce of its gradient backward) — once
            per region, so q, k and v share it; under SP it is all-gathered along the
            sequence instead, and the column layers' saved input is kept as the local shard
            and gathered again in backward
    SEQUENCE under SP only: the module's output is cut to this rank's chunk of the sequence
            (the position embedding), so it matches the sharded residual stream
    SEQUENCE_SHARDED, HEAD_SHARDED   a dropout site whose input is this rank's chunk of the
            sequence (under SP) or its heads (under TP): it keeps that chunk of the full mask
    Fused(sections, unit)   COLUMN for a linear that computes several outputs in one (fused
            QKV: q, k, v; SwiGLU's gate and up): each section of its output is split over tp
            on its own, in multiples of `unit` (the head size: whole heads per rank)
    PARTIAL  a module left whole that each rank applies to its own heads only (Qwen3's per-head
            q/k RMSNorm): its parameters' gradients are summed over tp, with SP or without
    Heads(*attrs)   the module's attributes that count heads (`n_heads`, `n_kv_heads`),
            divided by tp on each rank, so the model's own `view(B, T, self.n_heads, hd)` and
            `split` read this rank's heads

Under SP every parameter the plan leaves whole (LayerNorms, row biases, positions) sees only
this rank's part of the sequence, so its gradient is summed over tp (`TensorParallelSync`).
Names stay those of the full model: a replaced module keeps its `weight` and `bias`."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.comm import Comm
from meshtrain.parallel.fp8 import linear
from meshtrain.parallel.modules import replace_submodule
from meshtrain.parallel.materialize import is_placeholder, placeholder
from meshtrain.parallel.dropout import SeededDropout
from meshtrain.parallel.recompute import is_recomputed
from meshtrain.parallel.state import SHARD, set_shard, shard_positions
from meshtrain.parallel.styles import (COLUMN, HEAD_SHARDED, PARTIAL, REGION, ROW, SEQUENCE,  # noqa: F401
                                       SEQUENCE_SHARDED, VOCAB, Fused, Heads, TensorPlan)

TP = "tp"
SEQ_DIM = 1  # activations are [batch, sequence, features]


# ---- the conjugate operators ---------------------------------------------------------------

def _conjugate(name: str, doc: str, forward, backward) -> type:
    """An autograd function running one tp collective forward and its conjugate on the
    gradient backward: `forward(x, comm)`, `backward(grad, comm)`."""

    def run_forward(ctx, x, comm):
        ctx.comm = comm
        return forward(x, comm)

    def run_backward(ctx, grad):
        return backward(grad, ctx.comm), None
    return type(name, (torch.autograd.Function,),
                {"__doc__": doc, "forward": staticmethod(run_forward), "backward": staticmethod(run_backward)})


def _identity(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over tp (in place on a contiguous copy when `x` is not contiguous)."""
    x = x.contiguous()
    comm.all_reduce(x, TP)
    return x


def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather along the sequence: [b, s/t, h] on each rank -> [b, s, h]."""
    return comm.gather_along(x, TP, SEQ_DIM)


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum over tp and keep this rank's chunk of the sequence: [b, s, h] -> [b, s/t, h]."""
    return comm.reduce_scatter_along(x, TP, SEQ_DIM)


_CopyToRegion = _conjugate("_CopyToRegion", "Identity forward; all-reduce of the gradient over tp backward "
                           "(Megatron's f).", _identity, _all_reduce)
_ReduceFromRegion = _conjugate("_ReduceFromRegion", "All-reduce over tp forward; identity backward (Megatron's g).",
                               _all_reduce, _identity)
_GatherSeq = _conjugate("_GatherSeq", "All-gather along the sequence forward; reduce-scatter of the gradient "
                        "backward.", _gather_seq, _reduce_scatter_seq)
_ReduceScatterSeq = _conjugate("_ReduceScatterSeq", "Reduce-scatter along the sequence forward; all-gather of "
                               "the gradient backward.", _reduce_scatter_seq, _gather_seq)


def _reduce_output(x: torch.Tensor, comm: Comm, sp: bool) -> torch.Tensor:
    """The end of a region: partial sums over tp made whole (or whole and sequence-sharded)."""
    return _ReduceScatterSeq.apply(x, comm) if sp else _ReduceFromRegion.apply(x, comm)


class _RegatherSaved:
    """Saved-tensor hooks for one SP region: a tensor saved for backward that is the gathered
    input (the column layers keep it for their weight gradients) is stored as the local
    shard, and gathered once more in backward, shared by every layer that saved it."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, comm: Comm):
        self._storage = full.untyped_storage().data_ptr()
        self.shard, self.comm = shard, comm
        self._pending, self._gathered = 0, None

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() != self._storage:
            return t
        self._pending += 1
        return (self, t.shape, t.stride(), t.storage_offset())

    def unpack(self, packed):
        if not isinstance(packed, tuple):
            return packed
        _, shape, stride, offset = packed
        if self._gathered is None:
            self._gathered = _gather_seq(self.shard.detach(), self.comm)
        full = self._gathered
        self._pending -= 1
        if self._pending == 0:
            self._gathered = None
        return full.as_strided(shape, stride, offset)


# ---- the parallel layers ---------------------------------------------------------------------

def _chunk(full: torch.Tensor, dim: int, comm: Comm) -> torch.Tensor:
    """This rank's contiguous 1/tp of `full` along `dim`, as a new parameter tensor."""
    n = full.shape[dim] // comm.mesh.size(TP)
    return _own_copy(full.detach().narrow(dim, comm.mesh.coord(TP) * n, n))


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy for a new parameter; a placeholder's copy is a placeholder (its values are drawn
    later, for this piece only: see parallel/materialize.py)."""
    return placeholder(t.shape, t.dtype, t.device) if is_placeholder(t) else t.clone()


class ColumnParallelLinear(nn.Module):
    """y_i = x A_iᵀ + b_i: rows of the weight (output features) and the bias split over tp
    (the matmul in float8 once `fp8` is set: `parallel/fp8.py`)."""

    fp8 = None

    def __init__(self, full: nn.Linear, comm: Comm):
        super().__init__()
        self.in_features, self.out_features = full.in_features, full.out_features // comm.mesh.size(TP)
        self.weight = nn.Parameter(_chunk(full.weight, 0, comm))
        set_shard(self.weight, TP, 0)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(_chunk(full.bias, 0, comm))
            set_shard(self.bias, TP, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8)


class FusedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear whose output is several outputs concatenated (`Fused`): rank
    r holds chunk r of each section, its output the concatenation of those chunks."""

    def __init__(self, full: nn.Linear, comm: Comm, style: Fused):
        nn.Module.__init__(self)
        size, coord = comm.mesh.size(TP), comm.mesh.coord(TP)
        self.in_features, self.out_features = full.in_features, full.out_features // size
        spec = (TP, 0, style.sections)
        rows = shard_positions(spec, self.out_features, coord, size)
        self.weight = nn.Parameter(_take_rows(full.weight, rows))
        set_shard(self.weight, TP, 0, style.sections)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(_take_rows(full.bias, rows))
            set_shard(self.bias, TP, 0, style.sections)


def _take_rows(full: torch.Tensor, rows: list[int]) -> torch.Tensor:
    shape = (len(rows), *full.shape[1:])
    return placeholder(shape, full.dtype, full.device) if is_placeholder(full) else full.detach()[rows].clone()


class RowParallelLinear(nn.Module):
    """y = Σ_i x_i B_iᵀ + b: columns of the weight (input features) split over tp; the
    partial products summed over tp (reduce-scattered along the sequence under SP); the
    bias, whole on every rank, added once after the sum."""

    fp8 = None  # the matmul's float8 casts (`parallel/fp8.py`)

    def __init__(self, full: nn.Linear, comm: Comm, sp: bool):
        super().__init__()
        self.comm, self.sp = comm, sp
        self.in_features, self.out_features = full.in_features // comm.mesh.size(TP), full.out_features
        self.weight = nn.Parameter(_chunk(full.weight, 1, comm))
        set_shard(self.weight, TP, 1)
        self.bias = nn.Parameter(_own_copy(full.bias.detach())) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _reduce_output(linear(x, self.weight, None, self.fp8), self.comm, self.sp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds 1/tp of the vocabulary's rows; ids outside its range look up zeros,
    and the sum over tp gives every id its row (reduce-scattered along the sequence under SP).
    The full embedding's padding row (`padding_idx`) gets no gradient from the lookup on the
    rank that holds it."""

    def __init__(self, full: nn.Embedding, comm: Comm, sp: bool):
        super().__init__()
        self.comm, self.sp = comm, sp
        self.num_embeddings = full.num_embeddings // comm.mesh.size(TP)
        self.start = comm.mesh.coord(TP) * self.num_embeddings
        self.padding_idx = _local_row(full.padding_idx, self.start, self.num_embeddings)
        self.weight = nn.Parameter(_chunk(full.weight, 0, comm))
        set_shard(self.weight, TP, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        return _reduce_output(out.masked_fill(outside.unsqueeze(-1), 0.0), self.comm, self.sp)


def _local_row(row: int | None, start: int, rows: int) -> int | None:
    """A full table's row among this rank's `rows` from `start`; None: not held here (or none)."""
    return row - start if row is not None and start <= row < start + rows else None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Σ over tokens of −log softmax(z)[target], with the logits z sharded over the
    vocabulary: three all-reduces of one number per token (the max, the target's logit, the
    sum of exponentials); no rank ever holds a [tokens × vocabulary] tensor."""

    @staticmethod
    def forward(ctx, logits, targets, comm, ignore_index):
        kept = targets != ignore_index  # an ignored target adds nothing, and no gradient
        targets = targets.masked_fill(~kept, 0)
        vocab_local = logits.shape[-1]
        start = comm.mesh.coord(TP) * vocab_local
        logits = logits.float()
        top = logits.max(dim=-1).values
        comm.all_reduce(top, TP, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        inside = (local >= 0) & (local < vocab_local)
        local = local.masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        comm.all_reduce(target_logit, TP)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, TP)
        probs = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, local, inside, kept)
        return ((sum_exp.log() - target_logit) * kept).sum()

    @staticmethod
    def backward(ctx, grad):
        probs, local, inside, kept = ctx.saved_tensors
        g = probs.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g.mul_(kept.to(g.dtype).unsqueeze(-1)).mul_(grad), None, None, None


def vocab_parallel_cross_entropy_sum(comm: Comm, ignore_index: int = -100):
    """The loss function for logits sharded over the vocabulary (the plan's head): the sum
    over the targets that are not `ignore_index`."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), comm,
                                                ignore_index)
    return loss


# ---- applying a plan --------------------------------------------------------------------------

def _enter_region(module: nn.Module, comm: Comm, sp: bool) -> None:
    """Make `module`'s input — its forward's first argument, passed by position or by name
    (transformers calls its attention by keywords only) — enter a tensor-parallel region
    (its forward is wrapped in place, so the module, its names and its parameters stay as
    they were)."""
    inner = module.forward
    first = next(iter(inspect.signature(inner).parameters))

    def enter(x):
        if not sp:
            return _CopyToRegion.apply(x, comm), nullcontext()
        full = _GatherSeq.apply(x, comm)
        if is_recomputed(module):  # the checkpoint keeps nothing inside; recomputing gathers again
            return full, nullcontext()
        saved = _RegatherSaved(full, x, comm)
        return full, torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)

    def forward(*args, **kwargs):
        if args:
            x, hooks = enter(args[0])
            args = (x, *args[1:])
        elif first in kwargs:
            x, hooks = enter(kwargs[first])
            kwargs = {**kwargs, first: x}
        else:
            raise TypeError(f"{type(module).__name__}: a tensor-parallel region enters through the forward's first "
                            f"argument, {first!r}, which this call did not pass")
        with hooks:
            return inner(*args, **kwargs)
    module.forward = forward


def _keep_sequence_chunk(module: nn.Module, comm: Comm) -> None:
    """Under SP: cut `module`'s output to this rank's chunk of the sequence (dimension −2)."""
    inner = module.forward

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        n = out.shape[-2] // comm.mesh.size(TP)
        return out.narrow(-2, comm.mesh.coord(TP) * n, n)
    module.forward = forward


def apply_plan(model: nn.Module, plan: TensorPlan, comm: Comm, sp: bool) -> list[nn.Parameter]:
    """Shard `model` in place by `plan` over the mesh's tp axis. Returns the parameters left
    whole whose gradients must be summed over tp (under SP: all of them; without SP those of
    PARTIAL modules only, as every rank computes the others from the same whole activations)."""
    builders = {COLUMN: lambda m: ColumnParallelLinear(m, comm), ROW: lambda m: RowParallelLinear(m, comm, sp),
                VOCAB: lambda m: VocabParallelEmbedding(m, comm, sp)}
    for name, module in list(model.named_modules()):
        styles = plan.styles_of(name)
        for style in styles:
            if isinstance(style, Fused):
                module = FusedColumnParallelLinear(module, comm, style)
                replace_submodule(model, name, module)
            elif isinstance(style, Heads):
                for attr in style.attrs:
                    setattr(module, attr, getattr(module, attr) // comm.mesh.size(TP))
            elif style in builders:
                module = builders[style](module)
                replace_submodule(model, name, module)
        if REGION in styles:
            _enter_region(module, comm, sp)
        if SEQUENCE in styles and sp:
            _keep_sequence_chunk(module, comm)
        if isinstance(module, SeededDropout) and (HEAD_SHARDED in styles or (SEQUENCE_SHARDED in styles and sp)):
            module.shard = (1, comm)  # the sequence of [b, s, h] and the heads of [b, heads, s, s]
    whole = [p for p in model.parameters() if not hasattr(p, SHARD)]
    partial = {id(p) for name, m in model.named_modules() if PARTIAL in plan.styles_of(name) for p in m.parameters()}
    return whole if sp else [p for p in whole if id(p) in partial]


def check_plan(model: nn.Module, plan: TensorPlan, tp: int) -> None:
    """Before anything is split: every pattern of `plan` names a module, every style fits its
    module (COLUMN, ROW, Fused on an nn.Linear, VOCAB on an nn.Embedding) and divides by `tp`,
    and no fused linear is marked plain COLUMN (a column layer with more outputs than the row
    layer beside it consumes is one: split plainly it would hand each rank a mix of q, k and
    v, or of gate and up, and train another model). One line per problem, naming it."""
    modules = dict(model.named_modules())
    for pattern in plan.styles:
        if not any(fnmatch(name, pattern) for name in modules):
            raise ValueError(f"tp_plan: {pattern!r} names no module of the model")
    for name, module in modules.items():
        for style in plan.styles_of(name):
            _check_style(name, module, style, tp)
    for name, module in modules.items():
        if COLUMN in plan.styles_of(name) and isinstance(module, nn.Linear):
            parent = name.rpartition(".")[0]
            for sibling, other in modules.items():
                if (sibling.rpartition(".")[0] == parent and sibling != name and ROW in plan.styles_of(sibling)
                        and isinstance(other, nn.Linear) and module.out_features > other.in_features):
                    raise ValueError(f"tp_plan: {name} is marked COLUMN but has {module.out_features} outputs where "
                                     f"{sibling} (ROW) takes {other.in_features}: a fused linear; mark it "
                                     f"Fused(sections=...) so each rank keeps its part of every section")


def _check_style(name: str, module: nn.Module, style, tp: int) -> None:
    where = f"tp_plan: {name} ({type(module).__name__})"
    if isinstance(style, Fused) or style in (COLUMN, ROW):
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{where} is marked {style!r}, which splits an nn.Linear")
        if isinstance(style, Fused):
            if sum(style.sections) != module.out_features:
                raise ValueError(f"{where}: Fused sections {style.sections} add up to {sum(style.sections)}, not "
                                 f"its {module.out_features} outputs")
            bad = [w for w in style.sections if w % (tp * style.unit)]
            if bad:
                raise ValueError(f"{where}: sections {bad} do not split into tp={tp} parts of whole units of "
                                 f"{style.unit}; use a tp that divides each section's heads")
        width = module.out_features if style == COLUMN else module.in_features
        if style in (COLUMN, ROW) and width % tp:
            raise ValueError(f"{where}: {width} {'outputs' if style == COLUMN else 'inputs'} do not split over "
                             f"tp={tp}")
    elif style == VOCAB:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where} is marked 'vocab', which splits an nn.Embedding")
        if module.num_embeddings % tp:
            raise ValueError(f"{where}: a vocabulary of {module.num_embeddings} does not split over tp={tp}; pad it "
                             f"to a multiple of {tp}")
    elif isinstance(style, Heads):
        for attr in style.attrs:
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                raise ValueError(f"{where}: Heads({attr!r}): the module has no integer attribute {attr!r}")
            if value % tp:
                raise ValueError(f"{where}: {attr}={value} heads do not split over tp={tp}; use a tp that divides it")
    elif style not in (REGION, SEQUENCE, SEQUENCE_SHARDED, HEAD_SHARDED, PARTIAL):
        raise ValueError(f"{where}: unknown style {style!r}")


class TensorParallelSync:
    """Sums over tp the gradients of the parameters that SP leaves whole (each rank computed
    them from its part of the sequence): one all-reduce of one flat buffer per step."""

    def __init__(self, params: list[nn.Parameter], comm: Comm):
        self.params, self.comm = params, comm

    def no_sync(self):
        return nullcontext()  # a sum: reducing once, after the last micro-batch, is enough

    def input_pass(self):
        return nullcontext()

    def weight_grad_ready(self, p, grad) -> None:
        pass  # the sum is taken where the gradients live, at the step's end

    def end_weight_pass(self) -> None:
        pass

    def finish_grad_sync(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, TP)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def reset(self) -> None:
        pass
