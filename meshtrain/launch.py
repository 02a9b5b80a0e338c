"""Processes. Start the local ranks through torchrun's engine (`torch.distributed.launcher`,
with its failure handling), or join the ranks that torchrun, srun or mpirun started; set up
`torch.distributed`; and shut a rank down deliberately.

Why `finish` ends with `os._exit`: with this torch build 10-20% of gloo processes crash in
interpreter teardown after `destroy_process_group`, although their work is done. A rank
flushes its output and leaves without teardown, so no run and no test is ever flaky."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from meshtrain.faults import RESTART_ENV

# A collective that waits longer than this ends the job with an error instead of hanging
# (`--timeout` shortens it once the first step is done: `set_collective_timeout`).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# A rank leaves with this code when a collective failed because another rank died: the parent
# then names the rank that really failed, not this one.
PEER_LOST_EXIT = 86
PEER_LOST_GRACE_S = 2.0  # `finish`
# meshtrain's launcher names itself to its ranks, which end when it dies (`die_with_launcher`).
LAUNCHER_PID_ENV = "MESHTRAIN_LAUNCHER_PID"
_AT_FINISH: list = []
_FINISH_CODE: list = []
_FORKED = False  # `forked_from_a_server`


class LaunchError(ValueError):
    """Processes or devices that cannot work as asked; the message is one line naming the fix."""


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits, as the launcher that started it tells."""
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[03-05,09],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def detect(env=os.environ) -> RankEnv | None:
    """The launcher this process runs under, or None when run from a plain shell.
    torchrun sets RANK/WORLD_SIZE/MASTER_*; srun and mpirun set their own variables, from
    which rank, world size and the rendezvous address are derived. Raises LaunchError for
    a multi-node mpirun with no MASTER_ADDR (every rank would wait for itself)."""
    def num(name, default=None):
        return int(env[name]) if name in env else default

    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        ws = num("WORLD_SIZE")
        return RankEnv("torchrun", num("RANK"), ws, num("LOCAL_RANK", 0), num("LOCAL_WORLD_SIZE", ws),
                       env["MASTER_ADDR"], num("MASTER_PORT", 29500))
    # Inside an srun step of several tasks. A step of one task is an interactive shell
    # (`srun --pty bash`): there meshtrain starts its own ranks, as from any shell.
    if "SLURM_PROCID" in env and num("SLURM_STEP_NUM_TASKS", 1) > 1:
        ws = num("SLURM_STEP_NUM_TASKS")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        per_node = ws // max(1, num("SLURM_STEP_NUM_NODES", 1))
        port = num("MASTER_PORT", 20000 + num("SLURM_JOB_ID", 0) % 20000)
        return RankEnv("srun", num("SLURM_PROCID"), ws, num("SLURM_LOCALID", 0), per_node,
                       env.get("MASTER_ADDR", first_host(nodes)), port)
    for rank_var, size_var, local_var, local_size_var in [
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")]:
        if rank_var in env and size_var in env:  # mpirun: one node unless MASTER_ADDR says otherwise
            ws, local_ws = num(size_var), num(local_size_var, num(size_var))
            if local_ws < ws and "MASTER_ADDR" not in env:
                raise LaunchError(f"mpirun started {ws} ranks on several nodes ({local_ws} on this one) but "
                                  f"MASTER_ADDR is not set; export MASTER_ADDR=<first node> and pass it "
                                  f"on (mpirun -x MASTER_ADDR)")
            return RankEnv("mpirun", num(rank_var), ws, num(local_var, 0), local_ws,
                           env.get("MASTER_ADDR", "127.0.0.1"), num("MASTER_PORT", 29500))
    return None


# The ranks that share this host when more than one launch starts them (meshtrain's replica
# groups from a shell: R launches of the layout's ranks), set by the launcher of those launches.
HOST_RANKS_ENV = "MESHTRAIN_HOST_RANKS"


def threads_per_rank(local_world_size: int) -> int:
    """Ranks that share a small CPU get one thread each instead of fighting over all cores."""
    sharing = max(local_world_size, int(os.environ.get(HOST_RANKS_ENV, 0) or 0))
    return max(1, (os.cpu_count() or 1) // max(1, sharing))


def spawn(nproc: int, argv: list[str], *, max_restarts: int = 0, restart_point=None, clean_stop=None,
          rank_function=None) -> int:
    """Run `python -m meshtrain ARGV` as `nproc` local ranks under torchrun's engine and
    return the job's exit code; with `rank_function`, each rank runs `rank_function(ARGV,
    this process's environment)` instead, forked from multiprocessing's fork server
    (`cli.forked_ranks`, started beforehand). If any rank fails, the engine stops the others; then, up to
    `max_restarts` times, all ranks start again (with RESTART_ENV set, so they resume from
    the latest good checkpoint), one line each saying which rank failed, why, and from where
    they resume (`restart_point()`). A refusal (exit code 2) is not retried: it would repeat.
    A SIGTERM to this process reaches the ranks too (the engine stops them with it, after a grace
    period); when `clean_stop(since)` says they all saved and stopped after `since`, the job
    exits 0, as its ranks do."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    for engine in ("torch.distributed", "torch.multiprocessing"):  # we report failures ourselves
        logging.getLogger(engine).setLevel(logging.CRITICAL)
    before = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # for the ranks only: put back below
    try:
        return _run_attempts(nproc, argv, max_restarts, restart_point, clean_stop, rank_function)
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = before


def _run_attempts(nproc: int, argv: list[str], max_restarts: int, restart_point, clean_stop, rank_function) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for attempt in range(max_restarts + 1):
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                              run_id=f"meshtrain-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                              rdzv_endpoint="localhost:0", max_restarts=0,
                              start_method="forkserver" if rank_function else "spawn")
        since = time.time()
        try:
            if rank_function:  # the environment of this attempt (RESTART_ENV)
                elastic_launch(config, rank_function)(argv, dict(os.environ))
            else:
                elastic_launch(config, sys.executable)("-m", "meshtrain", *argv)
            return 0
        except ChildFailedError as e:
            rank, failure = culprit(e.failures)
            code = failure.exitcode if failure.exitcode > 0 else 1
            why = f"rank {rank} failed ({describe_exit(failure.exitcode)})"
            if attempt == max_restarts or code == 2:
                print(f"meshtrain: {why}; the other ranks were stopped", file=sys.stderr)
                return code
            where = restart_point() if restart_point else "the start"
            print(f"meshtrain: {why}; restart {attempt + 1} of {max_restarts}, from {where}", file=sys.stderr,
                  flush=True)
            os.environ[RESTART_ENV] = str(attempt + 1)
        except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: the engine stopped the ranks
            if clean_stop and e.sigval == signal.SIGTERM and clean_stop(since):
                return 0  # rank 0 said where it saved
            print(f"meshtrain: stopped by {e.sigval.name}; all ranks were stopped", file=sys.stderr)
            return 128 + int(e.sigval)
    return 1


def culprit(failures: dict):
    """The (rank, failure) that ended the job. When one rank dies, the engine stops the others
    with SIGTERM and a survivor whose collective broke leaves with PEER_LOST_EXIT; their
    timestamps (one-second resolution) can equal the culprit's. On NCCL a survivor whose
    collective timed out is aborted by the watchdog (SIGABRT), after the dead peer. So a
    failure of none of those kinds comes first, then a SIGABRT (a real abort has nothing
    before it), then the others; among equals the earliest, then the lowest rank."""
    def caused_by_another(f) -> int:
        if f.exitcode in (-signal.SIGTERM, PEER_LOST_EXIT):
            return 2
        return 1 if f.exitcode == -signal.SIGABRT else 0

    return min(failures.items(), key=lambda kv: (caused_by_another(kv[1]), kv[1].timestamp, kv[0]))


def describe_exit(exitcode: int) -> str:
    if exitcode == PEER_LOST_EXIT:
        return "a collective failed: another rank died or stopped answering"
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {-exitcode}, {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def is_peer_failure(exc: BaseException) -> bool:
    """A collective that failed because another rank died or hung (its own report says why)."""
    import torch.distributed as dist
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistBackendError", ())) or (
        isinstance(exc, RuntimeError) and any(s in text for s in (
            "Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out")))


def choose_device(request: str, local_rank: int, local_world_size: int):
    """The device of a rank: `cpu`, or a GPU of its own. `auto` means CUDA when present.
    With a GPU per local rank, rank i takes cuda:i; a scheduler that narrows
    CUDA_VISIBLE_DEVICES to one GPU per task (srun --gpus-per-task=1) leaves cuda:0."""
    import torch

    if request == "cpu" or (request == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError("--device cuda: no CUDA device is visible here; use --device cpu or auto")
    visible = torch.cuda.device_count()
    if visible >= local_world_size:
        return torch.device("cuda", local_rank)
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if visible == 1 and narrowed and "," not in narrowed:
        return torch.device("cuda", 0)
    raise LaunchError(f"{local_world_size} local ranks but {visible} visible GPU(s); start at most {visible} "
                      f"ranks per node, give each task its own GPU (srun --gpus-per-task=1), or use --device cpu")


def init_distributed(renv: RankEnv, device, *, timeout_s: float | None = None, trace_dir: str | None = None):
    """Join the process group on `device` (gloo on CPU, NCCL on CUDA), its collectives bound
    by `timeout_s` (default `COLLECTIVE_TIMEOUT`). On NCCL the flight recorder is on (unless
    the environment says otherwise): on a timeout each rank dumps its last collectives to
    `trace_dir`/nccl-flight-recorder-rank-N, which names the one that did not match."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=renv.master_addr, MASTER_PORT=str(renv.master_port),
                      RANK=str(renv.rank), WORLD_SIZE=str(renv.world_size))
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend, options["device_id"] = "nccl", device
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if trace_dir:
            prefix = os.path.join(os.path.abspath(trace_dir), "nccl-flight-recorder-rank-")
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", prefix)
            os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)  # its name before torch 2.6
    else:
        torch.set_num_threads(threads_per_rank(renv.local_world_size))
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s) if timeout_s else COLLECTIVE_TIMEOUT
    prefix = restart_store_prefix(renv)
    if prefix is None:
        dist.init_process_group(backend, init_method="env://", rank=renv.rank, world_size=renv.world_size,
                                timeout=timeout, **options)
    else:
        store = dist.TCPStore(renv.master_addr, renv.master_port, renv.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=renv.rank,
                                world_size=renv.world_size, timeout=timeout, **options)
    return device


