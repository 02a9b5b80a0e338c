"""Model states per device, analytically: the parameters one device holds (by the tensor-
parallel plan's splits and the pipeline's cut, block by block) and their bytes by ZeRO stage.

Model states (`model_state_bytes`), for Ψ parameters on one device's share and N
data-parallel ranks, in bytes per parameter (params + grads + master + optimizer):

    accounting  precision         stage 0     1                2               3
    paper       mixed (K = 12)    2+2+12      2+2+12/N         2+14/N          16/N     (ZeRO, Rajbhandari et al. 2020, §3-5)
    torch       fp32              4+4+8       4+4+8/N          4+12/N          16/N     (AdamW's two moments, no master)
    torch       bf16              2+2+4+8     2+2+12/N         2+14/N          16/N
    torch       bf16, fp32 grads  2+4+4+8     2+4+12/N         2+16/N          18/N

`torch` is what meshtrain keeps (tests match it to the trainer's measurement exactly, up
to ZeRO's padding of each flat group to a multiple of N); `paper` is the ZeRO paper's mixed
precision with K = 12 bytes of optimizer state per parameter.

A mixture of experts (`Shape.kind` "moe"): its blocks differ (dense layers and MoE
layers), so parameters are counted block by block (`block_params_on_device`: the router,
the experts and a shared expert whole over tp — each tp rank runs the experts of the tokens
it holds — and split by pp's cut and ZeRO like any parameter)."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from meshtrain.parallel.pipeline.schedules import split_layers

PAPER_K = 12  # the ZeRO paper's optimizer bytes per parameter under mixed precision (fp32 master, m, v)


def model_state_bytes(n_params: float, zero: int, dp: int, *, precision: str = "bf16", grad_dtype: str = "fp32",
                      accounting: str = "torch", gathered_params: float = 0,
                      optimizer_bytes: float = 8) -> dict[str, float]:
    """Bytes one device holds for `n_params` parameters (its share after tp and pp), by part,
    with a `total`. Under ZeRO-3 with dp > 1, `gathered_params` are held whole at their
    peak (`zero3_peak_gathered`), in the parameters' precision: a part of its own.
    `optimizer_bytes`: the optimizer state's bytes a parameter (AdamW's two fp32 moments: 8;
    a low-bit AdamW's: `low_bit_state_bytes`)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero}: use 0, 1, 2 or 3")
    if accounting == "paper":
        param, grad, master, optim = 2, 2, 0, PAPER_K
    elif accounting == "torch":
        low = precision == "bf16"
        param = 2 if low else 4
        grad = 4 if (not low or grad_dtype == "fp32") else 2
        master, optim = (4 if low else 0), optimizer_bytes
    else:
        raise ValueError(f"unknown accounting '{accounting}'; use paper or torch")
    shard = {"params": zero >= 3, "grads": zero >= 2, "master": zero >= 1, "optimizer": zero >= 1}
    per_param = {"params": param, "grads": grad, "master": master, "optimizer": optim}
    out = {part: n_params * nbytes / (dp if shard[part] else 1) for part, nbytes in per_param.items()}
    if zero == 3 and dp > 1:
        out["gathered"] = gathered_params * param
    out["total"] = sum(out.values())
    return out


def low_bit_state_bytes(n_params: float, vectors: float, per_element: float) -> float:
    """A low-bit AdamW's state bytes a parameter, averaged over `n_params` of which `vectors`
    (norms and biases, too small to quantize) keep two fp32 moments and the rest
    `per_element` bytes (`lowbit.state_bytes_per_element`)."""
    if n_params <= 0:
        return 8.0
    return (vectors * 8 + (n_params - vectors) * per_element) / n_params


def vector_params(shape, held: "StageParams", tp: int) -> int:
    """The parameters of a device that are vectors (norms, biases): a GPT's LayerNorms, row
    biases and column biases, a Llama's or MoE's RMSNorms (q/k norms included)."""
    h = shape.hidden
    if shape.kind == "gpt":  # a block's q, v and fc biases split over tp; proj biases and LayerNorms whole
        per_block = (2 * h + shape.ffn_width) // tp + 6 * h
        return held.blocks * per_block + (2 * h if held.outside else 0)
    per_block = 2 * h + (2 * shape.head_size if shape.qk_norm else 0)
    return held.blocks * per_block + (h if held.outside else 0)


