"""Per-step fault tolerance over replica groups, on torchft (`train --ft-replicas R`).

The world is R replica groups, each a whole layout (its own process group: dp, cp, tp, pp
and ZeRO inside it). Every rank of a group has a torchft `Manager`; the managers of the same
group rank in every group form torchft's cross-replica process group, which torchft rebuilds
for each quorum of live groups. Each step:

1. `begin_step` asks for the quorum (synchronously: a joining group heals before its forward,
   so it trains the very step it joined at). It returns this group's share of the step and
   the number of live groups: the step trains the rows of the live groups only.
2. The caller's backward leaves each rank with its group's gradient of the sum over the
   group's rows, divided by the count of loss terms of *all* live groups' rows;
   `sum_` adds them over the live groups (flat buckets, one torchft all-reduce each), so the
   gradient is the mean over the quorum's rows, as data parallelism's own sum makes it.
3. `commit` is torchft's vote (`should_commit`): False on every rank of every group when any
   all-reduce of the step failed or a group is short; the caller then skips the optimizer
   step, and the step is trained again with the quorum that follows.

A group that joins (a restart, or a replacement) receives the caller's state from a live
group of the quorum, rank by rank (`register_state`): torchft's checkpoint transport, HTTP.
What is healed is the caller's (`Job.replica_state`); this module holds what talks to
torchft, and the counts `--json`'s `ft` reports."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from meshtrain import faults

MISSING = "--ft-replicas needs torchft, which is not installed: pip install 'meshtrain[ft]'"
BUCKET_MB = 25.0  # like torch DDP's buckets: large enough to amortise a collective's latency
START_WAIT_S = 60.0  # at the run's start, how long the first quorum waits for every group to join


def quiet() -> None:
    """torchft's own logs at warning and above, none from its Python side (its managers log
    every quorum, and a peer's failure as a traceback; a run says what happened in one line)."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)  # a failed step is said by the run, in one line
    # torch.load of a received state warns that the HTTP buffer it wraps is read-only; the
    # state is copied into this rank's own tensors (`replica_state`).
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def available() -> bool:
    """Whether torchft can be imported (without importing it)."""
    return importlib.util.find_spec("torchft") is not None


REPLICA_ENV = faults.FT_REPLICA_ENV  # this group's index (meshtrain's launcher of the groups sets it)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for it


@dataclass(frozen=True)
class FtOptions:
    """One rank's view of the replica groups (`meshtrain.FaultTolerance`): R groups, this
    rank's group `replica_id` (default: the MESHTRAIN_FT_REPLICA variable), where the
    lighthouse listens (default: TORCHFT_LIGHTHOUSE), torchft's timeouts (collectives and the
    commit vote; the quorum) and the size of the gradient buckets summed over the groups."""
    replicas: int
    replica_id: int | None = None
    lighthouse: str | None = None
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    bucket_mb: float = BUCKET_MB

    def resolved(self) -> "FtOptions":
        """With the replica id and the lighthouse filled from the environment; one line when
        either is missing or out of range."""
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"FaultTolerance(replicas={self.replicas!r}): use the number of replica groups, ≥ 1")
        rid = self.replica_id
        if rid is None and os.environ.get(REPLICA_ENV):
            rid = int(os.environ[REPLICA_ENV])
        if rid is None or not 0 <= rid < self.replicas:
            raise ValueError(f"FaultTolerance: this group's replica_id is {rid!r}; give 0 to {self.replicas - 1} "
                             f"(replica_id=, or {REPLICA_ENV})")
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ValueError(f"FaultTolerance: no lighthouse; give lighthouse='http://HOST:PORT' or {LIGHTHOUSE_ENV} "
                             f"(start one: torchft_lighthouse --min_replicas 1)")
        if not available():
            raise ValueError(MISSING.replace("--ft-replicas", "FaultTolerance"))
        return FtOptions(self.replicas, rid, lighthouse, self.timeout_s, self.quorum_timeout_s, self.bucket_mb)


FaultTolerance = FtOptions  # the API's name: meshtrain.init(..., ft=meshtrain.FaultTolerance(replicas=R))


