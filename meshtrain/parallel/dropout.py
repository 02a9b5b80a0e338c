"""Dropout that every layout draws alike, so that `verify` can check runs with dropout.

Each element of a sample's mask at a site is a pure function of (seed, step, the sample's
index in the global batch, the site's module name, the element's index in the sample's
whole activation): an integer hash computed in tensor operations on the activation's device
(`keyed_keep`). A rank whose activation is a shard (its chunk of the sequence under SP, its
heads under TP, its tokens under cp) computes the elements of its shard only. So one
process, any data-parallel or micro-batch split, any tensor-, sequence- or
context-parallel layout, and any recomputation drop exactly the same elements, on the CPU
and on a GPU alike (torch's generators cannot: the CPU and CUDA ones are different
algorithms).

The cost is device work, a constant number of integer operations per call whatever the
rows: about ten passes over an int64 word per element. On one CPU thread that is 3.7-5.7×
torch's CPU generator drawing the same masks (`benchmarks/dropout_keys.py`); on a GPU it
replaces host work that grew with the rows (one generator per sample and site, each
sample's whole mask drawn on the host and copied: 23-25 s of host time for a GPT-2-small
micro-batch of 8 × 1,024 with attention-probability dropout). Megatron's RNG tracker (a
generator per tp rank for sharded regions) is cheaper still, but its masks depend on the
layout, and no layout could be compared with one process.

Functional dropout — `F.dropout` (and `torch.dropout`) in a model's forward, and the
`dropout_p` of `F.scaled_dot_product_attention` — draws from the global generator, which no
layout reproduces. `FunctionalDropout`, a `TorchFunctionMode` over every training forward
(and recomputation), keys those calls the same way: the site is the module whose forward
makes the call (its one-process name), the line, and the call's ordinal there in the
micro-batch; attention's dropout runs as exact math attention with the keyed mask on its
probabilities. Where the masks could not be the one process's — under tensor parallelism
(a functional call cannot say how its input is sharded), attention's under context
parallelism, the channel and alpha variants — the call is refused in one line. A model that
makes no such call in its first step runs without the mode from then on."""


from __future__ import annotations

import hashlib
import inspect
import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from meshtrain.comm import Comm
from meshtrain.parallel.context import sequence_positions
from meshtrain.parallel.modules import replace_submodule


class DropoutKeys:
    """Where the micro-batch being computed sits: the step and its rows of the global batch.
    The training step sets it before each micro-batch's forward."""

    def __init__(self, seed: int, *, compiled: bool = False):
        self.seed, self.step, self.rows = seed, 0, slice(0, 0)
        self.calls: dict[str, int] = {}  # functional dropout calls per site in this micro-batch's forward
        self.functional = None  # makes the mode that keys them (`FunctionalDropout`), while a model may call them
        self.functional_seen = False
        self.compiled = compiled  # the blocks are compiled under the mode: it stays (`settle`)

    def use(self, step: int, rows: slice) -> None:
        self.step, self.rows = step, rows

    def start(self, step: int, rows: slice) -> None:
        """A micro-batch's forward begins: its keys, and no functional call counted yet."""
        self.use(step, rows)
        self.calls = {}

    def scope(self):
        """What a training forward (or a recomputation) runs inside: the mode that keys
        functional dropout, or nothing once the first step has shown there is none."""
        return self.functional() if self.functional is not None else nullcontext()

    def settle(self) -> None:
        """After the first step: a model that called no functional dropout needs no mode.
        Compiled blocks keep it: dynamo traced them under it and guards on the mode stack,
        so leaving it would compile every graph a second time at step 2 (inside a compiled
        graph the mode costs nothing; it is traced away)."""
        if not self.functional_seen and not self.compiled:
            self.functional = None

    def site_key(self, site: str) -> tuple[int, int]:
        """Two 32-bit words keying `site`'s masks at this step (the rows are mixed in on the
        device: `keyed_keep`)."""
        raw = hashlib.blake2b(f"{self.seed}/{self.step}/{site}".encode(), digest_size=8).digest()
        return int.from_bytes(raw[:4], "little"), int.from_bytes(raw[4:], "little")


