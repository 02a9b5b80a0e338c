"""The `torch` accounting's terms of one block beyond meshtrain's GPT (`memory.py` builds the
step's moments from them): the Llama's block (RMSNorm, rotary, grouped-query attention,
SwiGLU, its own head size), and what context parallelism's attention keeps and holds
(the ring, all-to-all). Pure arithmetic, no torch."""

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
    the widths of the query and the key projections (n_heads · head_dim, n_kv · head_dim)
    and the head size."""
    q_width: int
    kv_width: int
    head_dim: int


def llama_kept_bytes(seq: int, micro_batch: int, hidden: int, heads: int, dims: LlamaDims, *, element_bytes: int,
                     ffn: int | None, tp: int = 1, sp: bool = False) -> int:
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
    heads are merged without a copy. The trainer's layer probe measures exactly this."""
    e, b, s, d, t = element_bytes, micro_batch, seq, hidden, tp
    w, q, f = (t if sp else 1), dims.q_width, ffn or 4 * hidden
    # in fp32 the RMSNorms' upcast is the input itself: the residual stream is kept; in bf16 the
    # fp32 copies are, and the bf16 residual stream is freed at the next residual sum
    whole = 4 * b * s * d * e + (2 * b * s * d * e if e == 4 else 2 * b * s * d * 4) + 2 * b * s * 4
    split = (4 * b * s * q + 4 * b * s * f) * e // t + 4 * b * (heads // t) * s
    return whole // w + split + 2 * s * dims.head_dim * e


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
