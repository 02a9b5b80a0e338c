"""The ring's block kernels (meshtrain/parallel/block_kernels.py), one process: each kernel
against whole-block sdpa (output, log-sum-exp, and the backward's dq, dk, dv given the output
and log-sum-exp), two blocks merged as the ring merges them, which kernel is chosen where, and
the CUDA kernels' op calls against this torch's schemas on meta tensors. The CUDA cases run
where a GPU is (benchmarks/gpu_check.sh runs this file there)."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshtrain.parallel import block_kernels as bk
from meshtrain.parallel.context import _merge

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _cuda(name, dtype, tol):
    """A CUDA case, skipped where this machine cannot run that kernel."""
    runs = torch.cuda.is_available() and name in bk.available("cuda")
    return pytest.param(name, "cuda", dtype, tol, id=f"{name}-{str(dtype)[6:]}",
                        marks=pytest.mark.skipif(not runs, reason=f"needs a GPU that runs the {name} kernel"))


# (kernel, device, input dtype, tolerance relative to the reference's largest magnitude). The
# CPU kernels compute in fp32 from the inputs' values: exact to fp32 rounding. bf16 keeps 8
# bits, fp16 11; the efficient kernel in fp32 may use TF32 on the GPU.
CASES = [
    pytest.param("cpu-flash", "cpu", FP32, 1e-5, id="cpu-flash-fp32"),
    pytest.param("cpu-flash", "cpu", BF16, 1e-5, id="cpu-flash-bf16-inputs"),
    pytest.param("math", "cpu", FP32, 1e-5, id="math"),
    pytest.param("math-tiled", "cpu", FP32, 1e-5, id="math-tiled"),
    pytest.param("cpu-flash-padded", "cpu", FP32, 1e-5, id="cpu-flash-padded"),
    _cuda("flash", BF16, 3e-2),
    _cuda("flash", FP16, 1e-2),
    _cuda("efficient", FP32, 2e-3),
    _cuda("cudnn", BF16, 3e-2),
]

# (batch, heads, queries, keys, head_dim, causal): 37 is no multiple of 32 (the efficient
# op's padded log-sum-exp); non-causal blocks of different lengths either way; heads 12 wide
# (llama-test's), which flash and cuDNN take padded to 16
SHAPES = [
    (2, 3, 40, 40, 16, True),
    (2, 3, 40, 40, 16, False),
    (1, 2, 37, 37, 8, True),
    (1, 2, 37, 37, 8, False),
    (2, 2, 24, 50, 8, False),
    (1, 2, 70, 33, 16, False),
    (1, 4, 128, 128, 64, True),
    (2, 2, 24, 24, 12, True),
]


def _kernel(name):
    """The kernel by name; `math-tiled`: the math kernel in score tiles of a few query rows;
    `cpu-flash-padded`: the CPU kernel given heads padded to a multiple of 8, as flash and
    cuDNN are (the padding checked here without a GPU)."""
    if name == "math-tiled":
        return bk.math_kernel(tile_bytes=6 * 1024)  # 3 to 23 query rows a tile over SHAPES, the last uneven
    if name == "cpu-flash-padded":
        cpu = bk.KERNELS["cpu-flash"]
        return bk.BlockKernel("cpu-flash-padded", FP32, cpu.fwd, cpu.bwd, head_multiple=8)
    return bk.KERNELS[name]


def _inputs(b, h, n_q, n_k, d, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g)
    k, v = torch.randn(b, h, n_k, d, generator=g), torch.randn(b, h, n_k, d, generator=g)
    dout = torch.randn(b, h, n_q, d, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)]


def _allowed(n_q, n_k, causal, first, device):
    """Which keys each query attends: all, or those at or before its position (`first` + row)."""
    if not causal:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    return torch.arange(n_k, device=device) <= first + torch.arange(n_q, device=device).unsqueeze(1)


def _reference(q, k, v, dout, scale, allowed):
    """sdpa in fp64 on the inputs' values: output, log-sum-exp of the scaled masked scores,
    and autograd's dq, dk, dv."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    out.backward(dout.double())
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~allowed, -math.inf)
    return out.detach(), torch.logsumexp(scores, -1).detach(), q.grad, k.grad, v.grad