def _outside(shape, tp: int) -> dict[str, int]:
    """Parameters outside the blocks by where they sit and whether tensor parallelism splits
    them (per device): the embedding (a GPT's position table whole), the final norm, the head
    (none of its own when tied to the embedding)."""
    h, v = shape.hidden, shape.vocab
    if shape.kind == "gpt":
        return {"embed_split": v * h // tp, "embed_whole": shape.seq_len * h, "final_whole": 2 * h,
                "head_split": v * h // tp}
    return {"embed_split": v * h // tp, "embed_whole": 0, "final_whole": h, "head_split": 0 if shape.tied else v * h // tp}


def block_params_on_device(shape, layer: int, tp: int) -> tuple[int, int, int]:
    """(split by tp, left whole, partial) parameters of block `layer` on one device.
    `partial`: of the whole ones, those whose gradients are summed over tp even without SP
    (a per-head q/k norm, which each rank applies to its own heads only).

    Tensor parallelism splits every matrix of a GPT's or Llama's block, and the column
    layers' biases; a MoE block's attention and a dense layer's MLP alike, but the router,
    the experts and a shared expert stay whole (each tp rank runs the experts of the tokens it
    holds: `recipes/moe.py`'s plan); norms and the row layers' biases stay whole."""
    h, f, kv = shape.hidden, shape.ffn_width, shape.kv_width
    if shape.kind == "gpt":
        # q, k, v, proj, fc, proj; the q, v and fc biases split; the row layers' biases, two LayerNorms whole
        return (4 * h * h + 2 * h * f + 2 * h + f) // tp, 2 * h + 4 * h, 0
    attention = (2 * h * shape.q_width + 2 * h * kv) // tp
    norms = 2 * h + shape.qk_norm_params()
    partial = 2 * shape.head_size if shape.kind == "moe" and shape.qk_norm == "head" else 0
    if shape.is_moe(layer):
        return attention, norms + shape.mlp_params(layer), partial
    return attention + 3 * h * f // tp, norms, partial


def stage_layers(shape, *, pp: int = 1, stage: int = 0, chunks: int = 1, tp: int = 1,
                 stage_layers: list[int] | None = None) -> tuple[int, ...]:
    """The block indices a pipeline stage holds, chunk by chunk (as `split_layers` cuts; tp
    is accepted to take `device_params`' arguments)."""
    return _layers_of(shape.layers, pp, stage, chunks, tuple(stage_layers) if stage_layers else None)


@lru_cache(maxsize=65536)
def _layers_of(layers: int, pp: int, stage: int, chunks: int, stage_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    ranges = split_layers(layers, pp * chunks, list(stage_layers) if stage_layers else None)
    return tuple(i for c in range(chunks) for i in ranges[c * pp + stage])


def stage_runs(shape, *, pp: int = 1, stage: int = 0, chunks: int = 1, tp: int = 1,
               stage_layers: list[int] | None = None) -> tuple[int, ...]:
    """The block counts of a pipeline stage's chunks (each a run of consecutive blocks; tp
    changes nothing here, it is accepted to take `device_params`' arguments)."""
    return _runs_of(shape.layers, pp, stage, chunks, tuple(stage_layers) if stage_layers else None)


@lru_cache(maxsize=65536)
def chunk_layers(layers: int, pp: int, stage: int, chunks: int,
                 stage_layers: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    """Each chunk's block indices on a stage (`layers`: the whole model's blocks)."""
    ranges = split_layers(layers, pp * chunks, list(stage_layers) if stage_layers else None)
    return tuple(tuple(ranges[c * pp + stage]) for c in range(chunks))


@lru_cache(maxsize=65536)
def _runs_of(layers: int, pp: int, stage: int, chunks: int, stage_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    ranges = split_layers(layers, pp * chunks, list(stage_layers) if stage_layers else None)
    return tuple(len(ranges[c * pp + stage]) for c in range(chunks))


class StageParams(NamedTuple):
    """What one device of a pipeline stage holds, in parameters (`stage_params`)."""
    blocks: int  # how many blocks
    in_blocks: int  # their parameters
    outside: int  # the embedding's, the final norm's, the head's (as the stage holds them)
    whole: int  # of all, those tensor parallelism leaves whole
    partial: int  # of those, the ones whose gradients are summed over tp even without SP
    largest_pair: int  # the most two consecutive blocks hold (ZeRO-3's gathered peak)


@lru_cache(maxsize=65536)
def _stage_params(shape, tp: int, pp: int, stage: int, chunks: int, stage_layers: tuple[int, ...] | None) -> StageParams:
    layers = _layers_of(shape.layers, pp, stage, chunks, stage_layers)
    per = [block_params_on_device(shape, i, tp) for i in layers]
    sizes = [split + whole for split, whole, _ in per]
    part = _outside(shape, tp)
    first, last = stage == 0, stage == pp - 1
    outside = ((part["embed_split"] + part["embed_whole"] if first else 0)
               + (part["final_whole"] + part["head_split"] if last else 0))
    whole = (sum(w for _, w, _ in per) + (part["embed_whole"] if first else 0) + (part["final_whole"] if last else 0))
    return StageParams(len(layers), sum(sizes), outside, whole, sum(p for _, _, p in per),
                       max((a + b for a, b in zip(sizes, sizes[1:])), default=sum(sizes)))


def stage_params(shape, *, tp: int = 1, pp: int = 1, stage: int = 0, chunks: int = 1,
                 stage_layers: list[int] | None = None) -> StageParams:
    """What one device of stage `stage` holds (`torch` accounting: meshtrain's tensor-parallel
    plan and pipeline cut), block by block (`block_params_on_device`).

    Tensor parallelism splits every matrix of a block, the column layers' biases, the token
    embedding and the head by tp; LayerNorms (RMSNorms), the row layers' biases, the position
    embedding and a MoE layer's router and experts stay whole. Pipeline stage `stage` holds
    its virtual stages' blocks (split as `split_layers` does), the embedding on stage 0, the
    final norm and the (untied) head on the last."""
    return _stage_params(shape, tp, pp, stage, chunks, tuple(stage_layers) if stage_layers else None)


def device_params(shape, **where) -> tuple[int, int, int]:
    """What one device holds, as (blocks, parameters per block, parameters outside the
    blocks): per block the blocks' mean when they differ (a MoE's dense and MoE layers;
    `params_per_device` sums them exactly). `stage_params`' arguments."""
    held = stage_params(shape, **where)
    return held.blocks, held.in_blocks // max(held.blocks, 1), held.outside


def whole_params(shape, **where) -> int:
    """The parameters of a device that tensor parallelism leaves whole (their gradients are
    summed over tp under sequence parallelism)."""
    return stage_params(shape, **where).whole


def partial_params(shape, **where) -> int:
    """The whole parameters whose gradients are summed over tp even without SP (a MoE's
    per-head q/k norms)."""
    return stage_params(shape, **where).partial


def params_per_device(shape, **where) -> int:
    """The parameters one device holds (`stage_params`' arguments)."""
    held = stage_params(shape, **where)
    return held.in_blocks + held.outside


def zero3_peak_gathered(shape, **where) -> int:
    """Parameters ZeRO-3 holds whole at its peak (`torch` accounting): everything outside
    the blocks, gathered on first use, and two blocks — the one computing and the next,
    prefetched (the two consecutive blocks that hold the most)."""
    held = stage_params(shape, **where)
    return held.outside + held.largest_pair


def expert_params_per_device(shape, **where) -> int:
    """The experts' parameters one device holds (the MoE layers of its stage, whole over tp):
    where a MoE's memory sits."""
    return shape.expert_params() * shape.moe_in(stage_layers(shape, **where))
