"""The pipeline executor: runs one stage's instruction list (from `schedules`) with real
point-to-point transfers — the same lists the simulator runs and `meshtrain schedule` draws.

An interpreter maps each instruction type to a method. Every received tensor gets a buffer
of its own (a buffer reused while an earlier micro-batch still needs it for its weight
gradient would silently corrupt that gradient). A stage's output is freed right after its
send completes (the autograd graph keeps what backward needs). The loss is computed on the
last stage only. Data-parallel gradient sync fires only on the stage's last backward
instruction (the last weight gradient under zero-bubble); every earlier one runs under the
synchroniser's `no_sync`. Transfers carry a tag naming (kind, micro-batch, chunk), so a
receive can only match its own send."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from meshtrain.comm import Comm
from meshtrain.parallel.pipeline import schedules as S
from meshtrain.parallel.pipeline.stages import Stage

PP = "pp"


class PipelineRunner:
    """The step runner of a pipeline stage (it stands where `PlainRunner` stands)."""

    def __init__(self, stage: Stage, instructions: list[S.Instruction], comm: Comm, activation_shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.stage, self.instructions, self.comm = stage, instructions, comm
        self.activation_shape, self.dtype = activation_shape, dtype
        self.recorder = None  # a trace.Recorder: `train --trace` times every compute instruction
        backwards = [i for i, op in enumerate(instructions) if isinstance(op, (S.Backward, S.BackwardWeight))]
        self._last_backward = backwards[-1] if backwards else -1

    def run(self, p, micro_batch, count: int, normalizer: float) -> torch.Tensor:
        """Run this stage's instructions for one step; returns the summed loss ÷ normalizer of
        the micro-batches whose loss this stage computed (zero elsewhere), detached."""
        self._p, self._micro_batch, self._normalizer = p, micro_batch, normalizer
        self._inputs, self._outputs, self._grads, self._sends = {}, {}, {}, []
        self._output_sends = {}  # (micro-batch, chunk) -> the handle of its output's send
        self._total = torch.zeros((), device=self.comm.mesh.device)
        if self.recorder is not None:
            self.comm.barrier(PP)
            self.recorder.start_step()
        try:
            for index, op in enumerate(self.instructions):
                self._free_sent_outputs()
                sync = index == self._last_backward
                with nullcontext() if sync else p.grad_sync.no_sync(), self._timing(op):
                    getattr(self, "_" + type(op).__name__)(op)
            for work, _ in self._sends:
                work.wait()
        except BaseException:
            p.grad_sync.reset()
            raise
        return self._total

    def _timing(self, op):
        return nullcontext() if self.recorder is None else self.recorder.timing(op)

    # ---- transfers ----------------------------------------------------------------------------

    def _tag(self, kind: int, op: S.Instruction, chunk: int) -> int:
        return (kind * self.stage.chunks + chunk) * 1_000_000 + op.mb

    def _peer_offset(self, chunk: int, step: int) -> tuple[int, int]:
        """The pp offset to the virtual stage `step` away from this chunk's, and its chunk."""
        other = self.stage.virtual(chunk) + step
        return other % self.stage.stages - self.stage.stage, other // self.stage.stages

    def _send(self, tensor: torch.Tensor, kind: int, op: S.Instruction, step: int, then_free=None) -> None:
        offset, chunk = self._peer_offset(op.chunk, step)
        self._sends.append((self.comm.send(tensor, PP, offset, tag=self._tag(kind, op, chunk)), then_free))
        if then_free is not None:
            self._output_sends[(op.mb, op.chunk)] = self._sends[-1][0]

    def _receive(self, kind: int, op: S.Instruction, step: int) -> torch.Tensor:
        offset, _ = self._peer_offset(op.chunk, step)
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.comm.mesh.device)  # one per message
        self.comm.recv(buffer, PP, offset, tag=self._tag(kind, op, op.chunk)).wait()
        return buffer

    def _free_sent_outputs(self) -> None:
        """An output whose send has completed keeps only its shape: its grad_fn is what
        backward needs, not its values — unless that grad_fn saved the output itself (ReLU,
        softmax), in which case it stays."""
        pending = []
        for work, out in self._sends:
            if out is not None and work.is_completed():
                if not _saved_by_own_grad_fn(out):
                    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)
            else:
                pending.append((work, out))
        self._sends = pending

    def _SendActivation(self, op):
        out = self._outputs[(op.mb, op.chunk)]
        self._send(out.detach(), 0, op, +1, then_free=out)

    def _RecvActivation(self, op):
        self._inputs[(op.mb, op.chunk)] = self._receive(0, op, -1).requires_grad_()

    def _SendGrad(self, op):
        # The received activation is done with (its gradient is all that is sent back); the
        # send holds the gradient until it completes.
        self._send(self._inputs.pop((op.mb, op.chunk)).grad, 1, op, -1)

    def _RecvGrad(self, op):
        self._grads[(op.mb, op.chunk)] = self._receive(1, op, +1)

    # ---- compute ----------------------------------------------------------------------------

    def _Forward(self, op):
        inputs, targets = self._micro_batch(op.mb)
        x = inputs if self.stage.is_first(op.chunk) else self._inputs[(op.mb, op.chunk)]
        out = self.stage.forward(op.chunk, x)
        if self.stage.is_last(op.chunk):
            out = self._p.loss_fn(out, targets) / self._normalizer
            self._total += out.detach()
        self._outputs[(op.mb, op.chunk)] = out

    def _backward(self, op, inputs) -> None:
        out = self._outputs[(op.mb, op.chunk)]
        grad = None if self.stage.is_last(op.chunk) else self._grads[(op.mb, op.chunk)]
        keep = isinstance(op, S.BackwardInput)  # the weight gradient will walk the graph again
        torch.autograd.backward(out, grad, inputs=inputs, retain_graph=keep)

    def _input_of(self, op) -> list[torch.Tensor]:
        return [] if self.stage.is_first(op.chunk) else [self._inputs[(op.mb, op.chunk)]]

    def _Backward(self, op):
        self._backward(op, None)
        self._release(op)

    def _BackwardInput(self, op):
        if not self.stage.is_first(op.chunk):  # the first stage's input is token ids: nothing to send
            self._backward(op, self._input_of(op))

    def _BackwardWeight(self, op):
        self._backward(op, [q for q in self.stage.model.parameters() if q.requires_grad])
        self._release(op)

    def _release(self, op) -> None:
        """After a micro-batch's backward: its output, the gradient received for it, and the
        send of that output — complete, since the next stage sent back the gradient: waiting
        on it returns at once. (gloo reports a send completed only when waited on, so
        `_free_sent_outputs` never sees one complete, and without this every output of the
        step would stay alive until its end.)"""
        key = (op.mb, op.chunk)
        for store in (self._outputs, self._grads):
            store.pop(key, None)
        work = self._output_sends.pop(key, None)
        if work is not None and any(w is work for w, _ in self._sends):
            work.wait()
            self._sends = [(w, out) for w, out in self._sends if w is not work]

    def _SyncGrads(self, op):
        pass  # the training step finishes the gradient sync (the buckets launched in the last backward)

    def _OptimizerStep(self, op):
        pass  # the training step clips and steps


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
