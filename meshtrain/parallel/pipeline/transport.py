"""How a pipeline stage issues its groups of transfers, under the rules the simulator proves
(`simulate.py`): each group is one `batch_isend_irecv`; groups queue in issue order (NCCL's
one stream for every peer); a group with a receive is waited for before the next compute,
and waiting for it waits for every group issued before it, in order; a group of sends only
is left to complete while the stage computes on; the step waits for the whole queue.

The strict mode (`MESHTRAIN_STRICT_P2P=1`) makes gloo refuse what NCCL would hang on. gloo
buffers small sends, matches by tag and does not care which call a transfer came in, so a
schedule that jams on NCCL runs there. Under the strict mode:

- tags are 0, so gloo matches messages between two stages by order alone, as NCCL does;
- when a group becomes current (every group before it has completed), a token naming
  each of its receives goes to the sender, on a gloo group of its own;
- a send completes only once its receiver's token has arrived and names the same message.
  All of a group's tokens go out before it waits on any, and every wait is bounded
  (`STRICT_TIMEOUT_S`): a schedule that would hang on NCCL stops with one line naming the
  stage and the transfer.

(What a one-GPU machine cannot show — NCCL itself across GPUs — this emulates on CPU.)"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from meshtrain.comm import Comm

STRICT_TIMEOUT_S = 10.0


class StrictP2PError(RuntimeError):
    """A transfer that would hang (or pair with the wrong message) on NCCL."""


@dataclass
class Transfer:
    """One send or receive of a group: `key` names the message the same way at both ends
    (kind, micro-batch, the receiver's chunk); `what` is the instruction, for messages."""
    send: bool
    tensor: torch.Tensor
    offset: int
    key: tuple[int, int, int]
    tag: int
    what: object


@dataclass
class _Group:
    transfers: list[Transfer]
    works: list
    on_done: Callable[[], None] | None


class Transport:
    """A stage's queue of transfer groups along `axis`. Collective to build (every rank of
    the world: the strict mode makes a gloo group for its tokens)."""

    def __init__(self, comm: Comm, axis: str, *, strict: bool = False, timeout_s: float = STRICT_TIMEOUT_S):
        self.comm, self.axis, self.strict, self.timeout_s = comm, axis, strict, timeout_s
        comm.prepare_p2p(axis)
        self._tokens = None
        if strict:
            comm.mesh.open_channel(axis, "strict-p2p-tokens", backend="gloo")
            self._tokens = comm.mesh.group(axis, "strict-p2p-tokens")
        self._queue: list[_Group] = []
        self._token_sends: list = []  # the strict mode's tokens in flight (kept until the queue is empty)

    @property
    def stage(self) -> int:
        return self.comm.mesh.coord(self.axis)

    def issue(self, transfers: list[Transfer], on_done: Callable[[], None] | None = None) -> None:
        """Issue one group; when it has a receive, return only once it has completed (with
        every group before it). `on_done` runs when the group has completed."""
        ops = [(t.send, t.tensor, t.offset, 0 if self.strict else t.tag) for t in transfers]
        self._queue.append(_Group(transfers, self.comm.exchange(ops, self.axis), on_done))
        if any(not t.send for t in transfers):
            self.drain()

    def drain(self) -> None:
        """Wait for every group issued, in issue order."""
        while self._queue:
            group = self._queue[0]
            if self.strict:
                self._handshake(group.transfers)
            for work, transfer in zip(group.works, group.transfers):
                self._wait(work, transfer, "to complete the transfer")
            self._queue.pop(0)
            if group.on_done is not None:
                group.on_done()
        for work in self._token_sends:
            work.wait()
        self._token_sends.clear()

    def abandon(self) -> None:
        """Forget what is queued (a step that failed half-way)."""
        self._queue.clear()
        self._token_sends.clear()

    # ---- the strict mode ------------------------------------------------------------------

    def _handshake(self, transfers: list[Transfer]) -> None:
        """The group is current: tell each sender which receive is posted, then take each
        receiver's word for every send before it may complete."""
        mesh = self.comm.mesh
        for t in transfers:
            if not t.send:
                token = torch.tensor(t.key, dtype=torch.int64)
                self._token_sends.append(torch.distributed.isend(token, mesh.neighbour(self.axis, t.offset),
                                                                 group=self._tokens))
        for t in transfers:
            if t.send:
                token = torch.empty(3, dtype=torch.int64)
                work = torch.distributed.irecv(token, mesh.neighbour(self.axis, t.offset), group=self._tokens)
                self._wait(work, t, "to post its receive")
                if tuple(token.tolist()) != t.key:
                    raise StrictP2PError(f"strict p2p: stage {self.stage} sends {t.what} but stage "
                                         f"{self.stage + t.offset}'s next receive from it is {_name(token.tolist())} "
                                         f"(NCCL matches by order, not tag)")

    def _wait(self, work, t: Transfer, what: str) -> None:
        if not self.strict:
            work.wait()
            return
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            peer = self.stage + t.offset
            raise StrictP2PError(f"strict p2p: stage {self.stage} waited {self.timeout_s:g} s at {t.what} for stage "
                                 f"{peer} {what}: on NCCL this would hang") from None


KINDS = ("activation", "gradient")


def _name(key: list[int]) -> str:
    kind, mb, chunk = key
    return f"the {KINDS[kind]} of micro-batch {mb}, chunk {chunk}"
