"""ZeRO stages 1, 2 and 3 over the data-parallel axis; stage 3 is FSDP's per-block gather
and free with prefetch.

Parameters are flattened into groups, each one buffer of N·S elements (zero-padded) of which
dp rank r owns elements [r·S, (r+1)·S): its *shard*. The optimizer steps only the shard, as
one 1-D piece per parameter it overlaps (AdamW is elementwise, so stepping pieces is
stepping the whole; matrices and vectors keep their own weight decay). Per stage:

- **1**: every rank keeps the full parameters and a full gradient buffer, as plain DP; the
  buffer is reduce-scattered (after the last micro-batch) so that only the shard is summed;
  after the step the shards are all-gathered back into the parameters. 2Ψ of traffic, as DP.
- **2**: the same, but no full gradient buffer: each group's gradients are reduce-scattered
  as soon as backward completes them (buckets launched from gradient hooks) and added into
  the shard's gradient. Every micro-batch's backward does so (as DeepSpeed and FSDP do): m×
  the reduce-scatter traffic, the memory of the formula.
- **3**: each rank keeps only its shards. A group per block (units: the children of the
  model's block list) and one for everything else. A unit's parameters are all-gathered just
  before its forward (the next unit's gather launched, so it overlaps this one's compute)
  and freed after it; autograd saves them as markers (`saved_tensors_hooks`), not tensors,
  so freeing is real; a hook on the unit's output gathers them again before its backward
  (prefetching the unit before it), and they are freed when their gradients are
  reduce-scattered. 3Ψ of traffic: two all-gathers and one reduce-scatter.

Gradients are sums (the loss is divided by the global token count), so a reduce-scatter with
SUM gives each rank its shard of the full-batch gradient.

Collectives go out in a fixed order on every rank, whatever order gradients become ready in
(as DP's buckets do): a model whose branch, chosen by the batch, skips a block on some ranks
would otherwise launch equal-sized collectives in different orders, which mixes data
silently on gloo and hangs NCCL. Reduce-scatters follow `_order` (the order backward fills
the groups: buckets by index; stage 3's units last to first, then the rest); a group that is
ready waits for those before it, and at the end of each backward every group not yet reduced
is, with zeros where no gradient came. Under stage 3 a unit that a forward or backward passes
by is gathered anyway, where its peers gather it (between its neighbours: `_catch_up_*`,
driven by hooks on the whole model, so not under pipelines, whose stages run their parts
themselves), and its zeros reduced; and reduce-scatters go on a channel of their own
(`Mesh.open_channel`), so that their order relative to the gathers may differ between ranks.

Zero-bubble's split backward (`pipeline/split.py`): the input pass runs under `input_pass()`
(no end of backward there; stage 3 frees its units after it), the weight pass hands its
gradients in by `weight_grad_ready` and ends the micro-batch's backward by `end_weight_pass`."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from meshtrain.comm import Comm
from meshtrain.parallel.modules import find_block_list
from meshtrain.optim import FULL_SHAPE, REPLICATED_OVER, SHARDED_OVER
from meshtrain.parallel.data import check_replicas_agree, keep_grad_in, split_by_size
from meshtrain.parallel.flat_group import FlatGroup, _buffer
from meshtrain.parallel.recompute import is_recomputed, passes_through
from meshtrain.parallel.state import Where, full_shape


class _SavedParam(NamedTuple):
    """What autograd keeps of a gathered parameter instead of the tensor (ZeRO-3)."""
    group: FlatGroup
    size: torch.Size
    stride: tuple
    offset: int


class Zero:
    """One ZeRO stage over `axis`: the gradient synchroniser (`no_sync`, `finish_grad_sync`,
    `reset`), the parameter gathering, and `pieces`, the (name, tensor, where, parameter) the
    optimizer steps. Stage 3 groups by the children of the block list named `blocks` (any
    module's: the largest `nn.ModuleList` when None), plus one group for the rest.
    `on_event(kind, group_index)` hears every "gather" launched and every "forward" done.
    `runs`: the sizes of the runs of consecutive units that run together (a pipeline stage's
    chunks); a prefetch stays inside its unit's run (the next chunk does not run next)."""

    def __init__(self, model: nn.Module, comm: Comm, stage: int, *, axis: str = "dp", bucket_mb: float = 25.0,
                 blocks: str | None = None, reshard_after_forward: bool = True,
                 on_event: Callable[[str, int], None] | None = None, grad_dtype: torch.dtype | None = None,
                 runs: list[int] | None = None, draw: Callable[[str, nn.Parameter], torch.Tensor] | None = None,
                 init_fingerprint: int | None = None, params: list[tuple[str, nn.Parameter]] | None = None,
                 align: int = 1):
        """`draw`, `init_fingerprint`: the parameters are placeholders, drawn as their groups
        are built (`FlatGroup`), from an init spec the replicas are checked to share.
        `params`: the (name, parameter) pairs this instance shards (default: all the model's
        that require gradients; expert parallelism shards the experts' over their own
        replicas, edp, in a second instance). `align`: where parameters and shards start in
        the flat groups (a low-bit optimizer's block, `FlatGroup`)."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}: use 1, 2 or 3")
        self.comm, self.stage, self.axis = comm, stage, axis
        self.reshard_after_forward, self.on_event = reshard_after_forward, on_event
        named = [(n, p) for n, p in (model.named_parameters() if params is None else params) if p.requires_grad]
        name_of = {p: n for n, p in named}
        if stage < 3:  # groups are gradient buckets, in the order backward fills them
            grouped = [(f"bucket {i}", g, []) for i, g in
                       enumerate(split_by_size([p for _, p in reversed(named)], int(bucket_mb * 2**20)))]
            self.n_units = 0
        else:
            grouped, self.n_units = _units(model, named, blocks)
        sizes = runs or [self.n_units]
        self._run_of = [r for r, size in enumerate(sizes) for _ in range(size)]
        self._expected: tuple[bool, int] | None = None  # the next instruction (`expect`), under pipelines
        check_replicas_agree(comm, axis, named, [g for _, g, _ in grouped], init_fingerprint)
        self.groups = [FlatGroup(i, label, [(name_of[p], p) for p in params], comm, axis, keep_full=stage < 3,
                                 draw=draw, align=align)
                       for i, (label, params, _) in enumerate(grouped)]
        self._group_of = {p: g for g in self.groups for p in g.params}
        self.grad_dtype = grad_dtype or self.groups[0].shard.dtype
        self.pieces: list[tuple[str, torch.Tensor, Where, nn.Parameter]] = []
        self.piece_grads: dict[torch.Tensor, torch.Tensor] = {}  # each piece's gradient (its .grad if dtypes agree)
        for g in self.groups:
            if stage == 1:  # the full gradient buffer stays (stage 2 removes it)
                g.grad_full = _buffer(g.padded, g.shard, self.grad_dtype)
                g.grad_views = {p: g.grad_full[off:off + p.numel()].view_as(p) for p, off in zip(g.params, g.offsets)}
                for p in g.params:
                    if p.dtype == self.grad_dtype:  # else each backward's gradient is added in
                        p.grad = g.grad_views[p]
                g.grad_shard = g.grad_full[g.lo:g.hi]
            else:
                g.grad_shard = _buffer(g.shard_size, g.shard, self.grad_dtype)
            for i, where, span in g.pieces:
                value = g.shard[span]
                self.piece_grads[value] = g.grad_shard[span]
                if value.dtype == self.grad_dtype:
                    value.grad = g.grad_shard[span]
                setattr(value, SHARDED_OVER, (axis, *getattr(g.params[i], SHARDED_OVER, ())))
                if hasattr(g.params[i], REPLICATED_OVER):
                    setattr(value, REPLICATED_OVER, getattr(g.params[i], REPLICATED_OVER))
                setattr(value, FULL_SHAPE, full_shape(g.params[i], comm, g.shapes[i]))  # for the optimizer factory
                g.values.append(value)
                self.pieces.append((g.names[i], value, where, g.params[i]))
        for p in self._group_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync, self._pending, self._callback_queued = True, [], False
        self._holding = False  # inside zero-bubble's input pass: the backward ends with the weight pass
        self._by_hand: dict[nn.Parameter, torch.Tensor] = {}  # the weight pass's gradients (stages 2, 3)
        # The fixed order of reduce-scatters, and how far this backward (or sync) has gone.
        self._order = self.groups if stage < 3 else self.groups[:self.n_units][::-1] + self.groups[self.n_units:]
        self._next, self._reduced_this_step = 0, False
        self._skipped: set[FlatGroup] = set()  # stage 3: units a backward passed by: reduced as zeros
        self._channel = None
        if stage == 3 and comm.mesh.size(axis) > 1:
            self._channel = "zero-reduce-scatter"
            comm.mesh.open_channel(axis, self._channel)
        # Stage 3's cursors through the units, when the whole model's forward is seen (None: not).
        self._forward_at: int | None = None
        self._backward_at: int | None = None
        self._ran: set[int] = set()  # the units whose forward ran in the pass being tracked
        self._tracking = False
        self._by_storage: dict[int, FlatGroup] = {}  # gathered groups, by their buffer's address
        self._saving: list = []  # saved-tensor hooks entered by units running forward
        self.live_gathered = self.peak_gathered = 0
        if stage == 3:
            for g, (_, _, owners) in zip(self.groups, grouped):
                self._hook_forward(g, owners)
            model.register_forward_pre_hook(self._model_forward_begins)
            model.register_forward_hook(self._model_forward_ends)

    def owns(self, p: nn.Parameter) -> bool:
        """Whether `p` is sharded here."""
        return p in self._group_of

    def pieces_of(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The pieces (tensors with `.grad`) of some parameters, in order."""
        wanted = {id(p) for p in params}
        return [value for _, value, _, p in self.pieces if id(p) in wanted]

    # ---- gradients ---------------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.stage == 1:
            keep_grad_in(p, self._group_of[p].grad_views[p])
        if self._mark_ready(p) and not self._holding:
            self._queue_end_of_backward()
            self._reduce_in_order()

    def _mark_ready(self, p: nn.Parameter) -> bool:
        """Note `p`'s gradient as complete; False when it only accumulates (stage 1 under `no_sync`)."""
        g = self._group_of[p]
        if self.stage == 1:
            if not self._sync:
                return False
            if p in g.ready or g.reduced:
                self.reset()
                raise RuntimeError("a second backward before finish_grad_sync(): gradients would be summed into a "
                                   "buffer already being reduced. Run all but the last micro-batch under no_sync(); "
                                   "the gradients were reset")
        g.ready.add(p)
        return True

    @contextmanager
    def input_pass(self):
        """Zero-bubble's input pass: a backward that forms every gradient but the linear
        layers' weights'. The micro-batch's backward ends with its weight pass
        (`weight_grad_ready`, `end_weight_pass`), not here. Under stage 3 a unit is freed as
        soon as its backward is over (`_free_next`) and the rest when the pass ends — the
        weight pass needs the layers' inputs and output gradients, not their weights, so the
        free is apart from the reduce-scatter."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            for g in self.groups:
                self._free(g)

    def weight_grad_ready(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Zero-bubble's weight pass formed `p`'s gradient by hand, so no hook saw it: it is
        added where this stage keeps it (stage 1's full buffer; else beside `.grad`, as a
        freed stage-3 parameter cannot hold one) and marked ready, as the hook would."""
        if self.stage == 1:
            view = self._group_of[p].grad_views[p]
            view.add_(grad)
            if view.dtype == p.dtype:
                p.grad = view
        else:
            self._by_hand[p] = grad if p not in self._by_hand else self._by_hand[p].add_(grad)
        if self._mark_ready(p) and self.stage == 1:
            self._reduce_in_order()

    def end_weight_pass(self) -> None:
        """The micro-batch's backward ends with its weight pass: stages 2 and 3 reduce-scatter
        every group, in order, as the end-of-backward callback would."""
        if self.stage > 1:
            self._end_of_backward()

    def _take_grads(self, g: FlatGroup) -> list[torch.Tensor | None]:
        """Stages 2 and 3: a group's gradients (from hooks, and from a weight pass), let go."""
        grads = []
        for p in g.params:
            grad, extra = p.grad, self._by_hand.pop(p, None)
            grads.append(extra if grad is None else grad if extra is None else grad + extra)
            p.grad = None
        return grads

    def _queue_end_of_backward(self) -> None:
        if self.stage > 1 and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reduce_in_order(self, everything: bool = False) -> None:
        """Launch the reduce-scatters of the groups that are ready, in `_order`; a ready group
        waits for those before it. `everything`: all the rest now (zeros where no gradient)."""
        while self._next < len(self._order):
            g = self._order[self._next]
            if not (everything or g.complete() or g in self._skipped):
                return
            self._reduce(g)
            self._next += 1

    def _reduce(self, g: FlatGroup) -> None:
        """Launch the reduce-scatter of a group's gradients into this rank's shard."""
        g.ready.clear()
        g.reduced = True
        self._skipped.discard(g)
        if self.stage == 1:
            source = g.grad_full
        else:
            source = g.flat_from(self._take_grads(g), self.grad_dtype)
        out = _buffer(g.shard_size, g.shard, self.grad_dtype)
        work = self.comm.reduce_scatter(out, source, self.axis, async_op=True, channel=self._channel)
        self._pending.append((g, work, out, source))
        if self.stage == 3:
            self._free(g)  # its gradients are out: the full parameters are no longer needed

    def _end_of_backward(self) -> None:
        """Every group reduced once per backward (stages 2 and 3), in order: the units this
        backward passed by at its end, then whatever got no (or not all) gradients."""
        self._callback_queued = False
        if self._backward_at is not None:
            self._catch_up_backward(-1)
            self._backward_at = None
        self._reduce_in_order(everything=True)
        self._next, self._reduced_this_step = 0, True
        self._drain()

    def _drain(self) -> None:
        """Wait for the reduce-scatters in flight and take their results into the shards."""
        self._callback_queued = False
        for g, work, out, _ in self._pending:
            work.wait()
            if self.stage == 1:
                g.grad_shard.copy_(out)
            else:
                g.grad_shard.add_(out)  # accumulated over micro-batches
            g.reduced = False
        self._pending.clear()

    def finish_grad_sync(self) -> None:
        """Every shard's gradient summed: groups not reduced yet (stage 1; or stages 2 and 3
        when no backward reached them) are reduced now, in order, with zeros where no
        gradient came; then all are waited for."""
        if self.stage == 1 or not self._reduced_this_step:
            self._reduce_in_order(everything=True)
        self._next, self._reduced_this_step = 0, False
        self._drain()
        for g in self.groups:
            self._free(g)  # stage 3: nothing stays gathered between steps

    def reset(self) -> None:
        """Start clean after a step that failed half-way."""
        for _, work, _, _ in self._pending:
            work.wait()
        self._pending.clear()
        self._callback_queued, self._sync = False, True
        self._next, self._reduced_this_step, self._forward_at, self._backward_at = 0, False, None, None
        self._skipped.clear()
        self._by_hand.clear()
        self._holding = False
        for g in self.groups:
            g.ready.clear()
            g.reduced = False
            (g.grad_full if self.stage == 1 else g.grad_shard).zero_()
            if self.stage > 1:
                for p in g.params:
                    p.grad = None
            self._free(g)
        while self._saving:
            hooks = self._saving.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)

    @contextmanager
    def no_sync(self):
        """Stage 1 accumulates locally; stages 2 and 3 have no full gradient buffer to
        accumulate in, so they reduce-scatter every micro-batch anyway."""
        previous, self._sync = self._sync, self.stage > 1
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        for g in self.groups:
            (g.grad_full if self.stage == 1 else g.grad_shard).zero_()

    # ---- parameters ----------------------------------------------------------------------

    def gather_params(self) -> None:
        """Stages 1 and 2, after the optimizer step: every rank's updated shard into the full
        parameters."""
        launched = []
        for g in self.groups:
            shard = g.shard.clone()  # the output contains the input's place: gather from a copy
            launched.append((self.comm.all_gather(g.full, shard, self.axis, async_op=True), shard))
        for work, _ in launched:
            work.wait()

    def _launch_gather(self, g: FlatGroup) -> None:
        if g.full is not None:
            return  # gathered, or on its way
        full = _buffer(g.padded, g.shard)
        g.work = self.comm.all_gather(full, g.shard, self.axis, async_op=True)
        g.point_params_at(full)
        self._by_storage[full.untyped_storage().data_ptr()] = g
        self.live_gathered += full.numel() * full.element_size()
        self.peak_gathered = max(self.peak_gathered, self.live_gathered)
        if self.on_event is not None:
            self.on_event("gather", g.index)

    def _gather(self, g: FlatGroup) -> None:
        self._launch_gather(g)
        if g.work is not None:
            g.work.wait()
            g.work = None

    def _free(self, g: FlatGroup) -> None:
        if g.full is None or self.stage < 3:
            return
        if g.work is not None:
            g.work.wait()
            g.work = None
        self._by_storage.pop(g.full.untyped_storage().data_ptr(), None)
        self.live_gathered -= g.full.numel() * g.full.element_size()
        g.release_params()

    def _hook_forward(self, g: FlatGroup, owners: list[nn.Module]) -> None:
        g.owners, g.seen = len(owners), 0
        for m in owners:
            m.register_forward_pre_hook(partial(self._before_forward, g))
            m.register_forward_hook(partial(self._after_forward, g))

    def _is_unit(self, index: int) -> bool:
        return 0 <= index < self.n_units

    def _prefetch(self, unit: int, step: int) -> None:
        """Launch the gather of the unit `step` away, if it is one of the same run; at a run's
        edge, of the unit the next instruction starts with (`expect`), if one was said and no
        unit but the current one is gathered (one whose gradients wait for their
        reduce-scatter may be): two units at most, as within a run."""
        if not self._is_unit(unit):
            return
        other = unit + step
        if self._is_unit(other) and self._run_of[unit] == self._run_of[other]:
            self._launch_gather(self.groups[other])
        elif self._expected is not None and self._units_gathered() < 2:  # at most the current and the next
            forward, run = self._expected
            units = [i for i, r in enumerate(self._run_of) if r == run]
            if units:
                self._launch_gather(self.groups[units[0] if forward else units[-1]])

    def _units_gathered(self) -> int:
        return sum(g.full is not None for g in self.groups[:self.n_units])

    def expect(self, upcoming: tuple[bool, int] | None) -> None:
        """A pipeline's next instruction that computes with the weights, after the one starting
        now: (forward?, run) — a forward (or backward) of that run (its chunk), which starts
        with the run's first (or last) unit; None: none this step. The current run's edge
        prefetches that unit, rather than the next unit by index, which under interleaving is
        another chunk's, one that does not run next."""
        self._expected = upcoming

    def _model_forward_begins(self, module, args) -> None:
        if not _in_backward():  # (a checkpoint's recomputation runs forwards inside backward)
            self._forward_at, self._tracking = 0, True
            self._ran.clear()

    def _model_forward_ends(self, module, args, output) -> None:
        if self._forward_at is not None and not _in_backward():
            self._catch_up_forward(self.n_units)
            self._forward_at = None

    def _catch_up_forward(self, unit: int) -> None:
        """The units this forward passed by before `unit`: gathered anyway (their peers gather
        them here), then treated as after their forward."""
        for j in range(self._forward_at, unit):
            self._gather(self.groups[j])
            if self.reshard_after_forward:
                self._free(self.groups[j])
        self._forward_at = max(self._forward_at, unit)

    def _catch_up_backward(self, unit: int) -> None:
        """The units down to `unit` (exclusive), last first, that the forward passed by: no
        gradient comes to them; gathered anyway, as their peers gather them, and their zeros
        reduced in their turn. (Hooks need not come in unit order — a checkpointed segment's
        blocks do not — so only the units that did not run are passed by.)"""
        for j in range(self._backward_at, unit, -1):
            if j not in self._ran:
                self._gather(self.groups[j])
                self._skipped.add(self.groups[j])
        self._backward_at = min(self._backward_at, unit)
        self._reduce_in_order()

    def _before_forward(self, g: FlatGroup, module, args) -> None:
        if passes_through(module):
            return
        tracked = self._is_unit(g.index) and self._forward_at is not None and not _in_backward()
        if tracked:
            self._catch_up_forward(g.index)
        self._gather(g)
        self._prefetch(g.index, +1)  # overlaps this unit's forward
        if tracked:
            self._forward_at = g.index + 1
            self._ran.add(g.index)
        if torch.is_grad_enabled():
            # Under activation checkpointing the checkpoint saves nothing of the unit (its
            # recomputation uses the parameters gathered then), and hooks entered inside it
            # would take its saves from it: none here.
            hooks = None if is_recomputed(module) else torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            if hooks is not None:
                hooks.__enter__()
            self._saving.append(hooks)

    def _after_forward(self, g: FlatGroup, module, args, output) -> None:
        if passes_through(module):
            return
        if torch.is_grad_enabled():
            hooks = self._saving.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(partial(self._before_backward, g))
        if self.on_event is not None:
            self.on_event("forward", g.index)
        g.seen += 1
        if g.seen == g.owners:
            g.seen = 0
            if self.reshard_after_forward:
                self._free(g)

    def _before_backward(self, g: FlatGroup, grad) -> None:
        """A unit's output has its gradient: its backward is next. Gather its parameters
        again (and launch the gather of the unit before it)."""
        if self._tracking and self._is_unit(g.index):
            if self._backward_at is None:
                self._backward_at = self.n_units - 1
                self._queue_end_of_backward()
            self._catch_up_backward(g.index)
            self._backward_at = min(self._backward_at, g.index - 1)
        if self._holding:  # an input pass: the unit after this one is done with its weights
            self._free_next(g.index)
        self._gather_for_backward(g)
        self._prefetch(g.index, -1)

    def _free_next(self, unit: int) -> None:
        """In zero-bubble's input pass, where no reduce-scatter frees a unit: what consumed
        unit `unit`'s output has its input's gradient, so its backward is over — the next
        unit of the run, or after the last unit the parameters outside the blocks (on a
        split stage those run after the blocks: the last stage's norm and head; the
        embedding is the first stage's, which runs its backward whole)."""
        if not self._is_unit(unit):
            return
        if self._is_unit(unit + 1) and self._run_of[unit] == self._run_of[unit + 1]:
            self._free(self.groups[unit + 1])
        elif unit == self.n_units - 1:
            for g in self.groups[self.n_units:]:
                self._free(g)

    def _gather_for_backward(self, g: FlatGroup) -> None:
        """Its own seam: the mutant that frees a block before its backward leaves it out."""
        self._gather(g)

    def _pack(self, t: torch.Tensor):
        try:
            g = self._by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            return t
        return t if g is None else _SavedParam(g, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        g = saved.group
        if g.full is None:
            raise RuntimeError(f"ZeRO-3: the parameters of {g.label} were freed before its backward gathered them; "
                               "computing on freed memory would give garbage")
        if g.work is not None:
            g.work.wait()
            g.work = None
        return torch.as_strided(g.full, saved.size, saved.stride, saved.offset)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def _units(model: nn.Module, named: list[tuple[str, nn.Parameter]], blocks: str | list[str] | None):
    """ZeRO-3's groups in forward order: (label, parameters, the modules whose forward uses
    them): one per unit — each child of the block list (`blocks` names it, or the largest
    `ModuleList`/`Sequential`), or each module a list of names gives (FSDP2-style wrapping) —
    then the rest, used by the modules that own them; and the number of units."""
    if isinstance(blocks, (list, tuple)):
        units = []
        for name in blocks:
            try:
                units.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ValueError(f"wrap: the model has no module {name!r}") from None
    else:
        prefix, block_list = find_block_list(model, blocks)
        units = [(f"{prefix}.{key}" if prefix else key, unit) for key, unit in block_list._modules.items()]
    trainable = {p for _, p in named}
    claimed, grouped = set(), []
    for label, unit in units:
        params = [p for p in unit.parameters() if p in trainable and p not in claimed]
        if params:
            claimed.update(params)
            grouped.append((label, params, [unit]))
    rest = [p for _, p in named if p not in claimed]
    if rest:
        rest_set = set(rest)
        owners = [m for m in model.modules() if any(q in rest_set for q in m._parameters.values() if q is not None)]
        grouped.append(("the parameters outside the blocks", rest, owners))
    return grouped, len(grouped) - (1 if rest else 0)
