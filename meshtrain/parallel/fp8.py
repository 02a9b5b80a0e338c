"""FP8 matmuls for the blocks' linear layers, on torchao's float8 training recipes.

A converted layer's three matmuls (forward, input gradient, weight gradient) take their
operands cast to float8 by torchao (`Float8LinearConfig.from_recipe_name`: "tensorwise",
one scale per tensor, e4m3 forward and e5m2 gradients; "rowwise", a power-of-two scale per
row, e4m3 throughout), and torchao's `Float8TrainingTensor` runs them (`torch._scaled_mm`
on a GPU with fp8, or torchao's emulation: the same numerics in the high precision).

What meshtrain adds is where the scales come from. A scale is the operand's amax over the
dimensions it spans (all of them tensorwise, the row's rowwise); under tensor parallelism an
operand is a shard (a column layer's weight rows and output gradient, a row layer's weight
columns and input) and under context parallelism the tokens are split, so each amax is
reduced (MAX) over the mesh axes that split the dimensions it spans — the whole tensor's
scale, as one process computes it. So a layout equals one process that runs the same
micro-batches: over data parallelism and micro-batches the scales stay those of each
micro-batch, as they are by nature (docs/verify.md).

Which layers: `fp8_layer_names`, decided on the plain model (the same set in every layout):
the `nn.Linear`s inside the block list (the embedding and the head are outside it), not in a
mixture of experts' router (its scores choose the experts), with both sides multiples of 16
(what fp8 matmuls take) and at least `min_features` (smaller ones lose to their casts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.parallel.modules import find_block_list, replace_submodule
from meshtrain.parallel.options import ConfigError, Fp8Options
from meshtrain.parallel.state import SHARD
from meshtrain.torchao_import import import_torchao

FP8_ALIGN = 16  # both sides of an fp8 matmul's operands are multiples of this (torch._scaled_mm)
PURPOSE = "fp8"  # the scales' all-reduces, counted apart from each axis's traffic


@lru_cache(maxsize=None)
def torchao_float8() -> dict:
    """torchao's float8 modules (imported once, quietly; ImportError naming the extra)."""
    config, linear, tensor, utils = import_torchao("torchao.float8.config", "torchao.float8.float8_linear",
                                                   "torchao.float8.float8_training_tensor",
                                                   "torchao.float8.float8_utils")
    return dict(config=config, linear=linear, tensor=tensor, utils=utils)


def fp8_problem(device: torch.device, emulate: bool) -> str | None:
    """Why fp8 matmuls cannot run on `device` unless emulated (one line), or None."""
    if emulate:
        return None
    if device.type != "cuda":
        return (f"--fp8: the {device.type.upper()} has no fp8 matmul; add --fp8-emulate (Fp8Options(emulate=True)) "
                "to run torchao's emulation (the same numerics, 2.5-4× an fp32 step)")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"--fp8: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no fp8 "
                "matmul (it needs 8.9: Ada, Hopper or later); add --fp8-emulate (Fp8Options(emulate=True)), or train in "
                "bf16")
    return None


# ---- which layers --------------------------------------------------------------------------

def fp8_layer_names(model: nn.Module, options: Fp8Options, blocks: str | None = None,
                    routers=()) -> list[str]:
    """The linear layers `options` converts, by name, on the plain model (see the module's
    docstring); `ConfigError` (one line) when none qualifies."""
    prefix, block_list = find_block_list(model, blocks)
    inside = [(f"{prefix}.{n}" if prefix else n, m) for n, m in block_list.named_modules()]
    linears = [(n, m) for n, m in inside if isinstance(m, nn.Linear)
               and not any(n == r or n.startswith(r + ".") for r in routers)]
    chosen = [n for n, m in linears if _qualifies(m.in_features, m.out_features, options.min_features)]
    if not chosen:
        sizes = sorted(((m.in_features, m.out_features) for _, m in linears), key=lambda s: (min(s), max(s)),
                       reverse=True)
        largest = f"the largest is {sizes[0][0]}×{sizes[0][1]}" if sizes else "its blocks hold no nn.Linear"
        raise ConfigError(f"--fp8: no linear layer in the model's blocks has both sides multiples of {FP8_ALIGN} and at "
                         f"least {options.min_features} features ({largest}); lower --fp8-min-features "
                         f"(fp8_min_features), or train without --fp8")
    return chosen


def _qualifies(n_in: int, n_out: int, least: int) -> bool:
    return n_in % FP8_ALIGN == 0 and n_out % FP8_ALIGN == 0 and min(n_in, n_out) >= least


