"""A plain mixture-of-experts decoder in Hugging Face's conventions (Mixtral, Qwen3-MoE,
OLMoE as transformers 5 keeps them in memory): the Llama's attention (with Qwen3's per-head
or OLMoE's whole-projection RMSNorm on queries and keys), and in each MoE layer a router
(`mlp.gate.weight` [E, d]) choosing `top_k` of E experts per token, the experts stacked
(`mlp.experts.gate_up_proj` [E, 2I, d], gate rows first, and `mlp.experts.down_proj`
[E, d, I]). Dropless: every token reaches its k experts, however unbalanced the load.

Load balancing lives in the layer, so that every layout trains what one process trains:
the auxiliary loss is computed per row (or per group of rows) from the router's own
scores, and reaches the router through the backward alone (`AddAuxGradient`): the output is
unchanged, and the loss's gradient joins the step's as one more term per token, scaled by
`aux_scale` — by default 1/(this forward's tokens), a mean beside a mean cross-entropy; a
meshtrain job sets it each step so that the gradient is that of a mean over the step's
tokens whatever the main loss's kind and normalizer (`meshtrain/balancing.py`).
Per-row terms do not depend on how rows are cut into micro-batches, ranks or pipeline
stages, so no count has to cross a stage or wait for the last micro-batch."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from types import SimpleNamespace

from meshtrain.models.llama import MLP, Attention, RMSNorm, apply_rotary
from meshtrain.models.specs import MoESpec


class AddAuxGradient(torch.autograd.Function):
    """`x` unchanged forward; backward, `aux`'s gradient (of weight 1) added to the graph:
    an auxiliary loss summed into the step's loss without changing the model's output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class _ContiguousGradient(torch.autograd.Function):
    """Identity; its gradient made contiguous (grouped_mm's backward refuses a broadcast one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many (token, slot) choices each expert got, [n_experts] int64 (a choice of
    `n_experts`, one a capacity dropped, counts for none): a scatter into a fixed shape
    (torch.bincount sizes its output by the largest index: a host sync on a GPU, and a
    dynamic shape under torch.compile)."""
    flat = chosen.reshape(-1)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=chosen.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))[:n_experts]


def _in_backward() -> bool:
    """Whether autograd's engine is running this code (a recomputed forward): its routing
    was counted when the forward first ran."""
    return torch._C._current_graph_task_id() != -1


