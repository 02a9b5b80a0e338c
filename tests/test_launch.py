import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshtrain.launch import (PEER_LOST_EXIT, LaunchError, choose_device, culprit, describe_exit, detect, first_host,
                              threads_per_rank)


def test_plain_shell_is_not_a_launcher():
    assert detect({}) is None


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.local_world_size, r.master_addr, r.master_port) == \
        ("torchrun", 3, 4, 1, 2, "node7", 1234)


def test_srun_environment_derives_rendezvous():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.local_world_size, r.master_addr) == \
        ("srun", 5, 8, 1, 4, "gpu03")
    assert 20000 <= r.master_port < 40000


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
])
def test_mpirun_environment(env):
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.master_addr) == ("mpirun", 2, 4, 2, "127.0.0.1")


@pytest.mark.parametrize("nodes, first", [("gpu[03-05,09],cpu1", "gpu03"), ("node12", "node12"),
                                          ("a[7]", "a7"), ("n[001-100]", "n001")])
def test_first_host(nodes, first):
    assert first_host(nodes) == first


def test_threads_per_rank_never_zero():
    assert threads_per_rank(10_000) == 1
    assert threads_per_rank(1) >= 1


def test_an_interactive_srun_shell_is_a_shell():
    """`srun --pty bash` gives one task: meshtrain started there starts its own ranks."""
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_STEP_NODELIST": "gpu03", "SLURM_JOB_ID": "7"}
    assert detect(env) is None


def test_multi_node_mpirun_without_master_addr_is_refused():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        detect(env)
    assert detect({**env, "MASTER_ADDR": "node0"}).master_addr == "node0"


@dataclass
class _Failure:
    exitcode: int
    timestamp: int


@pytest.mark.parametrize("failures, culprit_rank", [
    # rank 1 killed; the engine stopped rank 0 in the same second
    ({0: _Failure(-signal.SIGTERM, 100), 1: _Failure(-signal.SIGKILL, 100)}, 1),
    # rank 1 raised; rank 0's collective broke because of it
    ({0: _Failure(PEER_LOST_EXIT, 100), 1: _Failure(1, 100)}, 1),
    # only consequences seen: the first by the clock, then by rank
    ({2: _Failure(-signal.SIGTERM, 101), 3: _Failure(PEER_LOST_EXIT, 100)}, 3),
    ({0: _Failure(1, 100), 1: _Failure(1, 100)}, 0),
    # NCCL: rank 1 died; rank 0's watchdog aborted it when its collective timed out, later
    ({0: _Failure(-signal.SIGABRT, 160), 1: _Failure(-signal.SIGKILL, 100)}, 1),
    # a rank that aborts with nothing before it is the culprit
    ({0: _Failure(-signal.SIGTERM, 100), 1: _Failure(-signal.SIGABRT, 100)}, 1),
])
def test_the_culprit_is_not_a_rank_the_engine_or_a_peer_stopped(failures, culprit_rank):
    assert culprit(failures)[0] == culprit_rank


def test_exit_descriptions():
    assert describe_exit(-9) == "signal 9, SIGKILL"
    assert describe_exit(2) == "exit code 2"
    assert "another rank" in describe_exit(PEER_LOST_EXIT)


def test_device_choice_on_this_machine():
    import torch
    assert choose_device("cpu", 3, 4) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert choose_device("auto", 0, 2) == torch.device("cpu")
        with pytest.raises(LaunchError, match="no CUDA device"):
            choose_device("cuda", 0, 1)


@pytest.mark.parametrize("visible, narrowed, local_rank, local_world, expected", [
    (4, "", 2, 4, "cuda:2"),      # one GPU per local rank
    (1, "3", 2, 4, "cuda:0"),     # srun --gpus-per-task=1: each task sees its own, as cuda:0
    (2, "", 1, 4, None),          # more local ranks than GPUs: refused
    (1, "", 1, 2, None),          # one GPU shared by two ranks, nothing narrowed: refused
])
def test_local_rank_to_gpu(monkeypatch, visible, narrowed, local_rank, local_world, expected):
    """The mapping alone, with the GPU count set by hand (this machine may have none)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", narrowed)
    if expected is None:
        with pytest.raises(LaunchError, match="visible GPU"):
            choose_device("cuda", local_rank, local_world)
    else:
        assert choose_device("auto", local_rank, local_world) == torch.device(expected)


def _one_rank_stops_answering(mesh, seconds):
    """After the steady bound is set, rank 1 sleeps through a collective rank 0 waits in (on a
    channel of its own: a timed-out gloo group is closed for good)."""
    import time

    import torch

    from meshtrain.launch import is_peer_failure, set_collective_timeout
    mesh.open_channel("dp", "probe")
    set_collective_timeout(mesh, seconds)
    result = None
    if mesh.rank == 1:
        time.sleep(seconds + 2)
    else:
        start = time.perf_counter()
        try:
            torch.distributed.all_reduce(torch.ones(4), group=mesh.group("dp", "probe"))
        except RuntimeError as e:
            result = time.perf_counter() - start, is_peer_failure(e)
    set_collective_timeout(mesh, 300)  # for the shutdown's barrier
    return result


def test_the_collective_timeout_bounds_a_wait_on_every_mesh_group():
    """`--timeout S` (from the first step on): a collective whose peer stops answering fails
    after about S seconds, as a peer failure, instead of waiting the start's 300."""
    from distributed import run_ranks
    waited, peer_failure = run_ranks(_one_rank_stops_answering, 2, 3, timeout=60)[0]
    assert 2.5 < waited < 8 and peer_failure, waited