# ---- the casts -----------------------------------------------------------------------------

# Each operand's dimensions, named by what splits them: x [tokens, in], wᵗ [in, out], g [tokens, out].
DIMS = {"x": ("tokens", "inputs"), "w_t": ("inputs", "outputs"), "g": ("tokens", "outputs")}


@dataclass(frozen=True)
class Split:
    """The mesh axes that split a converted layer's tokens, input and output features while
    its matmuls run (a column layer's outputs over tp, a row layer's inputs)."""
    tokens: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


class Fp8Casts:
    """One layer's casts to float8: torchao's recipe, and its scales reduced over `split`'s
    axes on `comm`. `audit`: a list (verify sets it at its sampled steps) that receives, for
    each cast whose scale did not come from the whole tensor, (layer, cast, relative
    difference) — the whole tensor gathered from its parts to check it."""

    audit: list | None = None

    def __init__(self, options: Fp8Options, comm, split: Split = Split(), name: str = ""):
        ao = torchao_float8()
        self.config = dataclasses.replace(ao["config"].Float8LinearConfig.from_recipe_name(options.recipe),
                                          emulate=options.emulate)
        # torchao's per-matmul settings, as its own Float8Linear makes them (built on meta: no storage)
        self.mm = ao["linear"].Float8Linear(FP8_ALIGN, FP8_ALIGN, bias=False, config=self.config,
                                            device="meta").linear_mm_config
        self.comm, self.split, self.name = comm, split, name
        # torchao's pieces, held here so that a compiled forward reads attributes, not the import
        self.matmul = ao["linear"].matmul_with_hp_or_float8_args
        self.disabled, self.axiswise = ao["config"].ScalingType.DISABLED, ao["config"].ScalingGranularity.AXISWISE
        self.amax_to_scale, self.to_float8 = ao["utils"].amax_to_scale, ao["tensor"].hp_tensor_and_scale_to_float8
        roles = ao["tensor"].GemmInputRole
        self.roles = {"x": roles.INPUT, "w_t": roles.WEIGHT, "g": roles.GRAD_OUTPUT}
        self.whole = not (split.tokens or split.inputs or split.outputs)  # no operand split: no scale reduced

    def cast(self, t: torch.Tensor, field: str, operand: str, dim: int):
        """`t` cast as the recipe's `field` (a `CastConfig` of `Float8LinearConfig`) says, the
        rowwise scale along `dim`; the amax reduced over the axes splitting what it spans."""
        cc = getattr(self.config, field)
        if cc.scaling_type is self.disabled:
            return t
        rowwise = cc.scaling_granularity is self.axiswise
        amax = torch.amax(torch.abs(t), dim=dim, keepdim=True) if rowwise else torch.max(torch.abs(t))
        spanned = (DIMS[operand][dim],) if rowwise else DIMS[operand]
        axes = sorted({axis for kind in spanned for axis in getattr(self.split, kind)})
        for axis in axes:
            self.comm.all_reduce(amax, axis, op=dist.ReduceOp.MAX, purpose=PURPOSE)
        if self.audit is not None:
            self._audit(t, amax, field, operand, dim if rowwise else None)
        scale = self.amax_to_scale(amax, cc.target_dtype, self.config.round_scales_to_power_of_2)
        return self.to_float8(t, scale, cc.target_dtype, self.mm, self.roles[operand], dim if rowwise else None)


    def _audit(self, t: torch.Tensor, amax: torch.Tensor, field: str, operand: str, dim: int | None) -> None:
        """Collective over the split axes: the amax `t`'s whole tensor gives (gathered from
        every rank's part) against the one this rank used, row by row where rowwise."""
        whole, used = t, amax
        for d, kind in enumerate(DIMS[operand]):
            for axis in getattr(self.split, kind):
                whole = self._gather(whole, d, axis)
                if dim is not None and d != dim % 2:  # the rows the scales run over: each rank's own
                    used = self._gather(used, d, axis)
        expected = torch.amax(torch.abs(whole), dim=dim, keepdim=True) if dim is not None else torch.max(torch.abs(whole))
        if not torch.equal(used, expected):
            diff = ((used - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()
            self.audit.append((self.name, field.removeprefix("cast_config_"), diff))

    def _gather(self, t: torch.Tensor, d: int, axis: str) -> torch.Tensor:
        """`t`'s parts over `axis` concatenated along dim `d`, in rank order."""
        n = self.comm.mesh.size(axis)
        moved = t.movedim(d, 0).contiguous()
        out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=t.dtype, device=t.device)
        self.comm.all_gather(out, moved, axis, purpose=PURPOSE)
        return out.movedim(0, d)


def fp8_casts(module: nn.Module) -> list[Fp8Casts]:
    """The casts of every converted layer in `module`."""
    return [m.fp8 for m in module.modules() if isinstance(getattr(m, "fp8", None), Fp8Casts)]


def start_audit(module: nn.Module) -> None:
    """Every cast of `module` checks its scales against its whole tensor until `audit_findings`."""
    for casts in fp8_casts(module):
        casts.audit = []


def audit_findings(module: nn.Module, comm) -> list[tuple[int, str, str, float]]:
    """Collective: every rank's casts whose scale was not the whole tensor's since
    `start_audit`, as (rank, layer, cast, relative difference); the audit switched off."""
    found = []
    for casts in fp8_casts(module):
        found += casts.audit or []
        casts.audit = None
    return [(rank, *item) for rank, part in enumerate(comm.all_gather_object(found)) for item in part]


class _Fp8Matmul(torch.autograd.Function):
    """x Wᵀ with every operand of the three matmuls cast by `casts` (torchao's
    `matmul_with_hp_or_float8_args`, with the scales of whole tensors)."""

    @staticmethod
    def forward(ctx, x, weight, casts: Fp8Casts):
        x2, w_t = x.reshape(-1, x.shape[-1]), weight.t()
        ctx.save_for_backward(x2, w_t)
        ctx.casts, ctx.x_shape = casts, x.shape
        y = torch.mm(casts.cast(x2, "cast_config_input", "x", -1), casts.cast(w_t, "cast_config_weight", "w_t", 0))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, w_t = ctx.saved_tensors
        c, g = ctx.casts, grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(c.cast(g, "cast_config_grad_output", "g", -1),
                              c.cast(w_t, "cast_config_weight_for_grad_input", "w_t", -1).t()).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(c.cast(g, "cast_config_grad_output_for_grad_weight", "g", 0).t(),
                              c.cast(x2, "cast_config_input_for_grad_weight", "x", 0))
        return grad_x, grad_w, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Casts | None = None) -> torch.Tensor:
    """`F.linear`, or with `fp8` its matmul in float8 (the bias added after, as torchao does)."""
    if fp8 is None:
        return F.linear(x, weight, bias)
    if fp8.whole:  # nothing split, nothing to reduce or audit: torchao's own matmul (the same numerics; it compiles)
        y = fp8.matmul.apply(x, weight.t(), fp8.mm, fp8.config)
    else:
        y = _Fp8Matmul.apply(x, weight, fp8)
    return y + bias.to(y.dtype) if bias is not None else y


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose matmul runs in float8; the same parameters under the same names."""

    fp8: Fp8Casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8)


def apply_fp8(model: nn.Module, names: list[str], options: Fp8Options, comm, *, sp: bool) -> int:
    """Convert this rank's layers among `names` (after tensor, context and expert parallelism
    have made their parts): a plain `nn.Linear` becomes an `Fp8Linear`, a tensor-parallel
    one (a column or row layer: its weight split by rows or by columns) gets its casts
    (`.fp8`), each with the axes that split its operands. Returns how many."""
    mesh, present = comm.mesh, dict(model.named_modules())
    cp = ("cp",) if mesh.size("cp") > 1 else ()
    count = 0
    for name in names:
        m = present.get(name)
        if m is None:  # another pipeline stage's
            continue
        spec = getattr(getattr(m, "weight", None), SHARD, None)
        if hasattr(m, "fp8") and spec is not None:  # a tensor-parallel layer: its weight split by rows or columns
            axis, dim = spec[0], spec[1]
            m.fp8 = Fp8Casts(options, comm, Split(tokens=cp, outputs=(axis,)) if dim == 0 else
                             Split(tokens=cp, inputs=(axis,)), name)
        elif type(m) is nn.Linear:  # whole on every tp rank; under SP its input is a sequence chunk
            tokens = cp + (("tp",) if sp and mesh.size("tp") > 1 else ())
            with torch.device("meta"):
                new = Fp8Linear(m.in_features, m.out_features, bias=False)
            new.weight, new.bias = m.weight, m.bias
            new.fp8 = Fp8Casts(options, comm, Split(tokens=tokens), name)
            replace_submodule(model, name, new)
        else:
            raise ValueError(f"--fp8: {name} is a {type(m).__name__} by now, which fp8 cannot convert")
        count += 1
    return count
