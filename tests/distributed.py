"""Run a function on N real processes joined in a gloo process group, from pytest.

Each rank builds the mesh, calls `fn(mesh, *args)` and saves what it returns; the parent
collects the results in rank order. A free port is picked per attempt, and the attempt is
retried if another process took the port first.

Ranks start from a fork server that imported torch and meshtrain once (`_context`): a
fresh interpreter spends ~2 s of CPU importing them, per rank, and the suite starts
hundreds of ranks. The server is a process of its own that has only imported (nothing a
test did in pytest's process reaches it), so the ranks are as isolated as spawned ones: the
parent's patches never reach them, and each test's mutants patch inside its ranks. The
command-line tests' `train`, `verify` and `bench` are forked from it too (`run_command`):
a process of its own, with its own exit code, output, signals and ranks, that skips the
interpreter's start; and so are the example scripts' ranks (`run_script_ranks`), given the
environment torchrun gives its ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ATTEMPTS = 3
# What the fork server imports once for every rank it forks: this module, for `_rank_main`;
# torch._dynamo, which a torch optimizer's first construction imports (~2 s); and what ranks
# import again and again otherwise (the suite's profile, issue 48): pytest, which every test
# module a rank function lives in imports (0.1 s per rank, ~80 s over the suite); the digits'
# sklearn (1.5 s per rank); what `compile=True` imports at its first graph (1.4 s per rank);
# the tokenizer and transformers of the Hugging Face tests; the tests' presets (presets.py);
# matplotlib, which every forked `train` command's rank 0 imports for its loss curve (0.7 s);
# and what torch imports on first use in a rank: at the first torch.save/load (all_gather_object
# is one), the first optimizer step (the profiler's hook), and dynamo's first graphs (sympy's
# tensors, DTensor's experimental ops).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshtrain.launch", "meshtrain.mesh", "meshtrain.train",
           "meshtrain.verifier", "meshtrain.bench", "distributed", "presets", "pytest", "sklearn.datasets",
           "torch._functorch.aot_autograd", "torch._inductor.pattern_matcher", "tokenizers", "transformers",
           "matplotlib.pyplot", "torch.utils.serialization.config", "torch.profiler._cupti_monitor",
           "sympy.tensor.tensor", "torch.distributed.tensor.experimental"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first rank)
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, sizes, out_dir, args):
    code = 0
    try:
        from meshtrain.launch import RankEnv, init_distributed, shutdown_distributed
        from meshtrain.mesh import Mesh

        env = RankEnv("test", rank, world, rank, world, "127.0.0.1", port)
        device = init_distributed(env, torch.device("cpu"), timeout_s=sizes.get("collective_timeout"))  # CPU, gloo
        torch.set_num_threads(1)
        mesh = Mesh.build(sizes["pp"], sizes["dp"], sizes["tp"], device, cp=sizes["cp"], ep=sizes.get("ep", 1))
        result = fn(mesh, *args)
        save_result(result, Path(out_dir, f"rank{rank}.pt"))
        shutdown_distributed()
    except BaseException:  # report, then leave with a code the parent can read
        text = traceback.format_exc()
        Path(out_dir, f"rank{rank}.err").write_text(text)
        code = 3 if "EADDRINUSE" in text or "address already in use" in text.lower() else 1
        print(text, file=sys.stderr)
    from meshtrain.launch import finish
    finish(code)


class _Bytes:
    """A plain CPU tensor pickled as one buffer of its bytes. torch.save writes a zip entry per
    storage, and a verify record holds thousands of small tensors: saving and loading one
    took 0.33 s this way against 0.06 s (the suite's profile, issue 48)."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def __reduce__(self):
        return _tensor_of, (str(self.dtype).removeprefix("torch."), self.shape, self.data)


def _tensor_of(dtype: str, shape: tuple, data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def _packed(x):
    """`x` with every plain tensor in its dicts, lists and tuples as `_Bytes` (others kept:
    a parameter, a tensor needing grad, one off the CPU, pickle as torch pickles them)."""
    if type(x) is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided and not x.requires_grad \
            and not x.is_quantized and not x.is_conj() and not x.is_neg():
        return _Bytes(x)
    if type(x) is dict:
        return {k: _packed(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_packed(v) for v in x)
    return x


def save_result(result, path: Path) -> None:
    """What a rank returns, for `load_result` in the parent: its tensors equal to the bit."""
    with open(path, "wb") as f:
        pickle.dump(_packed(result), f, protocol=pickle.HIGHEST_PROTOCOL)


def load_result(path: Path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _command_main(argv: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str,
                  script: str | None = None) -> None:
    """`python -m meshtrain ARGV` (or `python SCRIPT ARGV`) in this forked process: its
    environment, working folder, import path and standard streams set as a fresh
    interpreter's would be, `main(ARGV)` (the script as `__main__`) run, and the process left
    as the interpreter leaves (non-daemon threads joined, atexit handlers run) with its exit
    code."""
    import atexit
    import threading
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.argv = [script or "meshtrain", *argv]
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    code = 1
    try:
        if script is None:
            from meshtrain.cli import exit_code
            code = exit_code(argv)
        else:
            code = _run_script(script)
    except BaseException:
        traceback.print_exc()
    finally:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _run_script(script: str) -> int:
    """`script` run as `python SCRIPT` runs it (its folder first on the import path), and the
    exit code it leaves with."""
    import runpy
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


class Command:
    """`python -m meshtrain ARGV` (or `python SCRIPT ARGV`) started as a process forked from
    the preloaded server (what a fresh interpreter would run, without its seconds of
    imports), as `subprocess.Popen` is used here: its `pid`, signals, `wait` and
    `returncode` (negative: the signal that ended it). Its standard output and error go to
    the files `stdout` and `stderr`."""

    def __init__(self, argv: list[str], env: dict[str, str], stdout: Path, stderr: Path, *,
                 script: str | None = None):
        self.argv = [script or "meshtrain", *argv]
        self._proc = _context().Process(target=_command_main,
                                        args=(argv, env, os.getcwd(), str(stdout), str(stderr), script))
        self._proc.start()
        self.pid, self.sentinel = self._proc.pid, self._proc.sentinel  # the sentinel: ready when it ends

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)  # its ranks watch it, and leave with it

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; raises subprocess.TimeoutExpired, the command still running, after
        `timeout` seconds."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        return self._proc.exitcode


def run_command(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`Command(ARGV)` run to its end: its exit code and its output. Raises
    subprocess.TimeoutExpired, the command stopped, after `timeout` seconds."""
    with tempfile.TemporaryDirectory() as out_dir:
        out, err = Path(out_dir, "stdout"), Path(out_dir, "stderr")
        command = Command(argv, env, out, err)
        try:
            command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait(10)
            raise subprocess.TimeoutExpired(command.argv, timeout, out.read_bytes(), err.read_bytes()) from None
        return subprocess.CompletedProcess(command.argv, command.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def run_script_ranks(script: str, argv: list[str], world: int, env: dict[str, str],
                     timeout: float) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node WORLD SCRIPT ARGV` without torchrun's and the ranks' fresh
    interpreters: `world` processes forked from the preloaded server, each given the
    environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and
    running the script as `python SCRIPT` would. Its exit code is that of the first rank to
    fail (the others then stopped, as torchrun stops them); its output, every rank's in rank
    order."""
    for attempt in range(ATTEMPTS):
        with tempfile.TemporaryDirectory() as out_dir:
            port, ranks = free_port(), []
            for r in range(world):
                rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "WORLD_SIZE": str(world),
                            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                ranks.append(Command(argv, rank_env, Path(out_dir, f"out{r}"), Path(out_dir, f"err{r}"), script=script))
            code = _wait_as_torchrun(ranks, timeout)
            out = "".join(Path(out_dir, f"out{r}").read_text(errors="replace") for r in range(world))
            err = "".join(Path(out_dir, f"err{r}").read_text(errors="replace") for r in range(world))
        if code and "address already in use" in err.lower() and attempt + 1 < ATTEMPTS:
            continue  # the port was taken: try another
        return subprocess.CompletedProcess([script, *argv], code, out, err)
    raise AssertionError("could not find a free port")


def _wait_as_torchrun(ranks: list[Command], timeout: float) -> int:
    """The exit code of the first rank that fails (0 if none does), its peers stopped as
    torchrun stops them (they would wait on it in a collective until their timeout); raises
    subprocess.TimeoutExpired, every rank stopped, after `timeout` seconds."""
    from multiprocessing.connection import wait
    deadline = time.monotonic() + timeout
    while True:
        codes = [r.returncode for r in ranks]
        failure = next((c for c in codes if c not in (None, 0)), None)
        if failure is None and None not in codes:
            return 0
        if failure is not None or time.monotonic() > deadline:
            for r in ranks:
                r.kill()
                r.wait(10)
            if failure is None:
                raise subprocess.TimeoutExpired(ranks[0].argv, timeout)
            return failure
        wait([r.sentinel for r, c in zip(ranks, codes) if c is None], 0.5)


def run_ranks(fn, world: int, *args, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1,
              timeout: float = 180.0, collective_timeout: float | None = None) -> list:
    """Results of `fn(mesh, *args)` on each of `world` ranks (dp = world / (pp·cp·tp); ep
    folded over dp·cp·tp). `collective_timeout`: seconds a collective may wait before its
    rank fails (default: meshtrain's)."""
    sizes = {"pp": pp, "tp": tp, "cp": cp, "ep": ep, "dp": world // (pp * cp * tp),
             "collective_timeout": collective_timeout}
    ctx = _context()
    for attempt in range(ATTEMPTS):
        with tempfile.TemporaryDirectory() as out_dir:
            port = free_port()
            procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, sizes, out_dir, args))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
            codes = [p.exitcode for p in procs]
            if hung:
                raise AssertionError(f"ranks {hung} hung for {timeout}s")
            if any(c == 3 for c in codes) and attempt + 1 < ATTEMPTS:
                continue  # the port was taken: try another
            errors = [Path(out_dir, f"rank{r}.err") for r in range(world)]
            msgs = [e.read_text() for e in errors if e.exists()]
            if msgs or any(codes):
                raise AssertionError(f"rank exit codes {codes}\n" + "\n".join(msgs))
            return [load_result(Path(out_dir, f"rank{r}.pt")) for r in range(world)]
    raise AssertionError("could not find a free port")
