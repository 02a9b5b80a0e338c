"""The block kernel of ring attention: softmax attention of one block of queries against one
block of keys, returning its output and log-sum-exp (so that blocks merge by the online-softmax
rule), and a backward that takes the merged output and log-sum-exp of the block's queries, as
the flash-attention backward does. `choose_kernel` picks one per device and dtype:

| device, dtype   | kernel      | op: aten._scaled_dot_product_… | why |
|-----------------|-------------|--------------------------------|-----|
| CUDA, bf16/fp16 | `flash`     | `flash_attention`              | FlashAttention-2; q, k, v stay bf16 |
| (flash missing) | `cudnn`     | `cudnn_attention`              | cuDNN's fused kernel, same contract |
| CUDA, fp32      | `efficient` | `efficient_attention`          | flash and cuDNN reject fp32 |
| CPU, any dtype  | `cpu-flash` | `flash_attention_for_cpu`      | fused, in fp32 (inputs upcast) |
| anything else   | `math`      | exact fp32 in score tiles      | runs anywhere (`parallel/tiles.py`) |

Each op's backward is the same name with `_backward`.

The ops' quirks, absorbed here (calls written against torch 2.13's schemas, which match those
quoted for earlier releases; `tests/test_block_kernels.py` checks them on meta tensors):
- every op's log-sum-exp is fp32 and natural log (torch's own context_parallel merges them
  so). The efficient op's is padded along the queries to a multiple of 32, cuDNN's has a
  trailing 1: `forward` returns [b, h, n_q], and `backward` gives each op the merged one back
  in the shape its forward returned (`_lse_for_op`), contiguous, padded with +inf.
- the CUDA backwards need what only their forward returns: cum_seq_q/k, max_q/k and the
  philox seed/offset (`state`). A ring's blocks are all c × c and run without dropout, so
  one block's state serves every block's backward.
- the efficient backward reads `out` with a query-row stride of h·d ([b, n, h, d] storage).
- flash aligns its causal mask bottom-right when n_q ≠ n_k, the others top-left: they agree
  on square blocks, the only causal ones a ring has; a causal block that is not square is
  refused.
- the backwards take dout and out in the op's dtype (bf16 for flash), the lse in fp32.
- called directly (not through sdpa, which pads first), flash and cuDNN need a head
  dimension that is a multiple of 8, the efficient op 16 bytes' worth: zeros are padded on
  (llama-test's heads are 12 wide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from meshtrain.parallel.tiles import MATH_TILE_BYTES, tile_rows

aten = torch.ops.aten
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockKernel:
    """One way to compute a ring block. `dtype`: what the op takes q, k, v, out and dout in
    (None: the inputs' own). `head_multiple`: the head dimension the op needs a multiple of
    (zeros are padded on, as sdpa pads before these ops; with the scale given, they change
    nothing)."""
    name: str
    dtype: torch.dtype | None
    fwd: Callable
    bwd: Callable
    head_multiple: int = 1

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype or dtype

    def forward(self, q, k, v, scale: float, causal: bool):
        """(output in the op's dtype, fp32 log-sum-exp [b, h, n_q], the op's state for the
        backward). q: [b, h, n_q, d]; k, v: [b, h, n_k, d] (already repeated to h heads)."""
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError(f"a causal block must be square (the kernels align the mask differently otherwise); "
                             f"got {q.shape[2]} queries and {k.shape[2]} keys")
        dtype, d = self.compute_dtype(q.dtype), q.shape[-1]
        out, lse, state = self.fwd(*(self._padded(t.to(dtype)) for t in (q, k, v)), scale, causal)
        return (out[..., :d] if out.shape[-1] != d else out), lse, state

    def backward(self, dout, q, k, v, out, lse, state, scale: float, causal: bool):
        """(dq, dk, dv) in the op's dtype, given the merged output and fp32 log-sum-exp of the
        block's queries and the state of a forward of a block of this shape."""
        dtype, d = self.compute_dtype(q.dtype), q.shape[-1]
        grads = self.bwd(*(self._padded(t.to(dtype)) for t in (dout, q, k, v, out)), lse, state, scale, causal)
        return tuple(g[..., :d] if g.shape[-1] != d else g for g in grads)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:
        pad = -t.shape[-1] % self.head_multiple
        return F.pad(t, (0, pad)) if pad else t


def _lse_rows(lse: torch.Tensor, n: int) -> torch.Tensor:
    """An op's log-sum-exp as [b, h, n]: cuDNN's trailing 1 dropped, the efficient op's padding cut."""
    return lse.flatten(2)[:, :, :n]


def _lse_for_op(lse: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The merged [b, h, n] log-sum-exp in the shape the op's forward returned: contiguous,
    padded with +inf (a padded row's probabilities are 0) to the op's width."""
    pad = math.prod(shape[2:]) - lse.shape[2]
    return (F.pad(lse, (0, pad), value=math.inf) if pad else lse.contiguous()).reshape(shape)


def _rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """t [b, h, n, d] over [b, n, h, d] storage (a query row's heads side by side), as the
    efficient backward reads `out`; copied only if it is not."""
    _, h, _, d = t.shape
    if t.stride(3) == 1 and t.stride(1) == d and t.stride(2) == h * d:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _flash_forward(q, k, v, scale, causal):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, _lse_rows(lse, q.shape[2]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, state, scale, causal):
    shape, cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, _lse_for_op(lse, shape), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
        scale=scale)


def _cudnn_forward(q, k, v, scale, causal):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, _lse_rows(lse, q.shape[2]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, state, scale, causal):
    shape, cum_q, cum_k, max_q, max_k, seed, offset = state  # cuDNN takes its s_q, s_kv from max_q, max_k
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, _lse_for_op(lse, shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
        scale=scale)


def _efficient_forward(q, k, v, scale, causal):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, _lse_rows(lse, q.shape[2]), (lse.shape, seed, offset)


def _efficient_backward(dout, q, k, v, out, lse, state, scale, causal):
    shape, seed, offset = state
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, _rows_of_heads(out), _lse_for_op(lse, shape), seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _cpu_flash_forward(q, k, v, scale, causal):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_flash_backward(dout, q, k, v, out, lse, state, scale, causal):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _scores(q, k, scale: float, causal: bool, first: int = 0) -> torch.Tensor:
    """The fp32 attention scores of a block's queries from row `first` on (fp32 q, k), the
    diagonal block's later keys masked."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1 + first)
        scores.masked_fill_(mask, float("-inf"))
    return scores


def _row_chunks(q, k, budget: int) -> list[slice]:
    """The math kernel's query rows per score tile (`tiles.tile_rows`)."""
    b, h, n, _ = q.shape
    rows = tile_rows(b, h, n, k.shape[2], budget)
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _math_forward(q, k, v, scale, causal, tile_bytes=MATH_TILE_BYTES):
    """Softmax attention of one block in fp32, one score tile alive at a time (the
    probabilities in place). The mask is top-left causal, as the fused kernels' for a square block."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for rows in _row_chunks(q, k, tile_bytes):
        scores = _scores(q[:, :, rows], k, scale, causal, rows.start)
        lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
        out[:, :, rows] = torch.matmul(scores.sub_(lse[:, :, rows].unsqueeze(-1)).exp_(), v)
    return out, lse, None


def _math_backward(dout, q, k, v, out, lse, state, scale, causal, tile_bytes=MATH_TILE_BYTES):
    """P = exp(S − lse); dV = Pᵀ·dO; dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)). A tile's rows give
    their dq and add to dk, dv; at most two tiles alive."""
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rows in _row_chunks(q, k, tile_bytes):
        g = dout[:, :, rows]
        p = _scores(q[:, :, rows], k, scale, causal, rows.start).sub_(lse[:, :, rows].unsqueeze(-1)).exp_()
        dv += torch.matmul(p.transpose(-2, -1), g)
        ds = p.mul_(torch.matmul(g, v.transpose(-2, -1)).sub_((g * out[:, :, rows]).sum(-1, keepdim=True)))
        ds.mul_(scale)
        dq[:, :, rows] = torch.matmul(ds, k)
        dk += torch.matmul(ds.transpose(-2, -1), q[:, :, rows])
    return dq, dk, dv


def math_kernel(tile_bytes: int = MATH_TILE_BYTES) -> BlockKernel:
    """The exact fp32 kernel, its score tiles within `tile_bytes` (tests use small ones)."""
    return BlockKernel("math", torch.float32, partial(_math_forward, tile_bytes=tile_bytes),
                       partial(_math_backward, tile_bytes=tile_bytes))


KERNELS = {k.name: k for k in (
    BlockKernel("flash", None, _flash_forward, _flash_backward, head_multiple=8),
    BlockKernel("cudnn", None, _cudnn_forward, _cudnn_backward, head_multiple=8),
    BlockKernel("efficient", None, _efficient_forward, _efficient_backward, head_multiple=4),  # 16 bytes of fp32
    BlockKernel("cpu-flash", torch.float32, _cpu_flash_forward, _cpu_flash_backward),
    math_kernel(),
)}


def _has(op: str) -> bool:
    return hasattr(aten, op)


def _cuda_kernels(device: torch.device) -> set[str]:
    """The fused CUDA kernels this build and GPU run and sdpa's backend switches allow (flash
    and cuDNN attention need sm80+)."""
    cuda, names = torch.backends.cuda, set()
    ampere = torch.cuda.get_device_capability(device) >= (8, 0)
    if ampere and cuda.is_flash_attention_available() and cuda.flash_sdp_enabled() \
            and _has("_scaled_dot_product_flash_attention"):
        names.add("flash")
    if ampere and torch.backends.cudnn.is_available() and cuda.cudnn_sdp_enabled() \
            and _has("_scaled_dot_product_cudnn_attention"):
        names.add("cudnn")
    if cuda.mem_efficient_sdp_enabled() and _has("_scaled_dot_product_efficient_attention"):
        names.add("efficient")
    return names


def available(device) -> frozenset[str]:
    """The kernels that can run on `device` here (`math` always)."""
    device = torch.device(device)
    names = {"math"}
    if device.type == "cpu" and _has("_scaled_dot_product_flash_attention_for_cpu"):
        names.add("cpu-flash")
    if device.type == "cuda" and torch.cuda.is_available():
        names |= _cuda_kernels(device)
    return frozenset(names)


def pick(device_type: str, dtype: torch.dtype, have) -> str:
    """The kernel's name for a device type and dtype, given the names available there (the
    table above; a pure function, so every case is tested without a GPU)."""
    if device_type == "cuda":
        order = ("flash", "cudnn") if dtype in HALF else ("efficient",) if dtype == torch.float32 else ()
    elif device_type == "cpu":
        order = ("cpu-flash",)
    else:
        order = ()
    return next((name for name in order if name in have), "math")


def choose_kernel(device, dtype: torch.dtype, override: BlockKernel | str | None = None) -> BlockKernel:
    """The block kernel for q on `device` in `dtype`; `override` (a kernel or its name) forces one."""
    if isinstance(override, BlockKernel):
        return override
    if override is not None:
        if override not in KERNELS:
            raise ValueError(f"no block kernel {override!r}; use one of {', '.join(KERNELS)}")
        return KERNELS[override]
    device = torch.device(device)
    return KERNELS[pick(device.type, dtype, available(device))]
