"""Context parallelism: every sequence split over the cp ranks, attention by a ring.

Causal balancing (head-tail): the sequence is cut into 2·cp chunks and rank r holds chunks
r and 2·cp−1−r, so that every rank computes the same area of the causal score matrix
(`sequence_positions`, `shard_sequence`). Everything but attention is per token and runs on
the rank's tokens as it is; the positions a model computes (learned positions, RoPE) are
made the tokens' global ones by replacing its modules' `positions(n, device)`.

Ring attention (`RingAttention`): each rank keeps its queries; the keys and values (before
grouped-query attention repeats them: n_kv heads) travel around the cp ring, cp−1 hops,
each hop's transfer issued before the block it overlaps is computed. A block's partial
output and log-sum-exp merge into the running ones by the online-softmax rule. Backward
sends the keys and values around again, and with them, one hop behind, the fp32
accumulators of their gradients, which after cp hops arrive home complete: per rank and
layer, forward 2·b·s·d_kv·(cp−1)/cp elements in the compute dtype; backward as much again,
plus 2·b·s·d_kv fp32 (the gradients' cp hops). A block whose keys all lie after its
queries is skipped; the diagonal ones are causal.

The block kernel (`parallel/block_kernels.py`) is chosen once per call from q's device and
dtype: FlashAttention (or cuDNN) on CUDA in bf16/fp16, the memory-efficient kernel on CUDA
in fp32, torch's fused flash kernel in fp32 on CPU, exact fp32 math elsewhere. q, k and v
go in in their own dtype (the kernel casts what its op needs); a block's output and
log-sum-exp merge into fp32 accumulators. Its backward takes the merged output and
log-sum-exp, as the flash-attention backward does.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm
from meshtrain.parallel.block_kernels import BlockKernel, choose_kernel

CP = "cp"


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2·cp chunks of a sequence that cp rank `rank` holds (head-tail)."""
    return rank, 2 * cp - 1 - rank


def sequence_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of the tokens cp rank `rank` holds, in its order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2·cp = {2 * cp} equal chunks; use a "
                         f"multiple of {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of a [batch, seq, ...] tensor (inputs or targets)."""
    return t[:, sequence_positions(t.shape[1], rank, cp, t.device)]


