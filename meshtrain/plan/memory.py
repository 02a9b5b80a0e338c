"""Memory per device, analytically: model states by ZeRO stage, and activations per layer.

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

Activations (`activation_bytes_per_layer`, the `paper` accounting: Korthikanti et al. 2022,
Table 2, 16-bit activations and 1-byte dropout masks), for micro-batch b, sequence s,
hidden h, a heads, tensor-parallel size t:

    no recompute                  s·b·h·(10 + 24/t + 5·a·s/(h·t))      (t = 1: 34 + 5as/h)
    with sequence parallelism     s·b·h·(34/t + 5·a·s/(h·t))
    selective recompute           s·b·h·(10 + 24/t)   (with SP: 34/t)  — the 5as/h term gone
    full recompute                2·s·b·h             (with SP: /t)    — the block's input only

The first pipeline stage holds the activations of `in_flight` micro-batches at once: p under
1F1B whatever p is, scaled by 1 + (p−1)/(p·v) when interleaved (Narayanan et al. 2021).

A mixture of experts (`Shape.kind` "moe"): its blocks differ (dense layers and MoE
layers), so parameters are counted block by block (`block_params_on_device`: the router,
the experts and a shared expert whole over tp — each tp rank runs the experts of the tokens
it holds — and split by pp's cut and ZeRO like any parameter), and a stage's activations
from each block's own terms (`block_terms.moe_kept_bytes`, `moe_backward_extra`): a MoE
layer keeps, for the n tokens a rank routes (all of a micro-batch's under tp, its share
under SP or cp) and r = k·n rows, r·(2d·e + 4d + 4I·e + 28) + n·(4E + 4) bytes beyond its
attention's, e-byte activations — the rows gathered and the weighted rows (d wide, e), the
down projection's output in fp32 (4d), gate_up's output, SiLU and product (4I, e), each
row's order, token, choice and weights (28); the router's fp32 scores and their sum."""

from __future__ import annotations

import math

from functools import lru_cache
from typing import NamedTuple

from meshtrain.parallel.options import parse_recompute
from meshtrain.plan.block_terms import (LlamaDims, MoEDims, cp_attention_delta, llama_kept_bytes, moe_backward_extra,
                                        moe_kept_bytes, ring_backward_bytes)
from meshtrain.parallel.pipeline.schedules import split_layers
from meshtrain.parallel.pipeline import schedules as S

PAPER_K = 12  # the ZeRO paper's optimizer bytes per parameter under mixed precision (fp32 master, m, v)


def model_state_bytes(n_params: float, zero: int, dp: int, *, precision: str = "bf16", grad_dtype: str = "fp32",
                      accounting: str = "torch", gathered_params: float = 0) -> dict[str, float]:
    """Bytes one device holds for `n_params` parameters (its share after tp and pp), by part,
    with a `total`. Under ZeRO-3 with dp > 1, `gathered_params` are held whole at their
    peak (`zero3_peak_gathered`), in the parameters' precision: a part of its own."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {zero}: use 0, 1, 2 or 3")
    if accounting == "paper":
        param, grad, master, optim = 2, 2, 0, PAPER_K
    elif accounting == "torch":
        low = precision == "bf16"
        param = 2 if low else 4
        grad = 4 if (not low or grad_dtype == "fp32") else 2
        master, optim = (4 if low else 0), 8
    else:
        raise ValueError(f"unknown accounting '{accounting}'; use paper or torch")
    shard = {"params": zero >= 3, "grads": zero >= 2, "master": zero >= 1, "optimizer": zero >= 1}
    per_param = {"params": param, "grads": grad, "master": master, "optimizer": optim}
    out = {part: n_params * nbytes / (dp if shard[part] else 1) for part, nbytes in per_param.items()}
    if zero == 3 and dp > 1:
        out["gathered"] = gathered_params * param
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sp: bool = False, recompute: str = "none", attention: str = "math",
                               kv_width: int | None = None, ffn: int | None = None, swiglu: bool = False,
                               q_width: int | None = None, moe: MoEDims | None = None) -> float:
    """Korthikanti et al. (2022), Table 2: one transformer layer's activation bytes on one
    tensor-parallel rank (16-bit activations, 1-byte dropout masks).

    Generalised term by term for other shapes (exactly the table's for the GPT shape: q =
    kv = h, f = 4h, two MLP matrices): the 10·sbh left whole are the two norms' inputs (4),
    the q/k/v input (2) and the MLP's input (2), and two dropout masks (2); split by t are q
    and k (2·sb·(q + kv)), v (2·sb·kv), the output projection's input (2·sb·q) and the MLP's
    inner activations, 2·sb·f per saved tensor: two for GELU's MLP (its input and the second
    matrix's input), three for SwiGLU (gate, up, and their product). The attention core's
    5·a·s²·b (scores' softmax, its dropout mask and output) is counted under `math` only:
    the fused `sdpa` kernel never keeps it.

    A MoE layer (`moe`) keeps instead of the MLP's, whole over tp (the experts are
    replicated; under SP each rank routes its share of the tokens, ÷ t): the router's fp32
    scores (4·sb·E), the k·sb rows the experts take (2·k·sbh), their gate, up and product
    (3 · 2·k·sb·I) and the down projection's output the weighting takes (2·k·sbh), and a
    shared expert's SwiGLU (3 · 2·sb·f_s)."""
    s, b, h = seq, micro_batch, hidden
    q, kv, f = q_width or hidden, kv_width or hidden, ffn or 4 * hidden
    whole = 10 * s * b * h
    mlp = (3 if swiglu else 2) * 2 * s * b * f
    experts = 0
    if moe is not None:
        mlp, k = 0, moe.top_k
        experts = 4 * s * b * moe.experts + 2 * 2 * k * s * b * h + 3 * 2 * k * s * b * moe.expert_ffn
        experts += 3 * 2 * s * b * moe.shared_ffn
    split = 2 * s * b * (q + kv) + 2 * s * b * kv + 2 * s * b * q + mlp
    attention_core = 5 * heads * s * s * b / tp if attention == "math" else 0
    rest = (whole + split + experts) / tp if sp else whole + split / tp + experts
    if recompute == "none":
        return rest + attention_core
    if recompute == "selective":
        return rest
    if recompute == "full":
        return 2 * s * b * h / (tp if sp else 1)
    raise ValueError(f"recompute '{recompute}': the paper's table has none, selective and full")