class TopKRouter(nn.Module):
    """Scores every expert for every token (fp32), picks the top k (by score plus
    `expert_bias` when the bias balances the load), and returns the chosen experts and their
    weights (the scores, renormalised over the k when `norm_topk`). With `balance` =
    "bias", `expert_load` counts the tokens each expert received since the last
    `update_bias`; `balance_loss` sums the balancing loss its layer added since the step
    began (its logged value); all three are fp32 state (`fp32_state_buffers`)."""

    fp32_state_buffers = ("expert_bias", "expert_load", "balance_loss")

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.n_experts, self.top_k, self.score = spec.n_experts, spec.top_k, spec.score
        self.norm_topk, self.routing, self.bias_rate = spec.norm_topk, spec.routing, spec.bias_rate
        self.weight = nn.Parameter(torch.empty(spec.n_experts, spec.d_model))
        if spec.balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(spec.n_experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(spec.n_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("balance_loss", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, d] (rows of `seq_len` tokens; None: one row) -> (scores [tokens, E]
        fp32, chosen [tokens, k], weights [tokens, k] fp32). Balanced routing deals each
        row's tokens to the experts in turn by their position in the row (token t's k slots
        to experts t·k … t·k+k−1 mod E), so that cutting a batch into rows, micro-batches or
        dp ranks routes every token as one process does."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        if self.routing == "balanced":
            n = x.shape[0]
            position = torch.arange(n, device=x.device) % (seq_len or n)
            slots = position[:, None] * self.top_k + torch.arange(self.top_k, device=x.device)
            chosen = slots % self.n_experts
        else:
            ranked = scores.detach() + self.expert_bias if hasattr(self, "expert_bias") else scores
            chosen = self.choose(ranked)
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.training and not _in_backward():
            self.expert_load += expert_counts(chosen, self.n_experts).float()
        return scores, chosen, weights

    def choose(self, ranked: torch.Tensor) -> torch.Tensor:
        """The k experts of each token: the top k of its ranking [tokens, E] -> [tokens, k]
        (recomputation replaces this on the instance, to replay the forward's choice; the
        ranking is detached, so that a replayed choice leaves autograd nothing less saved)."""
        return ranked.detach().topk(self.top_k, dim=-1).indices

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: each expert's bias moved by `bias_rate`
        towards the mean load (`load`: the tokens each expert received over the step, all
        ranks' together); then the count starts again."""
        if hasattr(self, "expert_bias"):
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()


class Experts(nn.Module):
    """E SwiGLU experts, stacked: `gate_up_proj` [E, 2I, d] (gate rows, then up rows) and
    `down_proj` [E, d, I]. Each token's rows are sorted by expert and run as one grouped
    matmul per projection (`impl` "grouped", where grouped_mm's 16-byte strides hold) or one
    matmul per expert ("loop"); the outputs weighted and summed back per token."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.n_experts, self.ffn_dim, self.impl = spec.n_experts, spec.expert_ffn_dim, spec.experts
        self.gate_up_proj = nn.Parameter(torch.empty(spec.n_experts, 2 * spec.expert_ffn_dim, spec.d_model))
        self.down_proj = nn.Parameter(torch.empty(spec.n_experts, spec.d_model, spec.expert_ffn_dim))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, d], chosen and weights [tokens, k] -> [tokens, d]. Under torch.compile in
        another dtype than bf16 they run eagerly: grouped_mm's meta kernel (what the compiler
        traces with) takes bf16 only in torch 2.13, and the loop's split sizes are data."""
        if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            return _eager(self, x, chosen, weights)
        return self.combine(x, chosen, weights)

    def combine(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's rows run by its experts and summed back, weighted (expert parallelism
        replaces this on the instance: it moves the rows to the ranks holding their experts).
        A choice a capacity dropped (expert id E, weight 0) runs through the last expert
        here, where no row travels: its output weighs 0, and no host sync sizes the rest."""
        order, token, counts = self.sort_rows(chosen.clamp_max(self.n_experts - 1))
        return weighted_sum(x, self.compute(x[token], counts), token, order, weights)

    def sort_rows(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`sort_by_expert` over this module's experts."""
        return sort_by_expert(chosen, self.n_experts)

    @staticmethod
    def weigh(x: torch.Tensor, y: torch.Tensor, token: torch.Tensor, order: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
        """`weighted_sum`: what strategies replacing `combine` call, naming no model module."""
        return weighted_sum(x, y, token, order, weights)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [R, d] sorted by expert, `counts` of them for each expert held here -> [R, d]."""
        if self.impl == "grouped" and self.groupable(rows.dtype):
            return self._grouped(rows, counts)
        return self._looped(rows, counts)

    def groupable(self, dtype: torch.dtype) -> bool:
        """grouped_mm needs every stride a multiple of 16 bytes: d and I in whole 16-byte units."""
        per = 16 // torch.empty((), dtype=dtype).element_size()
        return self.gate_up_proj.shape[-1] % per == 0 and self.ffn_dim % per == 0

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offs=offs)
        gate, up = _ContiguousGradient.apply(h).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        return _ContiguousGradient.apply(y)

    def _looped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            part = rows[start:start + n]
            gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
            start += n
        return torch.cat(out)


@torch.compiler.disable
def _eager(experts: Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return experts.combine(x, chosen, weights)


def sort_by_expert(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chosen [tokens, k] -> (order: the (token, slot) pairs sorted by expert, tokens in
    order within each, the pairs a capacity dropped (expert E) last; token: each sorted
    pair's token; counts [n_experts], of the pairs kept)."""
    order = chosen.reshape(-1).argsort(stable=True)
    return order, order // chosen.shape[1], expert_counts(chosen, n_experts)


def weighted_sum(x: torch.Tensor, y: torch.Tensor, token: torch.Tensor, order: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The experts' outputs `y` (rows in `order`) weighted by the router (in fp32, as its
    weights are) and summed per token into x's shape. Deterministic: the rows are put back
    in (token, slot) order (a permutation: each written once) and each token's k rows summed
    as a [tokens, k, d] reduction — not an `index_add_`, whose CUDA atomics add in no fixed
    order, so that a recomputation gives its forward's bits. (`token`: each sorted row's
    token, for a strategy's own combine; the permutation does without it.)"""
    n, k = weights.shape
    rows = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)
    return (rows.float() * weights[..., None]).sum(1).to(x.dtype)


def capacity_keep(chosen: torch.Tensor, weights: torch.Tensor, rows: int, factor: float,
                  n_experts: int) -> torch.Tensor:
    """[tokens, k] bool: the (token, slot) choices experts of a capacity factor F take, each
    expert at most C = ⌈F·s·k/E⌉ of each sequence's s·k choices, the highest-weighted first
    (ties: the earlier token, then the earlier slot), as Megatron's "probs" drop policy
    ranks them. Counted per sequence, so that which choices are dropped depends on no
    layout: dp, tp, pp, ep and micro-batches cut between whole rows."""
    tokens, k = chosen.shape
    per_row = tokens // rows * k
    cap = math.ceil(factor * per_row / n_experts)
    expert, weight = chosen.reshape(rows, per_row), weights.detach().reshape(rows, per_row)
    by_weight = weight.argsort(dim=1, descending=True, stable=True)
    order = by_weight.gather(1, expert.gather(1, by_weight).argsort(dim=1, stable=True))  # by expert, then weight
    ranked = expert.gather(1, order)
    counts = F.one_hot(expert, n_experts).sum(1)  # [rows, E]
    starts = counts.cumsum(1) - counts  # where each expert's choices start in `order`
    place = torch.arange(per_row, device=chosen.device) - starts.gather(1, ranked)
    return torch.empty_like(place, dtype=torch.bool).scatter_(1, order, place < cap).view(tokens, k)


def _balance_terms(scores: torch.Tensor, chosen: torch.Tensor, score: str,
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's (choices [tokens, E]: 1 where chosen, share of the scores [tokens, E],
    1 [tokens, 1]), zero where `mask` [tokens] is False (padding leaves the counts)."""
    share = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    picked = F.one_hot(chosen, scores.shape[1]).sum(1).to(share.dtype)
    tokens = torch.ones_like(share[:, :1])
    if mask is not None:
        keep = mask.to(share.dtype)[:, None]
        picked, share, tokens = picked * keep, share * keep, keep
    return picked, share, tokens


def balance_sums(scores: torch.Tensor, chosen: torch.Tensor, groups: int, score: str,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per group of rows, what the balancing loss is made of: [groups, 3, E] holding each
    expert's count of (token, slot) choices, its summed share of the tokens' scores, and the
    group's tokens (in every column), of the tokens `mask` keeps (None: all). Sums, so that
    a strategy that splits a group's tokens over ranks adds them up (`MoE.sequence_sum`).
    scores [tokens, E], chosen [tokens, k]."""
    picked, share, tokens = _balance_terms(scores, chosen, score, mask)
    n_experts = scores.shape[1]
    return torch.stack([picked, share, tokens.expand_as(share)], dim=1).view(groups, -1, 3, n_experts).sum(1)


def balance_loss(sums: torch.Tensor, top_k: int, local_tokens: torch.Tensor) -> torch.Tensor:
    """Switch/DeepSeek's balancing loss Σ_i f_i·P_i of each group (f_i = E/(k·T) × the
    choices of expert i, P_i the mean share of the scores it got: 1 when balanced), weighted
    by `local_tokens`, this rank's tokens of each group: summed over ranks (and divided
    with the cross-entropy by the step's count of loss terms), a per-token mean."""
    picked, share, tokens = sums.unbind(1)
    n_experts, total = picked.shape[1], tokens[:, 0].clamp_min(1)  # a group all padding weighs 0
    f = picked * (n_experts / (top_k * total[:, None]))
    p = share / total[:, None]
    return ((f * p).sum(1) * local_tokens).sum()


BALANCING_LOSSES = ("sequence", "batch", "pooled")


class PooledBalance:
    """transformers' balancing loss (`load_balancing_loss_func`) as its `.loss` adds it, for
    fine-tuning its folders exactly: one forward's (token, slot) choices and router
    probabilities pooled over every MoE layer and token —

        coef · E · Σ_e (C_e / (L·T)) · (P_e / (L·T))

    C_e the choices of expert e, P_e its summed probability, over L layers and T tokens (the
    ones the mask keeps), coef transformers' `router_aux_loss_coef` (= aux_coef·L/k). A
    function of every layer's sums, it is known once the model's forward has run: each layer
    adds its sums (`add`), the model `finish`es them (over the ranks holding the forward's
    other tokens: `sum_over`, which strategies replace), and each layer's backward reads the
    gradient then set (`PooledAux`). `scale`: the job's weight of the forward's loss."""

    def __init__(self, n_experts: int, coef: float, value_router: nn.Module):
        self.n_experts, self.coef, self.value_router = n_experts, coef, value_router
        self.sums: torch.Tensor | None = None  # [2E + 1]: C, P, L·T
        self.grad: torch.Tensor | None = None  # [E]: d loss / d (a layer's summed probabilities)
        self.scale, self.value_scale, self.ranks = 1.0, 1.0, 1

    def start(self) -> None:
        self.sums = self.grad = None

    @torch.compiler.disable  # its backward reads the gradient `finish` sets: Python state
    def add(self, out: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor | None,
            score: str) -> torch.Tensor:
        picked, share, tokens = _balance_terms(scores, chosen, score, mask)
        if not _in_backward():  # a recomputation's were added by its forward
            part = torch.cat([picked.sum(0), share.detach().sum(0), tokens.sum(0)])
            self.sums = part if self.sums is None else self.sums + part
        return PooledAux.apply(out, share.sum(0), self)

    def finish(self) -> None:
        """The forward has run every layer: the gradient of each layer's probabilities, and
        the loss's value added to the first layer's router's (÷ the ranks that sum it again)."""
        if self.sums is None:
            return
        sums = self.sum_over(self.sums)
        e = self.n_experts
        picked, share, tokens = sums[:e], sums[e:2 * e], sums[-1].clamp_min(1)
        unit = self.coef * e / tokens ** 2
        self.grad = self.scale * unit * picked
        self.value_router.balance_loss += self.value_scale * unit * (picked * share).sum() / self.ranks

    def sum_over(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums over the ranks holding the forward's other tokens: none in one process."""
        return sums


class PooledAux(torch.autograd.Function):
    """`x` unchanged forward; backward, the pooled balancing loss's gradient of a layer's
    summed probabilities [E], as `PooledBalance.finish` set it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, probabilities: torch.Tensor, pooled: PooledBalance) -> torch.Tensor:
        ctx.pooled = pooled
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.pooled.grad is None:
            raise RuntimeError("the pooled balancing loss was not finished before the backward: run the whole "
                               "model's forward (MoEModel.forward) before it")
        return grad, ctx.pooled.grad.float(), None


class MoE(nn.Module):
    """The MoE MLP: router, experts, optional shared experts, and the balancing loss added
    to the backward (`balance`: sequence, batch or pooled; the bias is the router's)."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.gate = TopKRouter(spec)
        self.experts = Experts(spec)
        self.balance, self.aux_coef, self.balance_rows = spec.balance, spec.aux_coef, spec.balance_rows
        self.capacity = spec.capacity
        # the balancing loss's weight per token in the gradient, and in its logged value
        # (None: 1/this forward's tokens, a mean beside a plain loop's mean loss)
        self.aux_scale = self.aux_value_scale = None
        self.token_mask = None  # () -> [tokens] bool of this forward, False where padding (None: every token)
        self.pooled: PooledBalance | None = None  # balance="pooled": the model's (`MoEModel`)
        if spec.shared_ffn_dim:
            self.shared_experts = MLP(SimpleNamespace(d_model=spec.d_model, ffn_dim=spec.shared_ffn_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        scores, chosen, weights = self.gate(flat, s)
        dispatched = chosen
        if self.capacity is not None:  # a choice over its expert's capacity: expert E, weight 0
            if "sequence_sum" in self.__dict__:
                raise ValueError("a MoE capacity is counted per sequence, and context or sequence parallelism "
                                 "splits this layer's sequences over ranks: use cp 1 and no SP with a capacity")
            keep = capacity_keep(chosen, weights, b, self.capacity, self.gate.n_experts)
            dispatched = chosen.masked_fill(~keep, self.gate.n_experts)
            weights = weights * keep
        out = self.experts(flat, dispatched, weights).view(b, s, d)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        if self.training and self.balance in BALANCING_LOSSES and self.aux_coef and torch.is_grad_enabled():
            out = self._add_balancing(out, scores, chosen, b, s)
        return out

    def _add_balancing(self, out: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor, b: int,
                       s: int) -> torch.Tensor:
        """`out`, its backward adding the balancing loss's gradient (its value added to the
        router's `balance_loss`), over the tokens `token_mask` keeps: per row or group of rows,
        or pooled over the model's forward (`PooledBalance`)."""
        mask = self.token_mask() if self.token_mask is not None else None
        if self.balance == "pooled":
            if self.pooled is None:
                raise ValueError("balance='pooled' is pooled over the whole model's forward: use the layer inside "
                                 "a MoEModel (or give it the model's PooledBalance)")
            return self.pooled.add(out, scores, chosen, mask, self.gate.score)
        group = 1 if self.balance == "sequence" else self.balance_rows
        if b % group:
            raise ValueError(f"the batch loss balances groups of {group} rows, but this forward has {b} rows "
                             f"(make each micro-batch a multiple of {group} rows)")
        sums = balance_sums(scores, chosen, b // group, self.gate.score, mask)
        local = sums[:, 2, 0]  # this rank's tokens of each group, before the sum over ranks
        weighted = balance_loss(self.sequence_sum(sums), self.gate.top_k, local)
        mean = 1.0 / (b * s) if mask is None else 1.0 / local.sum().clamp_min(1)
        aux = self.aux_coef * (self.aux_scale if self.aux_scale is not None else mean) * weighted
        if not _in_backward():  # a recomputation's forward adds nothing to the value
            value = self.aux_value_scale if self.aux_value_scale is not None else mean
            self.gate.balance_loss += self.aux_coef * value * weighted.detach()
        return AddAuxGradient.apply(out, aux)

    def sequence_sum(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums over the ranks that hold other tokens of the same rows: none in one process;
        context parallelism and SP replace this with a differentiable all-reduce."""
        return sums


class QKNormAttention(Attention):
    """The Llama's attention, with RMSNorm on queries and keys when `qk_norm` says:
    "head" (Qwen3: each head normalised, weight [head_dim]) or "projection" (OLMoE: the
    whole projection normalised, weight [heads·head_dim])."""

    def __init__(self, spec: MoESpec, rope_tables: dict | None = None):
        super().__init__(spec, rope_tables)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(spec.head_size, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_size, spec.rms_norm_eps)
        elif spec.qk_norm == "projection":
            self.q_norm = RMSNorm(spec.n_heads * spec.head_size, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.kv_heads * spec.head_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qk_norm == "none":
            return super().forward(x)
        b, s, _ = x.shape
        cos, sin = self.rotary(s, x.device, x.dtype, self.positions)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, spec: MoESpec, index: int, rope_tables: dict | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.self_attn = QKNormAttention(spec, rope_tables)
        self.post_attention_layernorm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.mlp = MLP(spec) if index in spec.dense_layers else MoE(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEModel(nn.Module):
    """Token ids [batch, seq] in, logits [batch, seq, vocab] out."""

    def __init__(self, spec: MoESpec, vocab_size: int):
        super().__init__()
        self.spec, self.vocab_size = spec, vocab_size
        self.embed_tokens = nn.Embedding(vocab_size, spec.d_model, padding_idx=spec.pad_token_id)
        rope_tables: dict = {}
        self.layers = nn.ModuleList(Block(spec, i, rope_tables) for i in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.d_model, vocab_size, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        layers = [block.mlp for block in self.layers if isinstance(block.mlp, MoE)]
        self.pooled = None
        if spec.balance == "pooled" and layers:  # transformers' coefficient: aux_coef·L/k
            self.pooled = PooledBalance(spec.n_experts, spec.aux_coef * len(layers) / spec.top_k, layers[0].gate)
            for layer in layers:
                layer.pooled = self.pooled

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pooled is not None:
            self.pooled.start()
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        if self.pooled is not None:
            self.pooled.finish()
        return self.lm_head(self.norm(x))
