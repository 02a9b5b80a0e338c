"""One block's activation bytes, analytically: the papers' table and what meshtrain's blocks
keep (`torch` accounting), the terms a step's moments are made of (`stage_activations.py`
adds them up over a pipeline stage's schedule).

The `paper` accounting (`activation_bytes_per_layer`: Korthikanti et al. 2022, Table 2,
16-bit activations and 1-byte dropout masks), for micro-batch b, sequence s, hidden h, a
heads, tensor-parallel size t:

    no recompute                  s·b·h·(10 + 24/t + 5·a·s/(h·t))      (t = 1: 34 + 5as/h)
    with sequence parallelism     s·b·h·(34/t + 5·a·s/(h·t))
    selective recompute           s·b·h·(10 + 24/t)   (with SP: 34/t)  — the 5as/h term gone
    full recompute                2·s·b·h             (with SP: /t)    — the block's input only

A mixture of experts' MoE layer (`moe`) has terms of its own (`block_terms.moe_kept_bytes`,
`moe_backward_extra`): it keeps, for the n tokens a rank routes (all of a micro-batch's
under tp, its share under SP or cp) and r = k·n rows, r·(2d·e + 4d + 4I·e + 28) + n·(4E + 4)
bytes beyond its attention's, e-byte activations — the rows gathered and the weighted rows
(d wide, e), the down projection's output in fp32 (4d), gate_up's output, SiLU and product
(4I, e), each row's order, token, choice and weights (28); the router's fp32 scores and
their sum."""

from __future__ import annotations

import math

from meshtrain.parallel.options import parse_recompute
from meshtrain.plan.block_terms import (LlamaDims, MoEDims, cp_attention_delta, llama_kept_bytes, moe_backward_extra,
                                        moe_kept_bytes, ring_backward_bytes)


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
