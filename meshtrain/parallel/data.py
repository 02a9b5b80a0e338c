"""Data parallelism: our own, not torch DDP.

Gradients live in contiguous buckets (each parameter's `.grad` is a view into its bucket),
filled in reverse order of registration, which is the order backward produces them. A
post-accumulate-grad hook marks each gradient ready; the moment a bucket is complete its
all-reduce is launched asynchronously, so communication overlaps the rest of the backward
pass. Buckets are launched in index order (the same order on every rank), and all are
waited on before the optimizer step.

Gradients are summed, not averaged: the training loop divides the loss by the global
number of tokens, so the sum over ranks (and over accumulated micro-batches) is exactly the
full-batch gradient. Inside `no_sync()` gradients only accumulate locally. With one
data-parallel rank nothing is sent: the buckets are only where gradients live.

Misuse cannot leave corrupt state behind: a second backward before `finish_grad_sync()`
(outside `no_sync`) resets the gradients and raises, and `reset()` (called by the step
runner when a step fails half-way) waits for collectives in flight and starts clean."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn as nn

from meshtrain.comm import METRICS, Comm


class Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], grad_dtype: torch.dtype | None = None):
        self.index, self.params = index, params
        dtype, device = grad_dtype or params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set[nn.Parameter] = set()  # gradients complete for this sync
        self.work = None  # the all-reduce in flight

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


class DataParallel:
    """Attach bucketed, overlapped gradient all-reduce over `axis` to `model`'s parameters.
    The model is not wrapped: its forward, names and state dict stay as they were."""

    def __init__(self, model: nn.Module, comm: Comm, *, axis: str = "dp", bucket_mb: float = 25.0,
                 on_launch: Callable[[int], None] | None = None, grad_dtype: torch.dtype | None = None,
                 elsewhere: list[nn.Parameter] = (), init_fingerprint: int | None = None,
                 params: list[tuple[str, nn.Parameter]] | None = None):
        """`elsewhere`: parameters another synchroniser makes whole (the linear layers on the
        all-gather path); they get no bucket, but are checked to agree like the rest.
        `params`: the (name, parameter) pairs this synchroniser owns (default: all of the
        model's that require gradients; expert parallelism gives the experts' to another,
        over their own replicas).
        `init_fingerprint`: the weights were drawn from an init spec (`parallel.materialize`), and
        replicas agree when their specs do."""
        self.comm, self.axis, self.on_launch = comm, axis, on_launch
        named = [(n, p) for n, p in (model.named_parameters() if params is None else params) if p.requires_grad]
        skip = set(elsewhere)
        bucketed = [p for _, p in reversed(named) if p not in skip]
        self.buckets = [Bucket(i, group, grad_dtype) for i, group in
                        enumerate(split_by_size(bucketed, int(bucket_mb * 2**20)))]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        check_replicas_agree(comm, axis, named, [b.params for b in self.buckets] + [list(elsewhere)],
                             init_fingerprint)
        # One rank with the gradients in their own dtype: nothing to send or convert, so no
        # hook runs per gradient (a Python call per parameter per backward, which a plain loop
        # does not make): backward accumulates into the bucket views in place.
        self._idle = comm.mesh.size(axis) == 1 and all(b.buffer.dtype == p.dtype for b in self.buckets
                                                        for p in b.params)
        for b in self.buckets:
            for p in b.params:
                if b.buffer.dtype == p.dtype:  # else each backward's gradient is added in (grad_dtype)
                    p.grad = b.views[p]
                if not self._idle:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync = True
        self._next_launch = 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        keep_grad_in(p, self._bucket_of[p].views[p])
        self._mark_ready(p)

    def input_pass(self):
        """Zero-bubble's input pass: nothing to hold back (a bucket waits for its weights anyway)."""
        return nullcontext()

    def weight_grad_ready(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Zero-bubble's weight pass formed `p`'s gradient by hand, so no hook saw it: it is
        added into its bucket and marked ready, as the hook would."""
        view = self._bucket_of[p].views[p]
        view.add_(grad)
        if view.dtype == p.dtype:
            p.grad = view
        self._mark_ready(p)

    def end_weight_pass(self) -> None:
        pass  # a bucket went out when its last gradient was marked

    def _mark_ready(self, p: nn.Parameter) -> None:
        """`p`'s gradient is complete for this sync (unless under `no_sync`); a complete
        bucket is launched, in index order."""
        bucket = self._bucket_of[p]
        if not self._sync or self._idle:
            return
        if p in bucket.ready:
            self.reset()
            raise RuntimeError("a second backward before finish_grad_sync(): gradients would be summed into a "
                               "bucket already being reduced. Run all but the last micro-batch under no_sync(); "
                               "the gradients were reset")
        bucket.ready.add(p)
        if bucket.complete:
            self._launch_ready()

    def owns(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient is made whole here."""
        return p in self._bucket_of

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        """Where `p`'s gradient lives (its `.grad` too when the dtypes agree)."""
        return self._bucket_of[p].views[p]

    def _launch_ready(self) -> None:
        """Launch complete buckets in index order, so every rank issues the same sequence."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            bucket = self.buckets[self._next_launch]
            bucket.work = self._launch(bucket)
            if self.on_launch is not None:
                self.on_launch(bucket.index)
            self._next_launch += 1

    def _launch(self, bucket: Bucket):
        return self.comm.all_reduce(bucket.buffer, self.axis, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce; a bucket with unused parameters is sent now."""
        if self._idle:
            return
        for bucket in self.buckets[self._next_launch:]:
            bucket.ready.update(bucket.params)
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
        self._clear()

    def _clear(self) -> None:
        for bucket in self.buckets:
            bucket.work = None
            bucket.ready.clear()
        self._next_launch = 0

    def reset(self) -> None:
        """Start clean after a step that failed half-way: wait for the all-reduces already
        launched (so nothing writes into a buffer behind our back), zero every gradient."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.buffer.zero_()
        self._clear()
        self._sync = True

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication (all micro-batches but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous


def keep_grad_in(p: nn.Parameter, view: torch.Tensor) -> None:
    """After backward accumulated into `p.grad`: make it the view of its buffer again if
    someone replaced it (`zero_grad(set_to_none=True)`), keeping the gradient; or, when the
    buffer is of another dtype (fp32 gradients of bf16 parameters), add it in and free it."""
    if view.dtype != p.dtype:
        view.add_(p.grad)
        p.grad = None
    elif p.grad.data_ptr() != view.data_ptr():
        view.copy_(p.grad)
        p.grad = view


def check_replicas_agree(comm: Comm, axis: str, named: list[tuple[str, nn.Parameter]],
                         groups: list[list[nn.Parameter]], init_fingerprint: int | None = None) -> None:
    """One small all-gather: every rank of `axis` must hold the same grouping of parameters
    into buckets (or their collectives would not match) and the same initial weights (or
    they train different models) — or, before the weights exist (`init_fingerprint`: they
    will be drawn from an init spec), the same spec and seed."""
    if comm.mesh.size(axis) == 1:
        return
    name_of = {p: n for n, p in named}
    layout = hashlib.blake2b(repr([[(name_of[p], tuple(p.shape), str(p.dtype)) for p in g]
                                   for g in groups]).encode(), digest_size=7)
    if init_fingerprint is not None:
        weights = init_fingerprint
    else:
        digest = hashlib.blake2b(digest_size=7)
        for _, p in named:
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        weights = int.from_bytes(digest.digest(), "little")
    mine = torch.tensor([int.from_bytes(layout.digest(), "little"), weights],
                        dtype=torch.int64, device=comm.mesh.device)
    every = torch.empty(comm.mesh.size(axis) * 2, dtype=torch.int64, device=mine.device)
    comm.all_gather(every, mine, axis, purpose=METRICS)
    every = every.view(-1, 2).tolist()
    for what, column in (("bucket layouts (parameter names, shapes or bucket size)", 0),
                         ("initial weights (build the model from the same seed on every rank)"
                          if init_fingerprint is None else "initialisation specs (model or seed)", 1)):
        if len({row[column] for row in every}) > 1:
            raise RuntimeError(f"data-parallel ranks disagree on their {what}")


def split_by_size(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Greedy split, in order, into groups of about `cap_bytes`, one dtype and device per group."""
    groups, current, size = [], [], 0
    for p in params:
        if current and (size >= cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        groups.append(current)
    return groups