class SeededDropout(nn.Module):
    """nn.Dropout with masks from `DropoutKeys`. `shard` = (dim, comm): the input is this
    rank's tp chunk along `dim` (counted without the batch dimension's shift: dim ≥ 1).
    `tokens` = (rank, cp): under context parallelism the input [b, s/cp, ...] holds cp rank
    `rank`'s tokens of each sequence (head-tail), whose one-process mask it keeps."""

    def __init__(self, p: float, keys: DropoutKeys, site: str):
        super().__init__()
        self.p, self.keys, self.site = p, keys, site
        self.shard: tuple[int, Comm] | None = None
        self.tokens: tuple[int, int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return keyed_dropout(x, self.p, self.keys, self.site, self.shard, self.tokens)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"


def keyed_dropout(x: torch.Tensor, p: float, keys: DropoutKeys, site: str, shard: tuple[int, Comm] | None = None,
                  tokens: tuple[int, int] | None = None, inplace: bool = False) -> torch.Tensor:
    """`x` [rows, ...] with each row's one-process mask at `site` (`SeededDropout` says
    what `shard` and `tokens` are): the rank's own elements only, drawn on x's device."""
    if p >= 1:
        return x.mul_(0) if inplace else x * 0
    if keys.rows.stop - keys.rows.start != x.shape[0]:
        raise RuntimeError(f"dropout at {site}: {x.shape[0]} samples but the keys name "
                           f"{keys.rows.stop - keys.rows.start}")
    full = list(x.shape[1:])  # a row's one-process mask
    if shard is not None:
        dim, comm = shard
        full[dim - 1] *= comm.mesh.size("tp")
    if tokens is not None:
        if x.dim() != 3:
            raise RuntimeError(f"dropout at {site}: context parallelism drops [batch, tokens, features] "
                               f"activations only; attention-probability dropout is refused under cp")
        rank, cp = tokens
        full[0] *= cp
    positions = [torch.arange(n, device=x.device) for n in full]  # each dimension's indices the rank holds
    if tokens is not None:  # this cp rank's tokens, then (under SP) its tp chunk of them
        positions[0] = sequence_positions(full[0], rank, cp, x.device)
    if shard is not None:
        n = x.shape[dim]
        positions[dim - 1] = positions[dim - 1].narrow(0, comm.mesh.coord("tp") * n, n)
    mask = keyed_keep(keys, site, positions, full, p)  # bool: what backward keeps is a byte an element
    return x.mul_(mask).div_(1 - p) if inplace else x * mask / (1 - p)


_WORD = 0xFFFFFFFF


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """x ← a 32-bit integer hash of x (Mueller's xorshift-multiply, 0x45d9f3b), in place, for
    32-bit words held in int64: every product stays below 2⁶³, so CPU and CUDA integer
    arithmetic give the same bits; a bijection in which every input bit reaches every
    output bit."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_WORD)
    return x.bitwise_xor_(x >> 16)


@torch.compiler.disable  # the step, the rows and the site are Python state: a graph would guard on each
def keyed_keep(keys: DropoutKeys, site: str, positions: list[torch.Tensor], full: list[int],
               p: float) -> torch.Tensor:
    """[rows, *local] bool: which elements the masks of `site` keep, for the rows the keys
    name, at `positions` (each dimension's indices in a row's mask of shape `full`). Each
    element is a hash of (seed, step, site, global row, the element's index in its row's
    whole mask) in integer tensor operations on the positions' device — the same bits on
    CPU and CUDA, and a constant number of operations whatever the rows or the layout: a
    rank computes its own elements only (tp's chunk, cp's tokens). The row's key mixes
    (seed, step, site) — a blake2b digest on the host, once per call — with the row; each
    element's word is the hash of its index xor that key, its top 24 bits a uniform
    number against p."""
    device = positions[0].device
    numel = math.prod(full)
    if numel >= 2 ** 32:
        raise RuntimeError(f"dropout at {site}: a row's mask of {numel} elements is past the keyed hash's 2³² indices")
    k0, k1 = keys.site_key(site)
    rows = torch.arange(keys.rows.start, keys.rows.stop, device=device, dtype=torch.int64)
    row_key = _mix_(_mix_(rows.bitwise_xor_(k0)).bitwise_xor_(k1))
    index, stride = torch.zeros((), dtype=torch.int64, device=device), numel
    for d, pos in enumerate(positions):  # the element's flat index in its row's whole mask
        stride //= full[d]
        shape = [1] * len(positions)
        shape[d] = -1
        index = index + pos.to(torch.int64).view(shape) * stride
    word = index.unsqueeze(0) ^ row_key.view(-1, *[1] * len(positions))  # [rows, *local]
    return _mix_(word) >= math.ceil(p * 2 ** 24) << 8


_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshtrain's own wrappers


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention's signature (a builtin has none to inspect)."""


def _torch_dropout(input, p, train):
    """torch.dropout's signature."""


# the functions keyed: (signature, input, p, training, inplace)
_KEYED = {F.dropout: (inspect.signature(F.dropout), "input", "p", "training", "inplace"),
          torch.dropout: (inspect.signature(_torch_dropout), "input", "p", "train", None)}
_REFUSED = (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
_SDPA = inspect.signature(_sdpa)


class FunctionalDropout(TorchFunctionMode):
    """Keys functional dropout in a training forward (module docstring). `names`: every
    module of the full model by id, with its one-process name; `tp`, `cp`: the layout's
    sizes, and `cp_rank` this rank's place on cp."""

    def __init__(self, keys: DropoutKeys, names: dict[int, tuple[str, nn.Module]], tp: int, cp: int, cp_rank: int):
        super().__init__()
        self.keys, self.names, self.tp, self.cp, self.cp_rank = keys, names, tp, cp, cp_rank

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEYED:
            return self._dropout(func, args, kwargs)
        if func is F.scaled_dot_product_attention:
            return self._attention(args, kwargs)
        if func in _REFUSED:
            a = inspect.signature(func).bind(*args, **kwargs).arguments
            if a.get("training", True) and a.get("p", 0.5) > 0:
                raise ValueError(f"F.{func.__name__} in a training forward draws from the global generator, which "
                                 f"no layout reproduces; use nn.Dropout or F.dropout, which meshtrain keys")
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs):
        signature, x_name, p_name, train_name, inplace_name = _KEYED[func]
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        x, p = a[x_name], a[p_name]
        if not a[train_name] or p == 0:
            return func(*args, **kwargs)
        self.keys.functional_seen = True
        if self.tp > 1:
            raise ValueError("F.dropout under tensor parallelism: meshtrain cannot tell how a functional call's "
                             "input is sharded, so its masks would differ from one process's; use an nn.Dropout "
                             "module (the tp_plan's styles say how it is sharded)")
        tokens = None
        if self.cp > 1:
            if x.dim() != 3:
                raise ValueError("F.dropout under context parallelism keys [batch, tokens, features] activations "
                                 f"only, not {tuple(x.shape)}; use cp=1 or move the dropout to such an activation")
            tokens = (self.cp_rank, self.cp)
        return keyed_dropout(x, p, self.keys, self._site(), tokens=tokens,
                             inplace=bool(inplace_name and a[inplace_name]))

    def _attention(self, args, kwargs):
        a = _SDPA.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        p = a["dropout_p"]
        if p == 0:
            return F.scaled_dot_product_attention(*args, **kwargs)
        self.keys.functional_seen = True
        if self.tp > 1 or self.cp > 1:
            raise ValueError("F.scaled_dot_product_attention(dropout_p>0) under tensor or context parallelism: its "
                             "masks cannot be drawn as one process draws them (heads or tokens are split); use "
                             "dropout_p=0 there")
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if a.get("enable_gqa"):
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
        scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(q.shape[-1])
        scores = (q @ k.transpose(-2, -1)) * scale
        if a["is_causal"]:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = keyed_dropout(scores.softmax(-1), p, self.keys, self._site())
        return probs @ v

    def _site(self) -> str:
        """The calling module's one-process name, the call's line, and its ordinal there."""
        frame, line, module = sys._getframe(2), None, "model"
        while frame is not None:
            code = frame.f_code
            if line is None and not code.co_filename.startswith((_TORCH_DIR, _HERE)):
                line = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
            if "self" in code.co_varnames[:1]:
                named = self.names.get(id(frame.f_locals.get("self")))
                if named is not None and named[1] is frame.f_locals.get("self"):
                    module = named[0] or "model"
                    break
            frame = frame.f_back
        site = f"{module}/{line}"
        n = self.keys.calls.get(site, 0)
        self.keys.calls[site] = n + 1
        return f"{site}#{n}"


def seed_dropout(model: nn.Module, keys: DropoutKeys) -> None:
    """Replace every active nn.Dropout of `model` by a SeededDropout named after its site
    (the module's one-process name)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout) and module.p > 0:
            replace_submodule(model, name, SeededDropout(module.p, keys, name))


def split_over_cp(model: nn.Module, rank: int, cp: int) -> None:
    """Context parallelism: every keyed dropout (`seed_dropout`) draws the one-process mask of
    the tokens cp rank `rank` holds; an active dropout that is not keyed is refused (it would
    draw masks per rank)."""
    for m in model.modules():
        if isinstance(m, SeededDropout):
            m.tokens = (rank, cp)
        elif isinstance(m, nn.Dropout) and m.p > 0:
            raise ValueError("context parallelism: an nn.Dropout that is not keyed (seed_dropout) would draw "
                             "masks per rank; meshtrain.parallelize keys every active one")