def test_the_pinned_torch_runs_forked_ranks():
    """meshtrain's launcher forks its ranks from a preloaded server where torch's engine runs
    function ranks through the wrapper `cli.forked_ranks` reads (torch 2.11 and up); the
    killed-rank and killed-launcher tests (test_cli, test_run_folder) run them."""
    from meshtrain.cli import forked_ranks
    assert forked_ranks.usable()


def test_the_fork_server_keeps_nothing_of_its_launcher_and_leaves_with_it(tmp_path):
    """The server is a fork of the launcher (it inherits torch), yet like a fresh interpreter
    it holds none of the launcher's files (an --out lock would outlive a killed launcher), runs
    none of its signal handlers, prints where the process's own streams go (not into the
    launcher's replacements of sys.stdout and sys.stderr: a notebook's, `redirect_stdout`'s),
    and leaves when the launcher has gone."""
    from helpers import is_running, parent_of, process_name

    from meshtrain.cli.forked_ranks import SERVER_NAME
    held = tmp_path / "held-by-the-launcher"
    script = ("import signal, sys\n"
              "held = open(sys.argv[1], 'w')\n"
              "signal.signal(signal.SIGTERM, lambda *a: None)\n"
              "import contextlib, io, multiprocessing\n"
              "from multiprocessing import forkserver\n"
              "from meshtrain.cli import forked_ranks\n"
              "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
              "    forked_ranks.start_server()\n"
              "print(forkserver._forkserver._forkserver_pid, flush=True)\n"
              "rank = multiprocessing.get_context('forkserver').Process(target=print, args=('a rank prints',),\n"
              "                                                         kwargs={'flush': True})\n"
              "rank.start()\n"
              "rank.join()\n"
              "print('joined', flush=True)\n"
              "sys.stdin.read()\n")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(held)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        server = int(launcher.stdout.readline())
        assert launcher.stdout.readline() == "a rank prints\n"  # before the launcher's "joined"
        assert parent_of(server) == launcher.pid
        deadline = time.time() + 60
        while process_name(server) != SERVER_NAME and time.time() < deadline:
            time.sleep(0.05)
        assert process_name(server) == SERVER_NAME
        files = {os.readlink(fd) for fd in Path(f"/proc/{server}/fd").iterdir() if fd.exists()}
        assert str(held) not in files and str(held) in {os.readlink(fd) for fd in
                                                         Path(f"/proc/{launcher.pid}/fd").iterdir()}
        caught = int(next(line for line in Path(f"/proc/{server}/status").read_text().splitlines()
                          if line.startswith("SigCgt:")).split()[1], 16)
        assert not caught & (1 << (signal.SIGTERM - 1))
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 60
        while is_running(server) and time.time() < deadline:
            time.sleep(0.1)
        assert not is_running(server), "the fork server outlived its launcher"
    finally:
        launcher.kill()


def test_the_fork_server_is_forked_before_the_launcher_asks_for_cuda(tmp_path):
    """A process that has asked the CUDA driver anything cannot give a forked child a working
    GPU: the launcher forks its ranks' server before `choose_device` asks (emulated here,
    with no GPU: the CUDA queries and the fork are logged in order; --out is held, so the
    launcher stops at its claim, after both)."""
    from meshtrain.checkpoint.lock import OutLock
    script = ("import sys, torch\n"
              "from meshtrain.cli import forked_ranks\n"
              "def logged(name, fn):\n"
              "    def call(*a, **k):\n"
              "        print(name, flush=True)\n"
              "        return fn(*a, **k)\n"
              "    return call\n"
              "torch.cuda.is_available = logged('cuda', torch.cuda.is_available)\n"
              "torch.cuda.device_count = logged('cuda', torch.cuda.device_count)\n"
              "forked_ranks.start_server = logged('fork', forked_ranks.start_server)\n"
              "from meshtrain.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    lock = OutLock(tmp_path, log=print).acquire()
    try:
        r = subprocess.run([sys.executable, "-c", script, "train", "--model", "gpt-test", "--vocab-size", "256",
                            "--seq-len", "32", "--batch-size", "8", "--device", "auto", "--dp", "2", "--steps", "1",
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    finally:
        lock.release()
    assert r.returncode == 2 and "in use by another meshtrain job" in r.stderr, r.stderr[-2000:]
    events = r.stdout.split()
    assert "fork" in events and "cuda" in events and events.index("fork") < events.index("cuda"), events


def test_a_rank_watching_a_process_gets_its_signal_when_it_ends():
    """`launch.die_with`: a forked rank is its server's child, so it watches the launcher."""
    script = ("import os, signal, sys, time\n"
              "from meshtrain.launch import die_with\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), os._exit(0)))\n"
              "die_with(int(sys.argv[1]), signal.SIGTERM)\n"
              "print('watching', flush=True)\n"
              "time.sleep(60)\n")
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([sys.executable, "-c", script, str(watched.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().strip() == "watching"
        watched.kill()
        watched.wait()
        started = time.time()
        assert watcher.stdout.readline().strip() == "got SIGTERM"
        assert time.time() - started < 5
    finally:
        watched.kill()
        watcher.kill()
