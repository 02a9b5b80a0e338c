"""The pipeline executor: runs one stage's instruction list (from `schedules`) with real
point-to-point transfers — the same lists the simulator runs and `meshtrain schedule` draws.

An interpreter maps each instruction type to a method. Transfers come in the schedule's
groups (`Transfers`), each issued as one `batch_isend_irecv` by the stage's `Transport`,
which waits as NCCL's stream would (a group with a receive before the next compute, sends
when a later group is waited for or at the step's end). Every received tensor gets a buffer
of its own (a buffer reused while an earlier micro-batch still needs it for its weight
gradient would silently corrupt that gradient). A stage's output is freed once its send has
completed (the autograd graph keeps what backward needs). The loss is computed on the last
stage only. Data-parallel gradient sync fires only on each chunk's last backward instruction
(under zero-bubble its last input pass and its last weight pass; under interleaving a chunk's
buckets so go out while the other chunks still compute); every other one runs under the
synchroniser's `no_sync`. Zero-bubble's two passes split the backward for real (`split.py`):
the input pass is one backward that keeps the linear layers' (input, output gradient), the
weight pass forms only their ∇W and hands it to the synchroniser. On gloo transfers also
carry a tag naming (kind, micro-batch, chunk); NCCL ignores tags, and the simulator proves
that order alone pairs them right."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from meshtrain.comm import METRICS, Comm
from meshtrain.parallel.pipeline import schedules as S
from meshtrain.parallel.pipeline.split import WeightGradStore, split_linears
from meshtrain.parallel.pipeline.stages import Stage
from meshtrain.parallel.pipeline.transport import Transfer, Transport

PP = "pp"


class PipelineRunner:
    """The step runner of a pipeline stage (it stands where `PlainRunner` stands)."""

    def __init__(self, stage: Stage, instructions: list, comm: Comm, activation_shape: tuple[int, ...] | None,
                 dtype: torch.dtype, *, strict_p2p: bool = False):
        """Collective (every rank of the world): it prepares the pp axis's transport."""
        self.stage, self.instructions, self.comm = stage, instructions, comm
        self.transport = Transport(comm, PP, strict=strict_p2p)
        self.activation_shape, self.dtype = activation_shape, dtype
        self.recorder = None  # a trace.Recorder: `train --trace` times every compute instruction
        # Each chunk's last backward syncs: its buckets go out when that chunk is done, not
        # all at the stage's very end. Under zero-bubble that is its last input pass (the
        # norms' and biases' gradients) and its last weight pass (the linear layers').
        last = {(op.chunk, type(op)): i for i, op in enumerate(instructions)
                if isinstance(op, (S.Backward, S.BackwardInput, S.BackwardWeight))}
        self._syncing = set(last.values())
        self.store: WeightGradStore | None = None  # zero-bubble's weight gradients (`split_backward`)
        # `upcoming((forward, chunk) or None)` hears, as each instruction starts, the next one
        # that computes with this stage's weights (ZeRO-3 prefetches its first block there).
        self.upcoming: Callable[[tuple[bool, int] | None], None] | None = None
        self._next_use = _next_weight_use(instructions, stage)

    def split_backward(self) -> list[str]:
        """Zero-bubble: the linear layers of this stage keep their weight gradients for the
        weight pass (`split.py`); called once the stage's layers are final (after the TP plan).
        The first stage has no input gradient to send, so it runs each backward whole, in its
        weight pass, and is left as it is. Returns the layers split."""
        if self.stage.is_first(0) and self.stage.chunks == 1:
            return []
        self.store = WeightGradStore()
        return split_linears(self.stage.model, self.store)

    def run(self, p, micro_batch, count: int, normalizer: float) -> torch.Tensor:
        """Run this stage's instructions for one step; returns the summed loss ÷ normalizer of
        the micro-batches whose loss this stage computed (zero elsewhere), detached."""
        self._p, self._micro_batch, self._normalizer = p, micro_batch, normalizer
        self._inputs, self._outputs, self._grads = {}, {}, {}
        self._total = torch.zeros((), device=self.comm.mesh.device)
        if self.recorder is not None:
            self.comm.barrier(PP)
            self.recorder.start_step()
        try:
            for index, op in enumerate(self.instructions):
                if self.upcoming is not None:
                    self.upcoming(self._next_use[index])
                sync = index in self._syncing
                with nullcontext() if sync else p.grad_sync.no_sync(), self._timing(op):
                    getattr(self, "_" + type(op).__name__)(op)
            self.transport.drain()
        except BaseException:
            self.transport.abandon()
            if self.store is not None:
                self.store.clear()
            p.grad_sync.reset()
            raise
        return self._total

    def _timing(self, op):
        return nullcontext() if self.recorder is None else self.recorder.timing(op)

    # ---- transfers ----------------------------------------------------------------------------

    def _peer(self, op: S.Instruction) -> tuple[int, int]:
        """The pp offset to the other end of a transfer, and that end's chunk."""
        step = +1 if isinstance(op, (S.SendActivation, S.RecvGrad)) else -1
        other = self.stage.virtual(op.chunk) + step
        return other % self.stage.stages - self.stage.stage, other // self.stage.stages

    def forward_only(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Evaluation (no instruction list, no gradients kept by the caller): each virtual stage
        in turn, its owner receives the activation (of `shape`), runs its chunk and sends it on,
        one grouped transfer at a time, which NCCL cannot deadlock. The last virtual stage's
        output on its ranks, None on the others."""
        stage, mesh = self.stage, self.comm.mesh
        out = None
        pp = mesh.size("pp")
        for v in range(stage.last_virtual + 1):
            owner, chunk = v % pp, v // pp
            if owner != mesh.coord("pp"):
                continue
            if v > 0:
                h = torch.empty(shape, dtype=self.dtype, device=mesh.device)
                prev = (owner - 1) % pp - mesh.coord("pp")
                for work in self.comm.exchange([(False, h, prev, 0)], "pp", purpose=METRICS):
                    work.wait()
            else:
                h = x
            h = stage.forward(chunk, h)
            if v < stage.last_virtual:
                nxt = (owner + 1) % pp - mesh.coord("pp")
                for work in self.comm.exchange([(True, h.contiguous(), nxt, 0)], "pp", purpose=METRICS):
                    work.wait()
            else:
                out = h
        return out

    def _transfer(self, op: S.Instruction, tensor: torch.Tensor) -> Transfer:
        send = isinstance(op, S.SEND)
        kind = 0 if isinstance(op, (S.SendActivation, S.RecvActivation)) else 1
        offset, chunk = self._peer(op)
        receiver_chunk = chunk if send else op.chunk
        tag = (kind * self.stage.chunks + receiver_chunk) * 1_000_000 + op.mb
        return Transfer(send, tensor, offset, (kind, op.mb, receiver_chunk), tag, op)

    def _buffer(self, op: S.Instruction) -> torch.Tensor:
        """A fresh buffer for a received message (one per message)."""
        return torch.empty(self.activation_shape, dtype=self.dtype, device=self.comm.mesh.device)

    def _Transfers(self, group: S.Transfers):
        transfers, sent_outputs, sent_grads, received = [], [], [], []
        for op in group.ops:
            key = (op.mb, op.chunk)
            if isinstance(op, S.SendActivation):
                out = self._outputs[key]
                transfers.append(self._transfer(op, out.detach()))
                sent_outputs.append(out)
            elif isinstance(op, S.SendGrad):
                # The received activation is done with: its gradient is all that goes back
                # (and is let go once sent, though the graph may keep the activation for a
                # weight pass).
                received_input = self._inputs.pop(key)
                transfers.append(self._transfer(op, received_input.grad))
                sent_grads.append(received_input)
            else:
                buffer = self._buffer(op)
                transfers.append(self._transfer(op, buffer))
                received.append((op, buffer))

        def done():
            for out in sent_outputs:
                _free_values(out)
            for received_input in sent_grads:
                received_input.grad = None
            for op, buffer in received:
                if isinstance(op, S.RecvActivation):
                    self._inputs[(op.mb, op.chunk)] = buffer.requires_grad_()
                else:
                    self._grads[(op.mb, op.chunk)] = buffer
        self.transport.issue(transfers, done)

    # ---- compute ----------------------------------------------------------------------------

    def _Forward(self, op):
        inputs, targets = self._micro_batch(op.mb)
        x = inputs if self.stage.is_first(op.chunk) else self._inputs[(op.mb, op.chunk)]
        with self._p.forward_scope():
            out = self.stage.forward(op.chunk, x)
            if self.stage.is_last(op.chunk):
                out = self._p.loss_fn(out, targets) / self._normalizer
                self._total += out.detach()
        self._outputs[(op.mb, op.chunk)] = out

    def _backward(self, op) -> None:
        out = self._outputs[(op.mb, op.chunk)]
        grad = None if self.stage.is_last(op.chunk) else self._grads[(op.mb, op.chunk)]
        torch.autograd.backward(out, grad)
        self._release(op)

    def _Backward(self, op):
        self._backward(op)

    def _BackwardInput(self, op):
        """Every gradient but the linear layers' weights' (kept for the weight pass): the
        input's, sent back next, and the norms', biases' and embeddings', through their hooks.
        The first stage's input is token ids: it has nothing to send, and runs its backward
        whole in the weight pass."""
        if not self.stage.is_first(op.chunk):
            with self.store.input_pass((op.mb, op.chunk)), self._p.grad_sync.input_pass():
                self._backward(op)

    def _BackwardWeight(self, op):
        """∇W of the linear layers from what the input pass kept — no autograd, so the
        synchroniser is told of the gradients explicitly."""
        if self.stage.is_first(op.chunk):
            self._backward(op)
        else:
            sync = self._p.grad_sync
            with torch.no_grad():
                for weight, grad in self.store.weight_grads((op.mb, op.chunk)):
                    sync.weight_grad_ready(weight, grad)
                sync.end_weight_pass()

    def _release(self, op) -> None:
        """After a micro-batch's backward: its output and the gradient received for it."""
        key = (op.mb, op.chunk)
        for store in (self._outputs, self._grads):
            store.pop(key, None)

    def _SyncGrads(self, op):
        pass  # the training step finishes the gradient sync (the buckets launched in the last backward)

    def _OptimizerStep(self, op):
        pass  # the training step clips and steps


def _uses_weights(op: S.Instruction, stage: Stage) -> bool:
    """Whether an instruction computes with the stage's weights: forwards and backwards, but
    not zero-bubble's weight pass (formed from what the input pass kept) — except on the
    first stage, which runs its whole backward there and nothing in its input pass."""
    if isinstance(op, (S.Forward, S.Backward)):
        return True
    if isinstance(op, S.BackwardInput):
        return not stage.is_first(op.chunk)
    return isinstance(op, S.BackwardWeight) and stage.is_first(op.chunk)


def _next_weight_use(instructions: list, stage: Stage) -> list[tuple[bool, int] | None]:
    """For each instruction, (forward?, chunk) of the next one after it that uses the weights."""
    out, upcoming = [None] * len(instructions), None
    for i in range(len(instructions) - 1, -1, -1):
        out[i] = upcoming
        op = instructions[i]
        if _uses_weights(op, stage):
            upcoming = (isinstance(op, S.Forward), op.chunk)
    return out


def _free_values(out: torch.Tensor) -> None:
    """A sent output keeps only its shape: its grad_fn is what backward needs, not its values
    — unless that grad_fn saved the output itself (ReLU, softmax), in which case it stays."""
    if not _saved_by_own_grad_fn(out):
        out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


def _saved_by_own_grad_fn(out: torch.Tensor) -> bool:
    node = out.grad_fn
    if node is None:
        return True
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                saved = getattr(node, name)
            except RuntimeError:
                continue
            if isinstance(saved, torch.Tensor) and saved.data_ptr() == out.data_ptr():
                return True
    return False