@dataclass
class FtCounts:
    """What the run saw, as the live quorum knows it (a healed group takes its peer's):
    `failures` (groups the quorum lost), `heals` (groups that joined behind and took a live
    peer's state), `uncommitted_steps` (steps trained and not committed)."""
    failures: int = 0
    heals: int = 0
    uncommitted_steps: int = 0

    def as_dict(self) -> dict:
        return {"failures": self.failures, "heals": self.heals, "uncommitted_steps": self.uncommitted_steps}


@dataclass
class StepQuorum:
    """The quorum a step trains with: this group's share index among the live groups, how
    many are live, and how long asking for it took (seconds; the stall after a failure).
    The step's batch is the live groups' rows; this group trains share (index, live) of it."""
    index: int
    live: int
    wait_s: float
    healed_s: float | None = None  # this group healed in it: seconds from asking to trained state

    @property
    def share(self) -> tuple[int, int]:
        return self.index, self.live


class ReplicaGroups:
    """This rank's torchft Manager and what a step asks of it. `group_rank`/`group_world`:
    this rank in its own group; `share_store(value)` returns group rank 0's `value` on every
    rank of the group (the address of the store torchft's managers meet at)."""

    def __init__(self, options: FtOptions, device: torch.device, group_rank: int, group_world: int,
                 share_store: Callable[[object], object]):
        quiet()
        from torchft import Manager
        from torchft.manager import WorldSizeMode

        self.options, self.device = options, device
        self.group_rank = group_rank
        self.counts = FtCounts()
        self._state_fn: Callable[[], dict] | None = None
        self._load_fn: Callable[[dict], None] | None = None
        self._healed_s: float | None = None
        self._asked_at = 0.0
        # A store of this attempt's own, hosted by group rank 0: torchrun's keeps the keys of a
        # failed attempt (the old manager's address) across restarts.
        self._store = None
        host, port = None, None
        if group_rank == 0:
            from torch.distributed import TCPStore
            host = _this_host()
            self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        host, port = share_store((host, port))
        timeout = timedelta(seconds=options.timeout_s)
        pg = _process_group(device, timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
            connect_timeout=timeout, rank=group_rank, world_size=group_world,
            world_size_mode=WorldSizeMode.DYNAMIC, store_addr=host, store_port=port,
            lighthouse_addr=options.lighthouse, replica_id=f"meshtrain_{options.replica_id}",
            init_sync=False)  # every group draws the same weights from the seed
        self._first = True
        self._members: set[str] | None = None  # the last quorum's groups (torchft's replica ids)
        _watch_quorums(self.manager, self._saw_quorum)
        _quiet_transport(self.manager)

    # ---- what a step asks -----------------------------------------------------------------

    def register_state(self, state: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """The caller's state (this rank's tensors, by position) and how to take a peer's."""
        self._state_fn, self._load_fn = state, load

    def set_step(self, step: int) -> None:
        """Steps already trained (a resumed run's checkpoint): the step the quorum starts at."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.options.replicas})

    @property
    def step(self) -> int:
        """Steps committed: the manager's, which a heal sets to the live peer's."""
        return self.manager.current_step()

    def begin_step(self) -> StepQuorum:
        """The quorum of live groups for the next step (a healing group takes a live peer's
        state in here). At the run's start it waits up to `START_WAIT_S` for every group, so
        that no group trains the first steps alone."""
        t0 = time.perf_counter()
        self._healed_s = None
        while True:
            self._asked_at = time.perf_counter()
            self.manager.start_quorum()
            live = self.manager.num_participants()
            if not (self._first and self._healed_s is None and live < self.options.replicas
                    and time.perf_counter() - t0 < START_WAIT_S):
                break
            time.sleep(0.2)
        self._first = False
        index = self.manager.participating_rank()
        return StepQuorum(index=index if index is not None else 0, live=live, wait_s=time.perf_counter() - t0,
                          healed_s=self._healed_s)

    def sum_(self, tensors: list[torch.Tensor], step: int) -> None:
        """Add `tensors` (this rank's, alike in shape on the same group rank of every group)
        over the live groups, in place: flat buckets per dtype, each one torchft all-reduce,
        all started before the first is waited on. A failed one is torchft's to report: the
        step is then not committed (`commit`), and the tensors hold anything."""
        if self.manager.num_participants() <= 1 or not tensors:
            return
        buckets = _buckets(tensors, int(self.options.bucket_mb * 2**20))
        flats = [torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1)
                 for bucket in buckets]
        from torch.distributed import ReduceOp
        works = []
        for flat in flats:
            works.append(self.manager.allreduce(flat, reduce_op=ReduceOp.SUM))
            if len(works) == 1 < len(flats) and faults.due("kill-in-allreduce", self.group_rank, step):
                works[0].wait()  # the tests' fault: a group dies with the first bucket summed, not the rest
                faults.inject("kill-in-allreduce", self.group_rank, step)
        for work in works:
            work.wait()
        for bucket, flat in zip(buckets, flats):
            if len(bucket) > 1 or flat.data_ptr() != bucket[0].data_ptr():  # a copy, not a view: back
                at = 0
                for t in bucket:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()

    def commit(self) -> bool:
        """torchft's vote: whether every rank of this group may step its optimizer (no
        all-reduce of the step failed anywhere, enough groups). Every rank calls it once a step."""
        ok = self.manager.should_commit()
        if not ok:
            self.counts.uncommitted_steps += 1
        return ok

    def report(self) -> dict:
        """`--json`'s `ft`."""
        return {"replicas": self.options.replicas, **self.counts.as_dict()}

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _saw_quorum(self, members: list[str], step: int) -> None:
        """Each quorum's groups, on torchft's quorum thread (before it sends a joining group
        this group's state, counts included): a group that left is a failure, one that joined
        after the first step a heal (a restarted group joins under a new id)."""
        now = set(members)
        if self._members is not None:
            self.counts.failures += len(self._members - now)
            if step > 0:
                self.counts.heals += len(now - self._members)
        self._members = now

    # ---- healing ----------------------------------------------------------------------------

    def _state(self) -> dict:
        """What a live group sends a joining one (torchft's callback, on its quorum thread,
        while this group's ranks wait for the quorum: the state does not move meanwhile)."""
        return {"caller": self._state_fn() if self._state_fn else {}, "counts": self.counts.as_dict()}

    def _load(self, state: dict) -> None:
        """A live peer's state, applied on the main thread before this group's forward; its
        counts are the run's (they hold this group's own heal)."""
        if self._load_fn is not None:
            self._load_fn(state["caller"])
        self.counts = FtCounts(**state["counts"])
        self._healed_s = time.perf_counter() - self._asked_at


class _WatchedClient:
    """torchft's manager client, with each quorum's result shown to `saw` on the way."""

    def __init__(self, client, saw: Callable[[list[str], int], None]):
        self._client, self._saw = client, saw

    def _quorum(self, *args, **kwargs):
        result = self._client._quorum(*args, **kwargs)
        self._saw(list(result.replica_ids), result.max_step)
        return result

    def __getattr__(self, name):
        return getattr(self._client, name)


def _watch_quorums(manager, saw: Callable[[list[str], int], None]) -> None:
    """Show each quorum's members to `saw` (torchft 0.2's manager keeps its client as
    `_client`; without it the counts stay 0 and training is unchanged)."""
    client = getattr(manager, "_client", None)
    if client is not None and hasattr(client, "_quorum"):
        manager._client = _WatchedClient(client, saw)


def _quiet_transport(manager) -> None:
    """torchft's checkpoint server logs each request to stderr (http.server's default)."""
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_message = lambda *args, **kwargs: None


def _process_group(device: torch.device, timeout: timedelta):
    """torchft's reconfigurable process group for the device: NCCL on CUDA, gloo otherwise."""
    import torchft
    if device.type == "cuda":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    return torchft.ProcessGroupGloo(timeout=timeout)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to `limit` bytes a bucket."""
    from meshtrain.parallel.state import runs_of
    runs = runs_of([((t.dtype, t.device), t.numel() * t.element_size()) for t in tensors], limit)
    return [[tensors[i] for i in run] for run in runs]


def _this_host() -> str:
    """The address the group's other ranks reach group rank 0 at: the rendezvous host when
    it is this one's (one node), else this host's name."""
    master = os.environ.get("MASTER_ADDR")
    return master if master in ("127.0.0.1", "localhost") else socket.gethostname()