def restart_store_prefix(renv: RankEnv, env=os.environ) -> str | None:
    """The key prefix that keeps a torchrun restart's ranks off the addresses the previous
    attempt left in the store, or None where there is nothing to keep apart.

    torchrun shares its own store with the workers (`TORCHELASTIC_USE_AGENT_STORE`, the
    default since torch 2.5) and keeps it across restarts, so the keys every rank writes to
    join the group outlive the attempt that wrote them: a restarted rank can read a dead
    peer's address before the peer's new self writes it, and gloo's connect is refused
    (NCCL's reads an old unique id: pytorch/pytorch#135712, #167288). On one node all ranks
    count the same restarts (one agent), so the restart count names the attempt. Across
    nodes the agents count apart (the one that failed counts, the others do not), so no
    prefix is safe: the rank-0 warning of `cross_node_restart_warning` says what to set."""
    attempt = _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    if not _in_torchruns_store(renv, env) or attempt == 0 or _env_int(env, "GROUP_WORLD_SIZE", 1) > 1:
        return None
    return f"meshtrain/attempt-{attempt}"


def cross_node_restart_warning(renv: RankEnv | None, env=os.environ) -> str | None:
    """What to tell a user whose torchrun restarts workers on several nodes through the store it
    shares with them (see `restart_store_prefix`), or None."""
    if (not _in_torchruns_store(renv, env) or _env_int(env, "TORCHELASTIC_MAX_RESTARTS", 0) == 0
            or _env_int(env, "GROUP_WORLD_SIZE", 1) < 2):
        return None
    return ("torchrun restarts workers on several nodes through the store it shares with them, which keeps the "
            "previous attempt's addresses (pytorch/pytorch#135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "before torchrun on every node")


def _in_torchruns_store(renv: RankEnv | None, env) -> bool:
    """A rank of torchrun whose agent shares its store with the workers."""
    return renv is not None and renv.launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _env_int(env, name: str, default: int) -> int:
    return int(env.get(name) or default)


def set_collective_timeout(mesh, seconds: float) -> None:
    """Bound every collective of this rank's groups (the world's, each mesh axis's, and its
    channels) by `seconds` from now on. Collective in effect only: each rank sets its own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    for group in [None, *mesh.groups()]:
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def shutdown_distributed() -> None:
    """Leave the process group once every rank has finished its collectives."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def let_collective_threads_finish() -> None:
    """At a user's process exit (the API's processes end through interpreter teardown, not
    `finish`): give gloo's worker threads a moment to drop the work of the last
    asynchronous collective. A worker that releases it — and with it a Python tensor, which
    needs the GIL — once finalization has begun is ended by the interpreter mid-destructor,
    and the process aborts ("terminate called without an active exception"; 3 of 36
    two-rank torchrun runs of an example before this, none of 30 after). Sleeping here releases the GIL while the interpreter
    is still whole."""
    import time
    time.sleep(0.05)


def die_with_launcher() -> None:
    """A rank of meshtrain's launcher ends when the launcher dies, however it dies (`kill -9`
    included): SIGTERM, not SIGKILL: with --save-every the ranks save the step they are in
    and stop, as after a scheduler's preemption. A rank forked from the launcher's fork server
    (`forked_ranks`) is the server's child, not the launcher's: it watches the launcher."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, 0))
    if _FORKED:
        die_with(launcher, signal.SIGTERM)
    else:
        die_with_parent(launcher, signal.SIGTERM)


def die_with(pid: int, sig: int) -> None:
    """This process gets `sig` when process `pid` (not its parent) ends: a thread waits on
    the process's descriptor (Linux 5.3+), elsewhere polls for it."""
    def watch() -> None:
        try:
            import select
            fd = os.pidfd_open(pid)
            select.select([fd], [], [])
        except ProcessLookupError:
            pass  # already gone
        except (AttributeError, OSError):
            while _is_alive(pid):
                time.sleep(1.0)
        os.kill(os.getpid(), sig)
    import threading
    threading.Thread(target=watch, name="meshtrain-launcher-watch", daemon=True).start()


def kill_descendants(sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process started under this one, however deep (its ranks, their
    fork server): from /proc's parent links (Linux; elsewhere nothing is found)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    todo, found = [os.getpid()], []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def name_this_rank(rank: int) -> None:
    """`ps`, `top` and /proc show `meshtrain rN` for a rank meshtrain's launcher started (a
    forked rank would show its fork server's command line otherwise)."""
    name_this_process(f"meshtrain r{rank}")


def name_this_process(name: str) -> None:
    """The name `ps -o comm`, `top` and /proc/PID/stat show (Linux; 15 bytes at most)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def forked_from_a_server() -> None:
    """This rank was forked from the launcher's fork server, not started by the launcher."""
    global _FORKED
    _FORKED = True


def die_with_parent(parent: int, sig: int) -> None:
    """This process gets `sig` when its parent `parent` dies, however it dies: Linux's
    parent-death signal, elsewhere a thread watching the parent (`die_with`)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        die_with(parent, sig)
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), sig)


def at_finish(callback) -> None:
    """Run `callback` when `finish` ends this process (it skips interpreter teardown)."""
    _AT_FINISH.append(callback)


def on_finish_code(callback) -> None:
    """Give `finish`'s exit code to `callback` before the process ends (a forked rank hands
    it to the engine: `forked_ranks`)."""
    _FINISH_CODE.append(callback)


def finish(code: int = 0):
    """End this process now: flush what it printed, skip interpreter teardown (see above).
    A forked rank whose collective failed because a peer died leaves `PEER_LOST_GRACE_S`
    later: the engine reports only the first failed function rank its poll meets (every
    0.1 s), which must be the rank that died, not this survivor (`culprit`)."""
    if code == PEER_LOST_EXIT and _FORKED:
        time.sleep(PEER_LOST_GRACE_S)
    for callback in _AT_FINISH:
        callback()
    sys.stdout.flush()
    sys.stderr.flush()
    for callback in _FINISH_CODE:
        callback(code)
    os._exit(code)