def _close(got, want, tol, what):
    """Within `tol` of the reference's largest magnitude (at least 1, for the log-sum-exp)."""
    err = (got.double() - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("b, h, n_q, n_k, d, causal", SHAPES)
@pytest.mark.parametrize("name, device, dtype, tol", CASES)
def test_kernel_equals_sdpa_on_one_block(name, device, dtype, tol, b, h, n_q, n_k, d, causal):
    """Forward: output and fp32 log-sum-exp [b, h, n_q] (natural log). Backward, given that
    output and log-sum-exp: dq, dk, dv, as autograd through sdpa gives them."""
    kernel = _kernel(name)
    q, k, v, dout = _inputs(b, h, n_q, n_k, d, device, dtype)
    scale = 1 / math.sqrt(d)
    out, lse, state = kernel.forward(q, k, v, scale, causal)
    assert lse.dtype == FP32 and lse.shape == (b, h, n_q) and out.shape == q.shape
    want = _reference(q, k, v, dout, scale, _allowed(n_q, n_k, causal, 0, q.device))
    grads = kernel.backward(dout, q, k, v, out, lse, state, scale, causal)
    for got, ref, what in zip((out, lse, *grads), want, ("out", "lse", "dq", "dk", "dv")):
        assert got.shape == ref.shape, what
        _close(got, ref, tol, what)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name, device, dtype, tol", CASES)
def test_two_blocks_merged_equal_attention_over_both(name, device, dtype, tol, causal):
    """What the ring relies on: a query block's output over two key blocks, merged in fp32 by
    context's online-softmax rule, and each block's backward given the merged output and
    log-sum-exp (and, as in the ring, the last forward's op state), equal sdpa over the
    concatenated keys. Causal: the queries are the second block's positions, so the first key
    block is whole and the second is the diagonal one."""
    kernel = _kernel(name)
    b, h, c, d = 2, 3, 24, 16
    q, k, v, dout = _inputs(b, h, c, 2 * c, d, device, dtype, seed=1)
    scale = 1 / math.sqrt(d)
    blocks = [(slice(0, c), False), (slice(c, 2 * c), causal)]
    out = torch.zeros(q.shape, dtype=FP32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=FP32, device=q.device)
    for ks, diagonal in blocks:
        part, part_lse, state = kernel.forward(q, k[:, :, ks], v[:, :, ks], scale, diagonal)
        _merge(out, lse, part, part_lse)
    op_dtype = kernel.compute_dtype(dtype)
    grads = [kernel.backward(dout.to(op_dtype), q, k[:, :, ks], v[:, :, ks], out.to(op_dtype), lse, state, scale,
                             diagonal) for ks, diagonal in blocks]
    dq = sum(g[0].float() for g in grads)
    dk, dv = (torch.cat([g[i] for g in grads], dim=2) for i in (1, 2))
    want = _reference(q, k, v, dout, scale, _allowed(c, 2 * c, causal, c, q.device))
    for got, ref, what in zip((out, lse, dq, dk, dv), want, ("out", "lse", "dq", "dk", "dv")):
        _close(got, ref, tol, what)


def test_a_causal_block_must_be_square():
    q, k, v, _ = _inputs(1, 1, 8, 16, 8, "cpu", FP32)
    with pytest.raises(ValueError, match="causal block must be square"):
        bk.KERNELS["cpu-flash"].forward(q, k, v, 0.5, True)


def test_choose_kernel_per_device_and_dtype():
    """The table in block_kernels' docstring, as a pure function of (device type, dtype, what
    is available), then `choose_kernel` on this machine and its overrides."""
    every = {"flash", "cudnn", "efficient", "cpu-flash", "math"}
    assert bk.pick("cuda", BF16, every) == "flash"
    assert bk.pick("cuda", FP16, every) == "flash"
    assert bk.pick("cuda", BF16, every - {"flash"}) == "cudnn"
    assert bk.pick("cuda", BF16, {"efficient", "math"}) == "math"
    assert bk.pick("cuda", FP32, every) == "efficient"
    assert bk.pick("cuda", FP32, every - {"efficient"}) == "math"
    assert bk.pick("cuda", torch.float64, every) == "math"
    assert bk.pick("cpu", FP32, every) == bk.pick("cpu", BF16, every) == "cpu-flash"
    assert bk.pick("cpu", FP32, {"math"}) == "math"
    assert bk.pick("mps", BF16, every) == bk.pick("xpu", FP32, every) == "math"

    assert bk.choose_kernel("cpu", BF16).name == "cpu-flash"  # torch ≥ 2.2 has the CPU flash kernel
    assert bk.choose_kernel(torch.device("meta"), BF16).name == "math"
    assert bk.choose_kernel("cpu", FP32, "math").name == "math"
    tiled = bk.math_kernel(tile_bytes=1024)
    assert bk.choose_kernel("cpu", FP32, tiled) is tiled
    with pytest.raises(ValueError, match="no block kernel 'flash2'; use one of flash, cudnn"):
        bk.choose_kernel("cpu", FP32, "flash2")
    if not torch.cuda.is_available():
        assert bk.available("cuda") == {"math"}


@pytest.mark.parametrize("n_q, n_k, d, causal", [(40, 40, 64, True), (37, 37, 64, False), (24, 50, 64, False),
                                                 (24, 24, 12, True)])
@pytest.mark.parametrize("name, dtype", [("flash", BF16), ("cudnn", BF16), ("efficient", FP32)])
def test_cuda_kernels_call_this_torchs_ops(name, dtype, n_q, n_k, d, causal):
    """Without a GPU: each CUDA kernel's forward and backward on meta tensors (shapes only,
    no numbers), so their calls match this torch's schemas, the log-sum-exp comes out
    [b, h, n_q] fp32 (the efficient op's padding cut, cuDNN's trailing 1 dropped) and goes
    back in the shape the op's forward returned; a head dimension the op cannot take is
    padded on and cut off again."""
    kernel = bk.KERNELS[name]
    b, h = 2, 3
    q, k, v, dout = (torch.empty(b, h, n, d, device="meta", dtype=dtype) for n in (n_q, n_k, n_k, n_q))
    out, lse, state = kernel.forward(q, k, v, 0.125, causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, h, n_q) and lse.dtype == FP32
    merged = torch.empty(b, h, 2 * n_q, device="meta")[:, :, n_q:]  # a ring's slice of the merged lse
    dq, dk, dv = kernel.backward(dout, q, k, v, out, merged, state, 0.125, causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
