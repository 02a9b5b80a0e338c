"""The `torch` accounting's terms of one block beyond meshtrain's GPT (`activations.py` takes
a block's terms from them, `stage_activations.py` the step's moments from those): the
Llama's block (RMSNorm, rotary, grouped-query attention, SwiGLU, its own head size), and
what context parallelism's attention keeps and holds (the ring, all-to-all). Pure
arithmetic, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.parallel.tiles import tile_rows


def cp_attention_delta(seq: int, micro_batch: int, hidden: int, llama: LlamaDims | None, *, element_bytes: int,
                       tp: int = 1, cp_mode: str | None = None) -> int:
    """What a block's attention keeps under context parallelism beyond the kernel's q, k, v
    (repeated to the query heads) and output, 4·q per token (`seq`: the rank's tokens):
    the ring keeps q, k and v unrepeated (2·d_kv), its fp32 output and, in bf16, the output's
    copy in the compute dtype; all-to-all keeps the kernel's four on the heads it gathered
    and the output gathered back, 5·q. Against the meter: tests/test_plan_llama.py."""
    if cp_mode is None:
        return 0
    e, rows = element_bytes, micro_batch * seq
    q, kv = (llama.q_width, llama.kv_width) if llama else (hidden, hidden)
    if cp_mode == "ulysses":
        kept = 5 * q * e
    else:
        kept = q * e + 2 * kv * e + q * 4 + (q * e if e < 4 else 0)
    return rows * (kept - 4 * q * e) // tp


@dataclass(frozen=True)
class LlamaDims:
    """What the `torch` accounting needs of a Llama block beyond a GPT's hidden and heads:
    the widths of the query and the key projections (n_heads · head_dim, n_kv · head_dim),
    the head size, and a MoE's RMSNorm on queries and keys ("head", "projection" or "none")."""
    q_width: int
    kv_width: int
    head_dim: int
    qk_norm: str = "none"


@dataclass(frozen=True)
class MoEDims:
    """What the `torch` accounting needs of a MoE model's blocks beyond a Llama's: its experts
    (E, the k each token takes, their SwiGLU width I), a shared expert's width, whether the
    top-k weights are renormalised, the rows each auxiliary balancing loss is taken over (0:
    none) and which blocks keep a dense MLP."""
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0
    norm_topk: bool = True
    aux_rows: int = 1
    dense_layers: tuple[int, ...] = ()
    ep: int = 1  # the ranks the experts are split over (`parallel/experts.py`)
    rows_share: int = 1  # the experts run 1/rows_share of the rank's tokens' rows (tp without SP under ep)
    load: float = 1.0  # the rows a rank's experts receive over the balanced share (the worst rank planned)

    def is_moe(self, layer: int) -> bool:
        return layer not in self.dense_layers


def qk_norm_kept_bytes(tokens: int, heads: int, dims: LlamaDims, *, element_bytes: int, tp: int = 1) -> int:
    """What the q/k RMSNorms keep of `tokens` tokens, beyond the Llama's attention: each
    norm's input (in fp32: the projection's output; in bf16 its fp32 copy) and its fp32
    normalised values in the compute dtype (4 + e bytes an element, q and k wide: split by
    heads over tp), and the reciprocal root mean squares (fp32: one per head and token, or
    one per token and projection)."""
    if dims.qk_norm == "none":
        return 0
    e, t = element_bytes, tp
    width = (dims.q_width + dims.kv_width) // t
    rstd = (heads + dims.kv_width // dims.head_dim) // t if dims.qk_norm == "head" else 2
    return tokens * width * (4 + e) + tokens * rstd * 4


def moe_kept_bytes(tokens: int, micro_batch: int, hidden: int, moe: MoEDims, *, element_bytes: int,
                   summed: bool = False) -> int:
    """What a MoE layer's MLP keeps for backward on one rank, for the n = `tokens` tokens it
    routes (all of the micro-batch's under tp: the experts are replicated; under SP or cp
    the rank's share), r = k·n rows, d = hidden, E experts of width I, e-byte activations
    (`models/moe.py`):
    - the router: its fp32 scores (n·E), the chosen experts (n·k int64), when renormalised
      the gathered weights (n·k fp32) and their sum (n), and in bf16 the fp32 copies of
      its input (n·d) and of its weight (E·d) that the fp32 product keeps;
    - the experts: the order of the rows by expert and each row's token (r int64 each), the
      rows gathered (r·d), grouped_mm's group ends (E int32), gate_up's output (r·2I), the
      SiLU and the product (r·I each), the down projection's output in fp32 (r·d·4: fp32
      weighting), each row's weight (r fp32) and the rows put back in token order (r·d);
    - the balancing loss's per-group sums and terms (g groups: g·(5E + 3) fp32), and where the
      sums are added over the ranks holding other tokens of the same rows (`summed`: SP, cp)
      their sum's own copy (g·3E);
    - a shared expert's SwiGLU (4·n·f_s);
    - under expert parallelism, the group ends of the rank's E/ep experts only, and the
      order regrouping the arrived rows by expert and its inverse (r int64 each). The
      experts' own terms (their input rows, gate_up, SiLU and product, the regrouping) are
      of the rows that arrive: `load` × r (1 when balanced: as many arrive as leave).
    In bf16 (no shared expert), the post-attention RMSNorm's bf16 output is not kept: the
    router keeps its fp32 copy and the experts gather their rows from it — `moe_layer_delta`."""
    e, n, d = element_bytes, tokens, hidden
    E, k, I = moe.experts, moe.top_k, moe.expert_ffn
    r = n * k // moe.rows_share
    r_in = round(r * moe.load)  # the rows this rank's experts receive (r when balanced)
    router = n * E * 4 + n * k * 8 + (n * k * 4 + n * 4 if moe.norm_topk else 0)
    router += (n * d * 4 + E * d * 4) if e < 4 else 0
    experts = 2 * r * 8 + r_in * d * e + E // moe.ep * 4 + r_in * 2 * I * e + 2 * r_in * I * e + r * d * 4 + r * 4
    experts += r * d * e + (2 * r_in * 8 if moe.ep > 1 else 0)
    return router + experts + _aux_bytes(micro_batch, moe, summed) + 4 * n * moe.shared_ffn * e


def _aux_bytes(micro_batch: int, moe: MoEDims, summed: bool) -> int:
    """The balancing loss's kept terms: per group of rows, its sums [3, E] (and their sum over
    ranks' copy) and a few fp32 numbers (`models/moe.balance_loss`)."""
    if not moe.aux_rows:
        return 0
    groups = micro_batch // moe.aux_rows
    return groups * (5 * moe.experts + 3 + (3 * moe.experts if summed else 0)) * 4


def moe_backward_extra(tokens: int, hidden: int, moe: MoEDims, *, element_bytes: int) -> int:
    """What a MoE layer's backward allocates beyond its saved tensors and its output's
    gradient, at its largest (n tokens, r = k·n rows; weight gradients counted until they are
    added to their buffers). Throughout: the balancing loss's gradient of the scores' share
    (n·3E fp32, a view of its stacked gradient) until the router's backward. Then, in order:
    - the weighting: the reordered rows freed, the rows' output gradient gathered (in fp32),
      the gradients of the down projection's output and of the weights (and its product
      before the sum): 3·r·d fp32 and r;
    - the down projection: its output's gradient (in the compute dtype), its weight's
      gradient E·d·I and its input's r·I (the weighting's fp32 terms freed);
    - (under ep with tp and no SP each tp rank runs r/tp of the rows: `rows_share`)
    - the SwiGLU product's backward: the gradients of SiLU's output and of up (2·r·I), the
      product freed;
    - gate_up's backward: its weight's gradient E·2I·d and its input's r·d, SiLU's output,
      gate_up's output and the product's gradient freed.
    With a shared expert, its own backward comes first (the Llama MLP's) and its input's
    gradient (n·d) is held through the experts'."""
    e, n, d = element_bytes, tokens, hidden
    E, k, I = moe.experts, moe.top_k, moe.expert_ffn
    r = n * k // moe.rows_share
    r_in = round(r * moe.load)  # the rows this rank's experts ran
    aux = n * 3 * E * 4 if moe.aux_rows else 0
    held = aux - r * d * e  # the aux gradient; the reordered rows freed
    weighting = held + 3 * r * d * 4 + r * 4
    after = held - r * 4 - r * d * 4  # the weighting's fp32 terms and the rows' weights freed
    down = after + r_in * d * e + E * d * I * e + r_in * I * e
    product = after + 2 * r_in * I * e
    gate_up = after - 2 * r_in * I * e + 2 * E * I * d * e + r_in * d * e
    extra = max(weighting, down, product, gate_up)
    if moe.shared_ffn:
        f = moe.shared_ffn
        shared = aux + max(n * f * e + d * f * e, 2 * n * f * e)
        extra = max(shared, extra - 4 * n * f * e + n * d * e)
    return extra


def llama_kept_bytes(seq: int, micro_batch: int, hidden: int, heads: int, dims: LlamaDims, *, element_bytes: int,
                     ffn: int | None, tp: int = 1, sp: bool = False, moe: MoEDims | None = None,
                     context: bool = False) -> int:
    """What one block of meshtrain's Llama keeps for backward on one rank (no recompute),
    for `element_bytes`-byte activations; d = hidden, q = n_heads · head_dim, f the SwiGLU
    width, t = tp, w = t under SP (else 1):

    - whole (÷ w): each RMSNorm's normalised input and its weighted output (2·b·s·d each),
      its reciprocal root mean square (b·s fp32), and its input: in fp32 the residual stream
      after attention and after the MLP (2·b·s·d: the norms' upcast is the tensor itself),
      in bf16 their fp32 copies (4 bytes an element) — the bf16 stream is freed at the next
      residual sum, so a bf16 block does not keep its own output (the layer probe, read at
      the block's end, sees it alive: `kept` + `out`);
    - split by heads or columns (÷ t): the rotated queries, the keys and values as the
      kernel sees them (grouped-query attention repeats each key/value head for its
      queries, so they are q wide too), the attention's output, 4·b·s·q; the MLP's gate and
      up outputs, the gate's SiLU and the product, 4·b·s·f; sdpa's log-sum-exp
      (b·(a/t)·s, fp32);
    - the rotary cos and sin of the attention's sequence (2·s·head_dim, whole: every rank
      computes them for the s positions it attends over).

    The sdpa kernel writes its output in the layout the output projection reads, so the
    heads are merged without a copy. The trainer's layer probe measures exactly this.

    A MoE model's block adds its q/k norms' terms (`qk_norm_kept_bytes`), and where its MLP
    is a mixture of experts (`moe`) keeps the experts' (`moe_kept_bytes`, for the b·s/w
    tokens the rank routes: replicated over tp, split under SP) instead of the SwiGLU's —
    in bf16 without the post-attention RMSNorm's bf16 output, which nothing keeps there;
    `context`: context parallelism splits the rows' tokens too (the balancing sums are added
    over cp)."""
    e, b, s, d, t = element_bytes, micro_batch, seq, hidden, tp
    w, q, f = (t if sp else 1), dims.q_width, ffn or 4 * hidden
    # in fp32 the RMSNorms' upcast is the input itself: the residual stream is kept; in bf16 the
    # fp32 copies are, and the bf16 residual stream is freed at the next residual sum
    whole = 4 * b * s * d * e + (2 * b * s * d * e if e == 4 else 2 * b * s * d * 4) + 2 * b * s * 4
    split = (4 * b * s * q + (4 * b * s * f if moe is None else 0)) * e // t + 4 * b * (heads // t) * s
    kept = whole // w + split + 2 * s * dims.head_dim * e + qk_norm_kept_bytes(b * s, heads, dims, element_bytes=e, tp=t)
    if moe is not None:
        n = b * s // w
        summed = (sp and t > 1) or context
        kept += moe_kept_bytes(n, b, d, moe, element_bytes=e, summed=summed) - (n * d * e if e < 4 and not moe.shared_ffn
                                                                                 else 0)
    return kept


def ring_backward_bytes(seq: int, micro_batch: int, hidden: int, heads: int, llama: LlamaDims | None, *,
                        element_bytes: int = 4, tp: int = 1, fused: bool = False) -> int:
    """What ring attention's backward holds beyond its saved tensors (`seq`: the rank's
    tokens, two chunks of c = seq/2), fp32 but where said:
    - the output's gradient (the output projection's input gradient, q wide, in the compute
      dtype, and in bf16 its fp32 copy);
    - one block's three gradients (of c queries and c keys: 3·b·c·q), and in bf16 its q, k
      and v in fp32 (3·b·c·q);
    - from the math kernel (not the fused one: `fused`), over the r query rows a score tile
      holds (`parallel.tiles.tile_rows`: at most 64 MiB), two tiles (the probabilities and
      dO·Vᵀ, 2·b·(a/t)·r·c) and dO ∘ O (b·r·q);
    - the accumulators of dq, and of dk and dv at the query heads' width before they are
      folded to the key/value heads; those arriving from the previous rank (2·d_kv);
    - under grouped-query attention, the visiting keys and values repeated to the query
      heads (in the compute dtype).
    Full recompute peaks here: against the meter, see docs/context.md."""
    b, c, a, rows = micro_batch, seq // 2, heads // tp, micro_batch * seq
    q, kv = (llama.q_width // tp, llama.kv_width // tp) if llama else (hidden // tp, hidden // tp)
    r = tile_rows(b, a, c, c)
    tiles = 0 if fused else (2 * b * a * r * c + b * r * q) * 4
    block = 3 * b * c * q * 4 * (2 if element_bytes < 4 else 1)
    accumulators = rows * (q + 2 * q + 2 * kv) * 4
    output_grad = rows * q * element_bytes + (rows * q * 4 if element_bytes < 4 else 0)
    repeated = 2 * rows * q * element_bytes if q != kv else 0
    return output_grad + block + tiles + accumulators + repeated