def _merge(out, lse, part, part_lse):
    """Fold a block's (output, log-sum-exp) into the running fp32 ones, in place (online
    softmax); a bf16 kernel's output is upcast first."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part.float() * torch.exp(part_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _repeat(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _fold(t: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of `_repeat`: sum each key/value head's `group` query heads."""
    if group == 1:
        return t
    b, h, c, d = t.shape
    return t.view(b, h // group, group, c, d).sum(2)


def _pairs(rank: int, owner: int, cp: int):
    """Which (query chunk, key chunk) blocks rank `rank` computes against the keys of
    `owner`, and whether each is causal (the diagonal): a later key chunk is skipped."""
    for i, qi in enumerate(chunk_ids(rank, cp)):
        for j, kj in enumerate(chunk_ids(owner, cp)):
            if kj <= qi:
                yield i, j, kj == qi


class Ring:
    """The cp ring of one rank: its neighbours' transfers, the block areas it computed
    (query × key positions per kernel call, for the balance measurement), and a block kernel
    to force (a `BlockKernel` or its name; tests), else chosen per call from q."""

    def __init__(self, comm: Comm, kernel: BlockKernel | str | None = None):
        self.comm, self.mesh = comm, comm.mesh
        self.cp, self.rank = self.mesh.size(CP), self.mesh.coord(CP)
        self.area = 0
        self.kernel = kernel

    def kernel_for(self, q: torch.Tensor) -> BlockKernel:
        return choose_kernel(q.device, q.dtype, self.kernel)

    def pass_on(self, tensors: list[torch.Tensor]):
        """Send `tensors` to the next rank and receive their like from the previous one, as
        one group of transfers: (received tensors, handles to wait on)."""
        got = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [(True, t, +1, 0) for t in tensors] + [(False, g, -1, 0) for g in got]
        return got, self.comm.exchange(ops, CP, wrap=True)


def _wait(handles) -> None:
    for h in handles:
        h.wait()


def _visits(ring: Ring, k: torch.Tensor, v: torch.Tensor, group: int):
    """The keys and values of each cp rank in turn, this rank's first, repeated to the query
    heads, with the blocks to compute against them ((query slice, key slice, causal)); the
    next rank's are in flight while the caller computes. Counts the blocks' areas."""
    c = k.shape[2] // 2
    here = (k, v)
    for step in range(ring.cp):
        owner = (ring.rank - step) % ring.cp
        nxt, handles = ring.pass_on(list(here)) if step < ring.cp - 1 else (None, [])
        blocks = [(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), causal)
                  for i, j, causal in _pairs(ring.rank, owner, ring.cp)]
        ring.area += sum(c * (c + 1) // 2 if causal else c * c for _, _, causal in blocks)
        yield _repeat(here[0], group), _repeat(here[1], group), blocks
        _wait(handles)
        here = nxt


def _accumulate(grads, *into) -> None:
    """Add a block's gradients into the accumulators' slices; the block's die on return (bound
    to loop names, they would live on through the next block's kernel)."""
    for acc, g in zip(into, grads):
        acc += g


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        # [b, h, s, d] viewed over [b, s, h, d] storage: the caller's merge of the heads is then
        # a view, not a copy kept for the output projection's backward
        b, h, n, d = q.shape
        out = torch.zeros((b, n, h, d), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kernel, state = ring.kernel_for(q), None
        for kk, vv, blocks in _visits(ring, k, v, q.shape[1] // k.shape[1]):
            for qs, ks, causal in blocks:
                part, part_lse, state = kernel.forward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], scale, causal)
                _merge(out[:, :, qs], lse[:, :, qs], part, part_lse)
        ctx.save_for_backward(q, k, v, out, lse)
        # every block is c × c: the last one's op state serves each block's backward
        ctx.ring, ctx.scale, ctx.kernel, ctx.state = ring, scale, kernel, state
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, group, kernel = ctx.ring, ctx.scale, q.shape[1] // k.shape[1], ctx.kernel
        dtype = kernel.compute_dtype(q.dtype)
        dout, out_k = dout.to(dtype), out.to(dtype)  # once, in the op's dtype (fp32 on CPU: no copy of out)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        arriving, grad_handles = None, []
        for kk, vv, blocks in _visits(ring, k, v, group):
            dk = torch.zeros(kk.shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros_like(dk)
            for qs, ks, causal in blocks:
                _accumulate(kernel.backward(dout[:, :, qs], q[:, :, qs], kk[:, :, ks], vv[:, :, ks], out_k[:, :, qs],
                                            lse[:, :, qs], ctx.state, scale, causal),
                            dq[:, :, qs], dk[:, :, ks], dv[:, :, ks])
            dk, dv = _fold(dk, group), _fold(dv, group)
            if arriving is not None:  # the accumulators of this block's gradients, from the ranks before
                _wait(grad_handles)
                dk, dv = dk + arriving[0], dv + arriving[1]
            arriving, grad_handles = ring.pass_on([dk, dv])  # one hop behind the keys; the last hop goes home
        _wait(grad_handles)
        dk, dv = arriving
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _source_order(seq_len: int, cp: int, device) -> torch.Tensor:
    """The global positions of a whole sequence gathered from the cp ranks in rank order
    (each rank's head-tail tokens in turn)."""
    return torch.cat([sequence_positions(seq_len, r, cp, device) for r in range(cp)])


def _to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[b, h, s/cp, d] of this rank's tokens → [b, h/cp, s, d] of its heads, tokens in global
    order (one all-to-all over cp)."""
    cp = comm.mesh.size(CP)
    b, h, n, d = x.shape
    parts = comm.all_to_all(x.reshape(b, cp, h // cp, n, d).transpose(0, 1), CP)  # [source rank, b, h/cp, n, d]
    gathered = parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)
    return gathered[:, :, torch.argsort(_source_order(cp * n, cp, x.device))]


def _to_tokens(y: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of `_to_heads`: [b, h/cp, s, d] → [b, h, s/cp, d]."""
    cp = comm.mesh.size(CP)
    b, hh, s, d = y.shape
    by_source = y[:, :, _source_order(s, cp, y.device)].reshape(b, hh, cp, s // cp, d).permute(2, 0, 1, 3, 4)
    parts = comm.all_to_all(by_source, CP)  # [head group, b, h/cp, s/cp, d]
    return parts.transpose(0, 1).reshape(b, cp * hh, s // cp, d)


class _Reshard(torch.autograd.Function):
    """Sequence shards to head shards (`to_heads`) or back; the backward is the other way."""

    @staticmethod
    def forward(ctx, x, comm, to_heads: bool):
        ctx.comm, ctx.to_heads = comm, to_heads
        return (_to_heads if to_heads else _to_tokens)(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return (_to_tokens if ctx.to_heads else _to_heads)(grad, ctx.comm), None, None


def ulysses_core(comm: Comm, core):
    """An attention module's `core` as all-to-all attention (DeepSpeed's Ulysses): q, k and v
    from this rank's tokens of every head to every token of its heads (n_heads/cp and
    n_kv/cp of them, consecutive, so query heads keep their key/value group), the module's
    own core on the whole sequence, and back. Per rank and layer, each way, b·(s/cp)·(2·h +
    2·d_kv)·(cp−1)/cp elements (h = the query and output width)."""
    def attend(self, q, k, v):
        heads = [_Reshard.apply(t, comm, True) for t in (q, k, v)]
        return _Reshard.apply(core(*heads), comm, False)
    return attend


def ring_core(ring: Ring):
    """An attention module's `core(q, k, v)` ([batch, heads, tokens, head_dim]; k and v with
    their own n_kv heads) as ring attention over the cp ranks' tokens."""
    def core(self, q, k, v):
        return RingAttention.apply(q, k, v, ring, 1.0 / math.sqrt(q.shape[-1]))
    return core


def global_positions(ring: Ring):
    """A module's `positions(n, device)`: the global positions of the rank's n tokens (of a
    sequence of n·cp)."""
    def positions(self, n, device):
        return sequence_positions(n * ring.cp, ring.rank, ring.cp, device)
    return positions


def _check_heads(attention: nn.Module, cp: int) -> None:
    """All-to-all attention gives each cp rank whole heads: their counts must divide by cp."""
    for name in ("n_heads", "n_kv_heads"):
        n = getattr(attention, name, None)
        if n is not None and n % cp:
            raise ValueError(f"cp_mode='ulysses': the {n} {name.replace('n_', '').replace('_', ' ')} do not split "
                             f"over cp={cp}; use cp_mode='ring' or a cp dividing them")


def attention_cores(model: nn.Module) -> list[nn.Module]:
    """Before anything is split: the model's attention modules (those with a `core(q, k,
    v)`), refusing in one line a model that has none — transformers' classes among them,
    whose attention meshtrain cannot split over the sequence — and attention-probability
    dropout, which a ring cannot draw as one process does."""
    cores = [m for m in model.modules() if callable(getattr(m, "core", None))]
    if not cores:
        raise ValueError("context parallelism splits sequences for attention, and this model has no module with "
                         "an attention core(q, k, v) (meshtrain's GPT and Llama have one; transformers' classes do "
                         "not: train those with cp=1, or load the weights into meshtrain's Llama with "
                         "meshtrain.hf.load_hf)")
    for m in cores:
        drop = getattr(m, "attn_drop", None)
        if getattr(m, "attention", "sdpa") == "math" and drop is not None and drop.p > 0:
            raise ValueError("context parallelism: attention-probability dropout (the GPT's attention='math' with "
                             "dropout) cannot be split over cp; use attention='sdpa' or no dropout")
    return cores


def apply_context_parallel(model: nn.Module, comm: Comm, mode: str = "ring") -> Ring:
    """Make `model` run on its cp rank's tokens: every module with an attention `core`
    attends over the whole sequence by the ring (or, `mode="ulysses"`, by all-to-all;
    `Strategies` checks the mode), every module that computes `positions`
    gives the global ones. Refused in one line for a model with no attention core. Keyed
    dropout learns which tokens the rank holds from `dropout.split_over_cp`, which the caller
    runs first."""
    mesh = comm.mesh
    ring = Ring(comm)
    for m in attention_cores(model):
        if mode == "ulysses":
            _check_heads(m, mesh.size(CP))  # the heads this rank holds (after tensor parallelism)
            m.core = types.MethodType(ulysses_core(comm, m.core), m)
        else:
            m.core = types.MethodType(ring_core(ring), m)
    positions = global_positions(ring)  # one function for every module: tables keyed by it are shared
    for m in model.modules():
        if callable(getattr(m, "positions", None)):
            m.positions = types.MethodType(positions, m)
    comm.prepare_p2p(CP)
    return ring


def gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The inverse of `shard_sequence` for an output: every cp rank's [b, s/cp, ...] tokens
    gathered into the whole [b, s, ...] sequence in its original order (one all-gather)."""
    cp = comm.mesh.size(CP)
    full = comm.gather_along(x.contiguous(), CP, 1, purpose=METRICS)
    return full[:, torch.argsort(_source_order(full.shape[1], cp, x.device))]