def in_flight(pp: int, microbatches: int, schedule: str = "1f1b", chunks: int = 1) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once, in units of a
    whole stage's worth: min(p, m) under 1F1B, times 1 + (p−1)/(p·v) when interleaved; all m
    under GPipe."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    held = min(pp, microbatches)
    return held * (1 + (pp - 1) / (pp * chunks)) if schedule == "interleaved" else held


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
def _chunk_layers(layers: int, pp: int, stage: int, chunks: int,
                  stage_layers: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    """Each chunk's block indices on a stage."""
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
    return sum(shape.expert_params() for i in stage_layers(shape, **where) if shape.is_moe(i))


def torch_activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, element_bytes: int = 4,
                                     attention: str = "sdpa", dropout: float = 0.0, ffn: int | None = None,
                                     tp: int = 1, sp: bool = False, llama: LlamaDims | None = None,
                                     cp_mode: str | None = None, moe: MoEDims | None = None) -> int:
    """What one block of meshtrain's GPT keeps for backward on one rank (`torch` accounting,
    no recompute), for `element_bytes`-byte activations (4 fp32, 2 bf16); t = tp, and the
    "whole" terms are divided by t too under sequence parallelism:

    - whole: the two LayerNorms' outputs and the residual stream after attention and after
      the MLP, 4·bsh elements; the LayerNorms' means and reciprocal deviations, 4·b·s;
    - split by heads or columns: q, k, v and the attention output, 4·bsh/t; the MLP's two
      activations of width f, 2·b·s·f/t;
    - `math`: softmax's output (b·(a/t)·s² elements) and the causal mask (s² bytes); with
      dropout also the dropped probabilities (b·(a/t)·s² elements) and their mask (bytes);
    - `sdpa`: the fused kernel's log-sum-exp (b·(a/t)·s, fp32);
    - dropout on the attention and MLP outputs: their masks (2·bsh bytes, whole).

    The trainer's layer probe measures exactly this (tests hold the two equal, with and
    without tp and SP). A Llama's block (`llama`): `block_terms.llama_kept_bytes`, whose
    MLP is a mixture of experts when `moe` is given (a MoE layer)."""
    delta = cp_attention_delta(seq, micro_batch, hidden, llama, element_bytes=element_bytes, tp=tp, cp_mode=cp_mode)
    if llama is not None:
        return delta + llama_kept_bytes(seq, micro_batch, hidden, heads, llama, element_bytes=element_bytes, ffn=ffn,
                                        tp=tp, sp=sp, moe=moe, context=cp_mode is not None)
    e, b, s, h, a, t = element_bytes, micro_batch, seq, hidden, heads, tp
    f = ffn or 4 * h
    whole = t if sp else 1  # what SP also shards along the sequence
    elements = (4 * b * s * h + 4 * b * s) // whole + (4 * b * s * h + 2 * b * s * f) // t
    extra = 0
    if attention == "math":
        elements += b * (a // t) * s * s
        extra += s * s
        if dropout > 0:
            elements += b * (a // t) * s * s
            extra += b * (a // t) * s * s
    else:
        extra += 4 * b * (a // t) * s
    if dropout > 0:
        extra += 2 * b * s * h // whole
    return elements * e + extra + delta


def block_parts(seq: int, micro_batch: int, hidden: int, heads: int, *, element_bytes: int, attention: str,
                 dropout: float, ffn: int | None, tp: int, sp: bool, llama: LlamaDims | None = None,
                 cp_mode: str | None = None, fused_blocks: bool = False, moe: MoEDims | None = None) -> dict[str, int]:
    """One block's activation terms on one rank, in bytes (`torch` accounting; t = tp, w = t
    under SP else 1), the pieces the step's moments are made of:

    - `kept`: what the block leaves alive with no recompute (`torch_activation_bytes_per_layer`);
    - `out`: one residual-stream tensor, b·s·h/w elements: the block's input or output;
    - `selective`: what it keeps under selective recompute: `kept` less the attention core
      (softmax's output and mask, or sdpa's log-sum-exp; the dropped probabilities and their
      mask): the core's inputs q, k, v and its output are kept either way;
    - `forward_peak`: what the block's forward holds at its attention's peak (math only: at
      the softmax): the first LayerNorm's output and statistics, q, k and v (Python locals
      until the attention returns), the contiguous copies of q and kᵀ the product takes, the
      scaled scores, the masked scores and softmax's output (3·b·(a/t)·s² elements) and the
      causal mask; with SP also the gathered input, b·s·h whole. Under sdpa the forward never
      holds more than `kept`: 0;
    - `recomputed`: what it keeps when its forward runs again in backward: `kept`, but under
      SP with its two gathered inputs whole;
    - `backward_extra`: what the block's backward allocates on top of its saved tensors and
      its output's gradient at its largest: the output projection of the MLP first, the
      gradient of its input (b·s·f/t elements) and the weight's gradient before it is added
      to its buffer (h·f/t) and the bias's (h);
    - `recomputed_peak`: what a block recomputed under `full` holds at its backward's
      largest, its output's gradient aside: `recomputed` less its output (nothing saves it)
      and less the MLP's activations, which run in two chunks of rows (b₁ = ⌈b/2⌉ and the
      rest) recomputed one at a time: the first chunk's (backwarded last) activations and
      `backward_extra`, and the other chunk's gradients (its input's, and its weights' and
      biases', held until the first chunk's are added to them); with one row, the whole
      MLP's and `backward_extra`.

    A MoE layer's block (`moe`, with `llama`): its MLP's terms are the experts'
    (`block_terms.moe_kept_bytes`), replicated over tp; its backward's largest moment is
    `block_terms.moe_backward_extra`'s; under SP only the attention gathers its input; and
    under `full` its MLP runs whole (recompute.py chunks the rows of `...MLP` modules only):
    `recomputed_peak` is `recomputed` less its output, plus `backward_extra`."""
    e, b, s, h, a, t = element_bytes, micro_batch, seq, hidden, heads, tp
    f = ffn or 4 * h
    w = t if sp else 1
    # a Llama's RoPE table (cos and sin, 2·s·head_dim) is built by the first block and shared by
    # every layer (`models.llama.Rotary`): the layer probe sees it in block 0, the step holds one
    table = 2 * s * llama.head_dim * e if llama else 0
    kept = torch_activation_bytes_per_layer(s, b, h, a, element_bytes=e, attention=attention, dropout=dropout,
                                            ffn=f, tp=t, sp=sp, llama=llama, cp_mode=cp_mode, moe=moe) - table
    out = b * s * h * e // w
    scores = b * (a // t) * s * s
    mlp_tensors = 4 if llama else 2  # SwiGLU keeps gate, up, SiLU and product; a GPT fc's output and GELU's
    tail = 0 if (llama and e < 4) else out  # of `kept`, the block's own output (see `llama_kept_bytes`)
    if attention == "math":
        core = scores * e + s * s + ((scores * e + scores) if dropout > 0 else 0)
        forward_peak = (out + 2 * b * s * e // w + 5 * b * s * h * e // t + 3 * scores * e + s * s
                        + (b * s * h * e if sp else 0))
    else:
        core, forward_peak = 4 * scores // s, 0
    # selective keeps the checkpointed core's inputs and output: under cp too (its own q, k, v)
    selective = kept - core - cp_attention_delta(s, b, h, llama, element_bytes=e, tp=t, cp_mode=cp_mode)
    if llama:  # the checkpointed core takes k and v before they are repeated to the query heads
        selective -= 2 * b * s * (llama.q_width - llama.kv_width) * e // t

    def mlp(rows):  # an MLP's saved activations for `rows` rows (under SP with its gathered input)
        return mlp_tensors * rows * s * f * e // t + ((rows * s * h * e - rows * s * h * e // t) if sp else 0)

    def extra(rows):
        if llama:  # at the down projection: its input's gradient and its weight's; at the product's
            # backward, which frees the product: the gradients of the SiLU's output and of up's
            return max(rows * s * f * e // t + h * f * e // t, 2 * rows * s * f * e // t)
        return rows * s * f * e // t + h * f * e // t + h * e
    # the ring's backward holds its buffers after the block's MLP tensors are freed
    ring = ring_backward_bytes(s, b, h, a, llama, element_bytes=e, tp=t, fused=fused_blocks) if cp_mode == "ring" else 0
    if moe is not None:  # the tokens of the rank (all of them under tp, its share under SP)
        n = b * s // w
        experts = moe_kept_bytes(n, b, h, moe, element_bytes=e, summed=(sp and t > 1) or cp_mode is not None)
        experts -= n * h * e if e < 4 and not moe.shared_ffn else 0
        backward_extra = max(moe_backward_extra(n, h, moe, element_bytes=e), ring - experts)
        recomputed = kept + ((b * s * h * e - b * s * h * e // t) if sp else 0)  # the attention's gathered input
        return {"kept": kept, "out": out, "tail": tail, "selective": selective, "forward_peak": forward_peak,
                "backward_extra": backward_extra, "recomputed": recomputed,
                "recomputed_peak": recomputed - tail + backward_extra, "table": table}
    backward_extra = extra(b)
    backward_extra = max(backward_extra, ring - mlp(b))
    # recomputed under SP, a block keeps its two gathered inputs whole (the region's regather
    # stands down under a checkpoint: `recompute.is_recomputed`), not as shards
    recomputed = kept + (2 * (b * s * h * e - b * s * h * e // t) if sp else 0)
    first = -(-b // 2)  # `recompute._mlp_in_row_chunks`' two chunks: ⌈b/2⌉ rows, then the rest
    # the other chunk's input gradient, and its weights' and biases' gradients, held until this
    # chunk's are added to them (PyTorch sums a parameter's gradients from the two chunks before
    # adding them to its buffer): a GPT's two weights; a Llama's three at the down projection's
    # backward (down's own is summed after it), gate's and up's at the product's backward
    weight = h * f * e // t
    if llama:
        held = max(first * s * f * e // t + weight + 3 * weight, 2 * first * s * f * e // t + 2 * weight)
    else:
        held = extra(first) + 2 * weight + h * e + f * e // t
    other = (b - first) * s * h * e // w + held
    chunked = (mlp(first) + other) if b > 1 else mlp(b) + extra(b)
    recomputed_peak = recomputed - tail - mlp(b) + max(chunked, ring)  # the MLP's backward, or later the ring's
    return {"kept": kept, "out": out, "tail": tail, "selective": selective, "forward_peak": forward_peak,
            "backward_extra": backward_extra, "recomputed": recomputed, "recomputed_peak": recomputed_peak,
            "table": table}


def recompute_units(blocks: int, recompute: str = "none") -> list[int]:
    """How a run of `blocks` consecutive blocks is cut by a recompute policy: the sizes of the
    units that keep only their input and run again whole in backward (`full`: one block each;
    `segments:K`: K each, the last shorter; `segments`: K = ⌈√blocks⌉); [] when no block is
    recomputed whole (`none`, `selective`)."""
    mode, k = parse_recompute(recompute)
    if mode in ("none", "selective"):
        return []
    size = 1 if mode == "full" else (k or math.ceil(math.sqrt(blocks)))
    return [min(size, blocks - start) for start in range(0, blocks, size)]


def recompute_kept_bytes(blocks: int, parts: dict[str, int], recompute: str = "none") -> int:
    """What `blocks` consecutive blocks keep through the forward under a recompute policy,
    from `block_parts`: every block's `kept` (none), its `selective` share (selective), or
    one residual-stream tensor per recomputed unit — its output, which is the next unit's
    input (full, segments); a run's first input is its stage's (the embedding's output, or
    the received activation) and is counted there."""
    units = recompute_units(blocks, recompute)
    if units:
        return len(units) * parts["out"]
    return blocks * parts["selective" if recompute == "selective" else "kept"]


@lru_cache(maxsize=4096)
def _chunks_at_backwards(schedule: str, pp: int, stage: int, microbatches: int,
                         chunks: int) -> tuple[tuple[int, tuple[int, ...], int, int, int], ...]:
    """The distinct moments of the stage's backwards (the peak is their largest, so a moment
    repeated in the steady state counts once), by walking the stage's instruction list: its
    chunk; the micro-batches each chunk holds then (forwarded and not yet backwarded, the one
    being backwarded included); under the zero-bubble schedule the micro-batches whose input
    pass is done and whose weight pass is not (holding only the weight-gradient store's
    pairs; on the first virtual stage, which runs its backward whole in the weight pass, a
    micro-batch is held until then); the activations received and still held (a chunk's
    input, but the first virtual stage's); the outputs not yet sent (interleaved sends a
    step's forward output after its backward) and the messages sent and not yet known
    complete — outputs and input gradients, which the engine frees when a later group with
    a receive (or the step's end) has waited for them (`transport.py`)."""

    if pp == 1:
        return ((0, (1,), 0, 0, 0, False),)
    last = pp * chunks - 1
    held, stored, received, unsent, in_flight, found = [0] * chunks, 0, 0, 0, 0, []
    steps = S.compute_steps(schedule, stage, pp, microbatches, chunks)
    for op in S.with_communication(stage, steps, pp, chunks):
        if isinstance(op, S.Transfers):
            outputs = sum(isinstance(t, S.SendActivation) for t in op.ops)
            unsent -= outputs
            if any(isinstance(t, (S.RecvActivation, S.RecvGrad)) for t in op.ops):
                in_flight = 0  # waited for as a whole, with every group before it
            else:
                in_flight += len(op.ops)  # sends only: waited for later
            continue
        receives = op.chunk * pp + stage > 0
        if isinstance(op, S.Forward):
            held[op.chunk] += 1
            received += receives
            unsent += op.chunk * pp + stage < last  # an output to send (in the same step as a backward)
        elif isinstance(op, (S.Backward, S.BackwardInput)):
            found.append((op.chunk, tuple(held), stored, received, unsent + in_flight, False))
        elif receives and isinstance(op, S.BackwardWeight):  # a split backward's weight pass
            found.append((op.chunk, tuple(held), stored, received, unsent + in_flight, True))
        whole = isinstance(op, S.Backward) or (not receives and isinstance(op, S.BackwardWeight))
        if whole or (receives and isinstance(op, S.BackwardInput)):
            held[op.chunk] -= 1
            received -= receives
        if receives and isinstance(op, (S.BackwardInput, S.BackwardWeight)):  # a split backward's store
            stored += 1 if isinstance(op, S.BackwardInput) else -1
    return tuple(dict.fromkeys(found))


def weight_store_bytes(seq: int, micro_batch: int, hidden: int, *, element_bytes: int, ffn: int | None = None,
                       tp: int = 1, llama: LlamaDims | None = None, moe: MoEDims | None = None,
                       sp: bool = False) -> int:
    """What zero-bubble's weight-gradient store keeps of one block for one micro-batch between
    its input and weight passes (`pipeline/split.py`): each linear layer's input and output
    gradient, b·s·e·(4h + 4h/t + 2f/t): q, k and v share their input (the first LayerNorm's
    output, whole — under SP the gathered sequence, kept whole) and keep an output gradient
    of h/t each; the attention's projection its input (h/t) and output gradient (h, whole
    before the sum over tp); the MLP's fc its input (h) and output gradient (f/t), its
    projection its input (f/t) and output gradient (h). A MoE layer (`moe`): the attention's
    pairs, the router's (a linear layer of its own in fp32, where its weight is the one it
    multiplies: its input and its scores' gradient, for the rank's tokens) and a shared
    expert's; the experts' stacked weights are not linear layers, their gradients are formed
    in the input pass."""
    e, b, s, h, t = element_bytes, micro_batch, seq, hidden, tp
    f = ffn or 4 * h
    if llama and moe is not None:
        q, kv = llama.q_width, llama.kv_width
        n = b * s // (t if sp else 1)
        router = n * (h + moe.experts) * 4 if e == 4 else 0
        shared = n * e * (2 * h + 3 * moe.shared_ffn) if moe.shared_ffn else 0
        return b * s * e * (2 * h + (2 * q + 2 * kv) // t) + router + shared
    if llama:  # q, k, v share their input; o; gate and up share theirs; down
        q, kv = llama.q_width, llama.kv_width
        return b * s * e * (4 * h + (2 * q + 2 * kv + 3 * f) // t)
    return b * s * e * (4 * h + 4 * h // t + 2 * f // t)


def torch_stage_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, vocab: int, *,
                                 element_bytes: int = 4, attention: str = "sdpa", dropout: float = 0.0,
                                 ffn: int | None = None, tp: int = 1, sp: bool = False, recompute: str = "none",
                                 pp: int = 1, stage: int = 0, schedule: str = "1f1b", microbatches: int = 1,
                                 chunks: int = 1, stage_layers: list[int] | None = None,
                                 llama: LlamaDims | None = None, cp_mode: str | None = None,
                                 fused_blocks: bool = False, moe: MoEDims | None = None) -> int:
    """The peak of activation bytes in one step on one rank of pipeline stage `stage`
    (`torch` accounting): the largest of the moments below, for the micro-batch size b the
    stage runs (the rank's batch ÷ microbatches), `layers` the whole model's blocks (the
    stage's are cut as `split_layers` does). Parts are `block_parts`' (per block) and:

    - a micro-batch's forward keeps K: on the first stage the embedding's output (its dropout
      mask, the positions, int64; under tp the vocabulary-parallel lookup's local ids, 2·8
      bytes a token, and its mask), its blocks' `recompute_kept_bytes`, and on the last the
      final LayerNorm's output and statistics and what the loss keeps, the fp32 logits
      (held until that micro-batch's backward: under GPipe the last stage holds m of them);
    - a non-first stage keeps the received activations of the micro-batches in flight; a
      chunk's output (and an input gradient sent back) lives until its send is known
      complete, when a later group with a receive has been waited for: the messages sent and
      not yet waited for at that backward, one activation's size each;
    - at the backward of micro-batch k (order by the schedule), the n micro-batches
      in flight (n = min(p − stage, m − k) under 1F1B) hold K each — under the interleaved
      schedule the K of the chunk each sits in, each chunk a run of its own (the first
      stage's first chunk holds the embedding's share, the last stage's last chunk the
      loss's), walked instruction by instruction (`_chunks_at_backwards`); that backward
      holds the gradient of its chunk's output and, at its largest:
        - the loss (last stage): two fp32 tensors of the logits' size, the logits kept for
          backward and, in its forward, their shifted exponentials (in backward: the
          logits' gradient), four fp32 numbers per token, and under bf16 the bf16 logits,
          which the caller holds until the loss returns (`meshtrain.loss`); under tp three of the local
          logits' size (split by the vocabulary: the vocabulary-parallel cross-entropy keeps
          its probabilities, and holds their copy and the logits' gradient), with each
          token's local target and mask, 9 bytes, and five fp32 numbers at its peak;
        - no recompute: the last block's `backward_extra`, its saved tensors all alive;
        - a recomputed unit (full: a block; segments: K blocks): the inputs of the units
          before it and its own, its blocks recomputed (their `kept`, less the last block's
          output: nothing saves it), and the last block's `backward_extra` (full: the
          block's `recomputed_peak`, its MLP in chunks); or under math, the recomputation
          at the last block's softmax (`forward_peak`, the earlier blocks of the unit
          recomputed);
    - under math, the forward of the last block at its softmax (`forward_peak`), the earlier
      blocks' K share alive;
    - under the zero-bubble schedule, on every stage but the first (which runs each backward
      whole, in its weight pass): a micro-batch between its input and weight passes holds
      only its pairs in the weight-gradient store (`weight_store_bytes` a block, and on the
      last stage the head's input and the logits' gradient, b·s·(h + V/t)·e); during its
      input pass it holds the head's pair, and a recomputed unit's moment the pairs of the
      units after it; and each weight pass is a moment of its own: every pair still kept
      (its own micro-batch's included), the other micro-batches' K and one ∇W (the largest
      weight's). Measured on gpt-test at pp 2, m 4: exact with no recompute; 2–5 % low on
      the last stage under recompute, whose input pass frees recomputed tensors while the
      store fills, a moment the formula does not follow.

    A MoE model (`moe`, with `llama`) has blocks of two kinds, its dense layers' and its MoE
    layers' (`block_parts` of each): a stage sums what its own blocks keep, and each block's
    backward is a moment of its own (the blocks before it alive, its own at its largest):
    the largest need not be the last block's when the kinds differ.

    What is left out: scalars (the loss), the loss's transients of the targets, the bias
    gradients' sums, dropout's transients in the forward."""
    e, b, s, h = element_bytes, micro_batch, seq, hidden
    t = tp
    w = t if sp else 1
    terms = dict(element_bytes=e, attention=attention, dropout=dropout, ffn=ffn, tp=t, sp=sp, llama=llama,
                 cp_mode=cp_mode, fused_blocks=fused_blocks)
    parts = block_parts(s, b, h, heads, **terms)
    sparse = block_parts(s, b, h, heads, moe=moe, **terms) if moe is not None else parts
    out = parts["out"]
    recompute_mode = parse_recompute(recompute)[0]
    runs = _chunk_layers(layers, pp, stage, chunks, tuple(stage_layers) if stage_layers else None)

    def part(layer: int) -> dict[str, int]:
        return sparse if moe is not None and moe.is_moe(layer) else parts
    ids = 17 * b * s if t > 1 else 0  # the vocabulary-parallel lookup's local ids (two int64 copies), its mask
    # the last stage keeps, per micro-batch until its backward, the final LayerNorm's output and
    # statistics and what the loss keeps: the logits, or under tp the local probabilities
    # (fp32, the local logits' size), with each token's local target (int64) and its mask; at
    # the loss it holds one more such tensor (the logits' gradient), under tp two (the
    # probabilities' copy too) and five fp32 numbers per token (max, target logit, sum, log, term)
    kept_loss = b * s * (vocab // t) * 4 + (9 * b * s if t > 1 else 0)
    # at the loss (its forward: the logits kept, their shifted exponentials, a few fp32 numbers
    # per token, and under bf16 the bf16 logits, which the caller still holds)
    # (one process in fp32: the ignored targets are always masked, never asked about — no host
    # sync — so the mask, a byte a token, and the masked targets' int64 copy are there too; in
    # bf16 the moment is the logits' gradient cast back, after they are freed)
    masked = 9 * b * s if e == 4 else 0
    loss = ((2 * b * s * (vocab // t) * 4 + 20 * b * s) if t > 1 else b * s * vocab * 4 + 16 * b * s + masked)
    loss += b * s * (vocab // t) * e if e < 4 else 0  # the bf16 logits the caller holds

    split = schedule == "zb" and stage > 0  # the first stage runs each backward whole
    dense_pairs = weight_store_bytes(s, b, h, element_bytes=e, ffn=ffn, tp=t, llama=llama)
    sparse_pairs = weight_store_bytes(s, b, h, element_bytes=e, ffn=ffn, tp=t, llama=llama, moe=moe, sp=sp)

    def pairs(layer: int) -> int:
        return sparse_pairs if moe is not None and moe.is_moe(layer) else dense_pairs

    def micro_batch(run: tuple[int, ...], first: bool, last: bool) -> tuple[int, int]:
        """(what a micro-batch keeps through the blocks of `run`, its live bytes at its
        backward's largest moment); `first`: they start from the embedding, `last`: end at
        the loss."""
        blocks = len(run)
        kinds = [part(i) for i in run]
        units = recompute_units(blocks, recompute)
        # what of a run's first input and last output its neighbours keep: a recomputed unit's
        # checkpoint keeps its input; else a GPT's LayerNorm keeps it, a bf16 Llama's RMSNorm
        # only its fp32 copy (in the block's `kept`)
        tail = out if units else parts["tail"]
        if llama:  # no position table; the final RMSNorm keeps as a block's does
            before = (tail + ids) if first else 0
            after = (2 * out + 4 * b * s // w + (4 * b * s * h // w if e < 4 else 0) + kept_loss) if last else 0
        else:
            before = (out + 8 * s + ids + (b * s * h // w if dropout > 0 else 0)) if first else 0
            after = (out + 2 * b * s * e // w + kept_loss) if last else 0
        key = "selective" if recompute == "selective" else "kept"
        kept_blocks = len(units) * out if units else sum(k[key] for k in kinds)
        per_mb = before + kept_blocks + after
        grad = out  # the gradient of the stage's output (received, or the final LayerNorm's)
        if not last or (units and not parts["tail"]):
            # its output is freed once sent (counted apart while the send is in flight), or
            # the bf16 Llama's final RMSNorm keeps only its fp32 copy
            per_mb -= tail
        if units:
            moments, earlier, start = [], 0, 0
            chunked_mlp = recompute_mode == "full"  # recompute.py runs its MLP in two chunks of rows
            for size in units:
                unit, start = kinds[start:start + size], start + size
                if chunked_mlp:
                    redo = unit[0]["recomputed_peak"]
                else:  # each block's backward, the unit's earlier blocks recomputed and alive
                    redo = _largest_backward(unit, "recomputed") - parts["tail"]
                again = sum(k["recomputed"] for k in unit[:-1]) + unit[-1]["forward_peak"]
                later = sum(pairs(i) for i in run[start:]) if split else 0  # kept by then by a split backward
                moments.append(earlier * out + max(redo, again) + later)
                earlier += 1
            current = before + max(moments) + grad
        else:  # each block's backward, the blocks before it alive
            current = before + grad - tail + _largest_backward(kinds, key)
        # a split backward (zero-bubble, but on the first stage) keeps the head's pair in the
        # store from the loss's backward on: the logits' gradient is still held while the
        # micro-batch's blocks backward
        if split and last:
            current += b * s * (vocab // t) * e
        current = max(current, per_mb + (loss if last else 0))
        if attention == "math":  # the forward of the last block, at its softmax
            share = (len(units) - 1) * out if units else sum(k[key] for k in kinds[:-1])
            current = max(current, before + share + kinds[-1]["forward_peak"])
        return per_mb, current

    # each chunk of the stage (one, but under the interleaved schedule), as a run of its own
    chunk = [micro_batch(run, stage == 0 and c == 0, stage == pp - 1 and c == len(runs) - 1)
             for c, run in enumerate(runs)]
    # zero-bubble's store: per micro-batch between its passes, every block's linear layers'
    # pairs and, on the last stage, the head's (its input, whole under SP, and the logits' gradient)
    last_stage = stage == pp - 1
    held_layers = [i for run in runs for i in run]
    store = sum(pairs(i) for i in held_layers) + (b * s * (h + vocab // t) * e if last_stage else 0)
    f = ffn or 4 * h
    widest = h * f if any(part(i) is parts for i in held_layers) else h * (llama.q_width if llama else h)
    weight_grad = max(widest, h * (vocab // t) if last_stage else 0) * e // t  # the largest ∇W a weight pass forms
    peak = 0
    for c, held, stored, received, sent, weight in _chunks_at_backwards(schedule, pp, stage, microbatches, chunks):
        # the micro-batches in flight keep theirs, the one backwarded is at its largest; those
        # waiting for their weight pass their pairs; the received activations in flight and
        # the messages sent and not yet waited for. At a weight pass: every pair still kept
        # (its own micro-batch's included) and one ∇W.
        kept = sum(n * chunk[i][0] for i, n in enumerate(held)) + stored * store + (received + sent) * out
        peak = max(peak, kept + weight_grad if weight else kept - chunk[c][0] + chunk[c][1])
    return peak + parts["table"]  # one RoPE table per rank, whatever it holds of the blocks


def _largest_backward(kinds: list[dict[str, int]], key: str) -> int:
    """The largest of each block's backward over a run of blocks (`block_parts` each): the
    blocks before it keep `key`'s bytes, it keeps its own and its `backward_extra`."""
    before, largest = 0, None
    for k in kinds:
        before += k[key]
        moment = before + k["backward_extra"]
        largest = moment if largest is None else max(largest, moment)
    return largest


def torch_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, vocab: int, *,
                           element_bytes: int = 4, attention: str = "sdpa", dropout: float = 0.0,
                           ffn: int | None = None, **layout) -> int:
    """The peak of activation bytes in one step of meshtrain's GPT on one rank (`torch`
    accounting): `torch_stage_activation_bytes`, whose keyword arguments `layout` takes (tp,
    sp, recompute, pp, stage, schedule, microbatches, chunks, stage_layers); on one process
    with no recompute, every block's `torch_activation_bytes_per_layer`, plus the embedding's
    output (its dropout mask, the positions) and the final LayerNorm's output and
    statistics, plus two fp32 tensors of logits' size at the loss — the logits kept for
    backward, and in backward their gradient (the loss is computed in fp32 whatever the
    precision)."""
    return torch_stage_activation_bytes(layers, seq, micro_batch, hidden, heads, vocab, element_bytes=element_bytes,
                                        attention=attention, dropout=dropout, ffn=ffn, **layout)
