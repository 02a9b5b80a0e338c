"""Activation checkpointing (`--recompute`): keep less for backward, compute it again there.

- `full`: each block keeps only its input; its forward runs again in backward. Its MLP runs
  in two chunks of rows, each a checkpoint of its own inside the block's: the block's
  backward then holds one chunk's MLP activations and temporaries at a time, not the
  whole MLP's — at no extra compute, as the block's recomputation skips the chunks
  (`_mlp_in_row_chunks`).
- `selective` (Korthikanti et al. 2022): only the attention core is recomputed — QKᵀ, the
  scaling and causal mask, softmax, dropout, the product with V (or the fused kernel), whose
  activations grow with s² per head and cost few FLOPs; everything else is kept. The region
  is the core itself, an attention module's `core(q, k, v)` method, under a plain
  checkpoint: its inputs q, k, v are what its products would keep anyway, so nothing else
  is recomputed and nothing more is kept. PyTorch's selective-checkpoint policy machinery
  (`create_selective_checkpoint_contexts`), which this used over the whole attention
  module (keeping the projections' `mm`/`addmm` products, recomputing the rest), sends
  every operator of its region through Python in forward and again in backward: measured
  on gpt-small, math, one process, selective cost 1.13–1.21 of none's step that way, 1.12
  with the policy over the core alone, and 1.02–1.09 as a plain checkpoint of the core.
- `segments:K` (Chen et al. 2016): only every K-th block boundary is kept; each segment of
  K blocks runs again in backward. `segments` alone takes K = ⌈√L⌉ for the L blocks a run
  of consecutive blocks has (a pipeline stage's chunk, or the whole list).

Blocks are wrapped in place (names, parameters and state dict unchanged). A segment runs
whole from its first block's forward under one checkpoint, calling its other blocks as
modules (so per-block hooks such as ZeRO-3's gathers run); when the model's own loop calls
those, they pass their input through (`passes_through`). Recomputation sees the same dropout masks:
the `DropoutKeys` of the forward (step and rows) are put back while it runs, since a
pipeline computes other micro-batches in between.

A mixture of experts' routing is replayed, as Megatron's `RouterReplay` does: each router
of a recomputed block (a module with `choose(ranking) -> experts` and `top_k`) records
what its forward chose in the checkpointed call it ran in, and its recomputation takes
that choice again instead of ranking afresh. A recomputed ranking can differ in its last
bits (a GPU's atomics, a compiled kernel's other order), and on a near tie it would choose
other experts: a gradient through a routing the loss never used, and under expert
parallelism other split sizes, which torch's checkpoint refuses in the backward of one
rank while the others wait."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from meshtrain.parallel.options import parse_recompute
from meshtrain.parallel.dropout import DropoutKeys

@contextmanager
def _keys_at(keys: DropoutKeys | None, where: tuple | None, again: bool = False):
    """Put the dropout keys of the forward back for the recomputation (`again`: this run
    recomputes, in backward, where the forward's functional-dropout mode is not active:
    it runs in its own, its calls counted afresh from the region's start)."""
    if keys is None:
        yield
        return
    now, calls = (keys.step, keys.rows), keys.calls
    keys.use(*where)
    if again:
        keys.calls = {}
    try:
        with keys.scope() if again else nullcontext():
            yield
    finally:
        keys.use(*now)
        keys.calls = calls


class _Choices:
    """What the routers chose in one checkpointed call's forward, in call order, for its
    recomputations to choose again."""

    def __init__(self):
        self.made: list[torch.Tensor] = []
        self.replaying, self.at = False, 0


_choices: ContextVar[_Choices | None] = ContextVar("meshtrain_choices", default=None)


def _replayed(choose):
    """A router's `choose`, recorded in a checkpointed call's forward and replayed in its
    recomputation (outside a checkpoint, as it was). Eager under torch.compile: which
    choice to return is Python state of the call."""
    @torch.compiler.disable
    def replaying(ranked: torch.Tensor) -> torch.Tensor:
        choices = _choices.get()
        if choices is None:
            return choose(ranked)
        if choices.replaying:
            choices.at += 1
            return choices.made[choices.at - 1]
        chosen = choose(ranked)
        choices.made.append(chosen)
        return chosen
    return replaying


def _replay_routing(blocks) -> None:
    for block in blocks:
        for m in block.modules():
            if callable(getattr(m, "choose", None)) and hasattr(m, "top_k"):
                m.choose = _replayed(m.choose)


RECOMPUTED = "_meshtrain_recomputed"  # set on every module that runs under a checkpoint


def is_recomputed(module: nn.Module) -> bool:
    """Whether `module` runs under activation checkpointing. Saved-tensor hooks entered
    inside a checkpointed region take every tensor saved there from the checkpoint's own
    hooks — nothing would be recomputed — so code that installs such hooks (SP's region)
    leaves them out here: the recomputation redoes what they would have saved."""
    return getattr(module, RECOMPUTED, False)


_in_segment = ContextVar("meshtrain_in_segment", default=False)  # a segment is running its blocks
SEGMENT_MEMBER = "_meshtrain_segment_member"  # set on a segment's blocks after its first


def passes_through(module: nn.Module) -> bool:
    """Whether this call of `module` is the model's own loop reaching a block whose segment
    already ran it: the call returns its input, and hooks that act per block (ZeRO-3's
    gather and free) must do nothing for it."""
    return getattr(module, SEGMENT_MEMBER, False) and not _in_segment.get()


def _member_forward(inner):
    """A segment's later block: its own forward when its segment calls it, else a pass-through."""
    def forward(x, *args, **kwargs):
        return inner(x, *args, **kwargs) if _in_segment.get() else x
    return forward


def _mark(modules) -> None:
    for top in modules:
        for m in top.modules():
            setattr(m, RECOMPUTED, True)


_recomputing_block = ContextVar("meshtrain_recomputing_block", default=False)


def _checkpointed(run, keys: DropoutKeys | None, block: bool = False):
    """`run(x, ...)` under a non-reentrant checkpoint that recomputes with the forward's
    dropout keys. `block`: `run` is a whole block under `full`, whose recomputation is
    flagged to its MLP's chunks (`_mlp_in_row_chunks`)."""

    def forward(x, *args, **kwargs):
        if not torch.is_grad_enabled():
            return run(x, *args, **kwargs)
        where = (keys.step, keys.rows) if keys is not None else None
        runs, choices = 0, _Choices()

        def again(x, *args, **kwargs):
            nonlocal runs
            runs += 1  # the first run is the forward, the others recompute
            choices.replaying, choices.at = runs > 1, 0
            flag, chosen = _recomputing_block.set(block and runs > 1), _choices.set(choices)
            try:
                with _keys_at(keys, where, again=runs > 1):
                    return run(x, *args, **kwargs)
            finally:
                _recomputing_block.reset(flag)
                _choices.reset(chosen)
        return checkpoint(again, x, *args, use_reentrant=False, **kwargs)
    return forward


def _rows_from(run, keys: DropoutKeys | None, first: int):
    """`run` on the chunk of the micro-batch that starts at its row `first` (dropout keys narrowed to it)."""
    def chunk(part):
        if keys is None:
            return run(part)
        rows = keys.rows
        keys.use(keys.step, slice(rows.start + first, rows.start + first + part.shape[0]))
        try:
            return run(part)
        finally:
            keys.use(keys.step, rows)
    return chunk


def _mlp_in_row_chunks(run, keys: DropoutKeys | None):
    """An MLP's forward (`run`, per token) in two chunks of rows, each under a checkpoint
    of its own inside its block's: in backward each chunk is recomputed and backwarded
    apart, so the block's backward holds one chunk's MLP activations and their gradients
    (the MLP's are the block's widest), not all of them — the bound of Chen et al.'s count,
    one block's activations, where a whole block's recomputation holds more.

    It costs no extra compute: the block's recomputation needs of the MLP only what the
    chunks' checkpoints keep, their inputs (the residual add after the MLP keeps nothing),
    and PyTorch's early stop ends it at the last of them; so while the block is recomputed
    the chunks return placeholders without computing (and without their collectives, which
    every rank skips alike). A micro-batch of one row runs whole."""
    def forward(x):
        if not torch.is_grad_enabled() or x.shape[0] < 2:
            return run(x)
        parts = x.chunk(2)  # ⌈b/2⌉ rows, then the rest (the planner's `block_parts` counts them so)
        if _recomputing_block.get():
            return torch.cat([checkpoint(torch.empty_like, part, use_reentrant=False) for part in parts])
        return torch.cat([_checkpointed(_rows_from(run, keys, first), keys)(part)
                          for first, part in zip((0, parts[0].shape[0]), parts)])
    return forward


def mlp_modules(block: nn.Module) -> list[nn.Module]:
    """The MLP modules of a block (by class name: `...MLP`), which `full` runs in chunks of rows."""
    return [m for m in block.modules() if type(m).__name__.lower().endswith("mlp")]


def attention_modules(blocks: list[nn.Module]) -> list[nn.Module]:
    """The attention modules of the blocks (by class name: `...Attention`), whose `core(q, k,
    v)` selective recomputation checkpoints."""
    found = [m for b in blocks for m in b.modules()
             if type(m).__name__.lower().endswith("attention") and callable(getattr(m, "core", None))]
    if not found:
        raise ValueError("selective recomputation acts on attention modules (a class named ...Attention) with a "
                         "core(q, k, v) method; these blocks have none: use full or segments")
    return found


def apply_recompute(runs: list[list[nn.Module]], policy: str, keys: DropoutKeys | None = None,
                    mlp_chunks: bool = True) -> None:
    """Checkpoint the blocks of each run (consecutive blocks that execute one after the
    other: the whole list, or a pipeline chunk's) by `policy` ("none" does nothing).
    `mlp_chunks=False`: `full` checkpoints each block whole, its MLP not in row chunks (a
    compiled block: its recomputation must save what its forward saved, and the chunks'
    skipped recomputation does not)."""
    mode, k = parse_recompute(policy)
    if mode == "none":
        return
    for blocks in runs:
        if mode in ("full", "segments"):
            _mark(blocks)
            _replay_routing(blocks)
        if mode == "full":
            for block in blocks:
                for mlp in mlp_modules(block) if mlp_chunks else []:
                    mlp.forward = _mlp_in_row_chunks(mlp.forward, keys)
                block.forward = _checkpointed(block.forward, keys, block=True)
            continue
        if mode == "selective":  # the module itself is not recomputed: hooks around it (SP's) stay
            for module in attention_modules(blocks):
                module.core = _checkpointed(module.core, keys)
            continue
        size = k or math.ceil(math.sqrt(len(blocks)))
        for start in range(0, len(blocks), size):
            head, members = blocks[start], blocks[start + 1:start + size]
            for block in members:
                block.forward = _member_forward(block.forward)
                setattr(block, SEGMENT_MEMBER, True)

            def run_segment(x, head_forward=head.forward, members=members):
                x = head_forward(x)
                running = _in_segment.set(True)
                try:
                    for block in members:  # called as modules: their hooks (ZeRO-3's gathers) run
                        x = block(x)
                finally:
                    _in_segment.reset(running)
                return x
            head.forward = _checkpointed(run_segment, keys)
