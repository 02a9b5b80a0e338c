"""Asynchronous saves (`--async-save`, `job.save(..., background=True)`): the step blocks only
while this rank's boxes are copied aside (`Stager`: one host arena per rank, pinned when the
boxes are on a GPU, kept and reused save after save); a thread writes the copy through DCP on a gloo
process group of its own and then commits it collectively over that group exactly as a
synchronous save does (`folders.write`: every rank's files synced, the checksums and
`COMPLETE` written, the folder renamed; then the caller's prune). A checkpoint is therefore
marked complete only after every rank's bytes are on disk, and a kill at any moment leaves
the previous checkpoint good.

Why a group of its own: training goes on over the default group while the thread's
collectives run, and one group's collectives must come in one order from one thread; gloo
because the thread moves host memory (on GPUs too, where the default group is NCCL). Why not
DCP's own `async_save`: its default stager copies plain tensors, not meshtrain's `Boxed`
entries, and its commit (DCP's `.metadata`) is not ours (`COMPLETE` after every rank wrote)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from meshtrain.checkpoint import folders
from meshtrain.checkpoint.boxes import Box
from meshtrain.checkpoint.dcp import Boxed
from meshtrain.checkpoint.sharded import Snapshot, write_snapshot
from meshtrain.comm import broadcast_from_rank_0, gather_to_rank_0


class SideComm:
    """What `folders.write`, `folders.prune` and DCP need of a communicator, on a gloo group of
    every rank that only the save thread uses: `mesh` (this rank), `gather_object` and
    `broadcast_object` (as `Comm`'s, over this group)."""

    def __init__(self, mesh):
        self.mesh = mesh
        distributed = mesh.world_size > 1 and dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None  # collective: every rank

    def gather_object(self, obj) -> list | None:
        return [obj] if self.group is None else gather_to_rank_0(obj, self.group, torch.device("cpu"))

    def broadcast_object(self, obj):
        return obj if self.group is None else broadcast_from_rank_0(obj, self.group, torch.device("cpu"))


class Stager:
    """Host copies of a snapshot's boxes, kept from save to save, in one arena per rank: one
    allocation sized to every box this rank holds (its share of the weights and optimizer
    state, each box at a 64-byte-aligned offset), pinned when the boxes are on a GPU (so the
    copy runs at the link's speed; `pin=False`: pageable). One buffer per box would pin a
    block per box and keep them all, each rounded up by the caching host allocator (to a
    power of two); the arena is allocated again only when the state's boxes change."""

    ALIGN = 64  # bytes: every dtype's alignment, and a cache line

    def __init__(self, pin: bool | None = None):
        self.pin = pin  # None: pinned when the boxes are on an accelerator
        self._arena: torch.Tensor | None = None
        self._layout: dict[tuple[str, tuple[int, ...]], tuple[int, torch.Size, torch.dtype]] = {}
        self.allocations = 0  # arenas allocated so far (one, while the state's boxes stay the same)

    @property
    def bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    def stage(self, state: dict[str, Boxed]) -> dict[str, Boxed]:
        """`state` with each box's view replaced by its copy in the arena, made now."""
        self._fit(state)
        out, devices = {}, set()
        for fqn, entry in state.items():
            staged = []
            for b in entry.boxes:
                buf = self._view((fqn, b.offsets))
                buf.copy_(b.view, non_blocking=True)
                devices.add(b.view.device.type)
                staged.append(Box(b.offsets, b.sizes, buf))
            out[fqn] = Boxed(entry.shape, entry.dtype, staged)
        if devices - {"cpu"}:
            torch.accelerator.synchronize()  # the copies are on the host before the thread reads them
        return out

    def _fit(self, state: dict[str, Boxed]) -> None:
        """Lay the boxes out in the arena; allocate it again only when they changed."""
        layout, at, on_device = {}, 0, False
        for fqn, entry in state.items():
            for b in entry.boxes:
                layout[(fqn, b.offsets)] = (at, b.view.shape, b.view.dtype)
                at += -(-b.view.numel() * b.view.element_size() // self.ALIGN) * self.ALIGN
                on_device |= b.view.device.type != "cpu"
        if layout == self._layout and self._arena is not None:
            return
        self._arena = None  # the old one goes first: never two arenas at once
        pin = on_device if self.pin is None else self.pin
        self._arena = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
        self._layout = layout
        self.allocations += 1

    def _view(self, key) -> torch.Tensor:
        at, shape, dtype = self._layout[key]
        n = shape.numel() * dtype.itemsize
        return self._arena[at:at + n].view(dtype).view(shape)


class BackgroundSaver:
    """One save in flight at a time: `save` waits for the previous one, stages, and returns;
    `wait` joins the one in flight and raises its failure (on every rank alike: the commit
    decides collectively)."""

    def __init__(self, comm, pin: bool | None = None):
        self.comm = comm
        self.stager = Stager(pin)
        self._side: SideComm | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: dict = {}  # the figures of the last save: blocked_s, staged_bytes, written_s

    def save(self, snap: Snapshot, final: Path, files=(), then: Callable[[SideComm], None] | None = None) -> float:
        """Collective: stage `snap` (a snapshot of this rank's state, taken by the caller) and
        write it into `final` in the background, then run `then(side_comm)` there (a prune);
        returns the seconds this call blocked (the wait for the previous save included)."""
        t0 = time.perf_counter()
        self.wait()
        if self._side is None:
            self._side = SideComm(self.comm.mesh)
        side = self._side
        staged = Snapshot(self.stager.stage(snap.state), snap.body)
        blocked = time.perf_counter() - t0
        self.last = {"blocked_s": blocked, "staged_bytes": self.stager.bytes}

        def write() -> None:
            t1 = time.perf_counter()
            try:
                folders.write(Path(final), side, lambda tmp: write_snapshot(staged, tmp, side, files, side.group))
                if then is not None:
                    then(side)
                self.last["written_s"] = time.perf_counter() - t1
            except BaseException as e:  # raised by `wait`, on the training thread
                self._error = e

        self._thread = threading.Thread(target=write, name=f"meshtrain-save-{Path(final).name}", daemon=True)
        self._thread.start()
        return blocked

    def wait(self) -> None:
        """Until the save in flight is written and committed on every rank."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
