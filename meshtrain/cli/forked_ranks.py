"""Local ranks forked from a preloaded server instead of started as fresh interpreters.

A fresh interpreter spends seconds of CPU importing torch and torch._dynamo (which a torch
optimizer imports when it is built) before a rank does anything: 3.3 s a rank here, every
rank of every run and restart. torchrun's engine can run a function as each rank instead of
a program, from multiprocessing's fork server (`start_method="forkserver"`), which imports
what a rank needs once (`PRELOAD`) and forks each rank from there: a rank starts in a tenth
of a second, and the ranks share the imported pages (a 2-rank `train` here: 12.4-13.4 s of
CPU as programs, 8.1-8.7 s forked).

The server is the launcher's own fork (`_fork_server`), made before the launcher touches
CUDA, takes --out or prepares data: it inherits the launcher's torch and imports only the
rest (1.4 s of CPU instead of a fresh interpreter's 3.0 s), and it keeps nothing else of the
launcher's — no thread, no file descriptor, no signal handler (`_as_a_fresh_server`). `ps`
calls it `meshtrain fork`. It serves the launcher's restarts too, and leaves when the
launcher has gone. Its ranks are its children, not the launcher's: each watches the
launcher (`launch.die_with_launcher`), and `ps` names it `meshtrain rN`
(`launch.name_this_rank`).

Each rank runs `cli.forked_rank` (what `python -m meshtrain ARGV` runs, in the process the
engine forked: `adopt`). It leaves as every meshtrain rank does, through `launch.finish` and
`os._exit`; the engine, though, counts a function's rank done only when its return value
arrived. So a rank that leaves with code 0 first hands 0 to the engine's return queue
(`_hand_over`); other codes are the failures the engine reports, as before. The queue and
the engine's environment for the rank come from the engine's worker wrapper (`_wrap` in
`torch.distributed.elastic.multiprocessing.api`); an engine without that wrapper gets the
program entrypoint instead (`usable`)."""

from __future__ import annotations

import os
import sys

# What the server imports once for every rank: torch, torch._dynamo (a torch optimizer's
# first construction imports it: half of a rank's start), and meshtrain's command line and
# training loop.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "meshtrain.launch", "meshtrain.cli", "meshtrain.cli.run",
           "meshtrain.train", "meshtrain.verifier"]
# What `ps -o comm` and `top` call the server (a fork of the launcher has its command line).
SERVER_NAME = "meshtrain fork"
# The local names of the engine's worker wrapper this module reads (`_engine_wrapper`).
_WRAPPER_NAMES = ("env_", "ret_val_")


def usable() -> bool:
    """Whether this torch's engine runs function ranks through the wrapper read here."""
    try:
        from torch.distributed.elastic.multiprocessing import api
    except ImportError:
        return False
    wrap = getattr(api, "_wrap", None)
    return wrap is not None and all(name in wrap.__code__.co_varnames for name in _WRAPPER_NAMES)


def start_server(import_here: bool = False) -> None:
    """Start the fork server now, before this launcher touches CUDA, holds --out or prepares
    data (`_fork_server`): it imports the rest of `PRELOAD` while the launcher goes on — or,
    with `import_here` (a launcher that will import it all anyway: verify's, which runs the
    one-process reference), inherits it from the launcher. Later calls (a restart, verify's
    second layout) find it running."""
    import importlib
    import multiprocessing as mp
    from multiprocessing import forkserver, util

    for name in PRELOAD if import_here else ["torch"]:  # the server inherits them: `_fork_server`
        importlib.import_module(name)
    mp.set_forkserver_preload(PRELOAD)
    exec_server = util.spawnv_passfds
    util.spawnv_passfds = lambda path, args, passfds: _fork_server(exec_server, path, args, passfds)
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = exec_server


def _fork_server(exec_server, path: str, args: list[str], passfds) -> int:
    """multiprocessing starts its fork server as a fresh interpreter (`exec_server`); here
    it is a fork of this launcher instead, which has imported torch and has not touched
    CUDA, so the server pays only the rest of `PRELOAD` (3.0 -> 1.4 s of CPU a command).
    It then runs the very command the fresh interpreter would run, with what such an
    interpreter would not have taken away (`_as_a_fresh_server`). Other programs
    multiprocessing starts (its resource tracker) are left to `exec_server`."""
    command = args[-1] if args else ""
    if "multiprocessing.forkserver" not in command or "torch" not in sys.modules:
        return exec_server(path, args, passfds)
    for stream in (sys.stdout, sys.stderr):  # no buffered line of the launcher's printed twice
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _as_a_fresh_server(passfds)
        exec(command, {"__name__": "__mp_forkserver__"})  # noqa: S102  (multiprocessing's own command)
        code = 0
    except SystemExit as e:  # the server leaves when its launcher has gone
        code = e.code if isinstance(e.code, int) else 0
    finally:
        os._exit(code)


def _as_a_fresh_server(passfds) -> None:
    """In the forked server: every file descriptor but the standard streams and `passfds`
    let go, as a fresh interpreter is started (the launcher's end of the server's pipe
    among them, which tells the server when the launcher has gone) — each replaced by
    /dev/null rather than closed, so that no object of the launcher's later closes a
    number the server reuses; the launcher's signal handlers back to the defaults; its
    standard streams the interpreter's own again (a launcher that replaced them in Python,
    a notebook's or `contextlib.redirect_stderr`'s, would leave every rank printing into a
    copy of an object no one reads); and multiprocessing's lock, which the launcher holds
    while it starts this server, free."""
    import signal
    from multiprocessing import forkserver

    from meshtrain.launch import name_this_process
    keep = {0, 1, 2, *passfds}
    null = os.open(os.devnull, os.O_RDWR)
    for fd in _open_fds():
        if fd not in keep and fd != null:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:  # the listing's own descriptor, closed since
                pass
    os.close(null)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    lock = getattr(forkserver._forkserver, "_lock", None)
    if lock is not None and lock.locked():
        lock.release()
    name_this_process(SERVER_NAME)  # last: a test waits for it


def _open_fds() -> list[int]:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return [int(name) for name in os.listdir(folder)]
        except OSError:
            continue
    return list(range(3, 1024))


def adopt(launcher_env: dict[str, str]) -> None:
    """Make this forked process the rank the engine started: the launcher's environment with
    the engine's rank variables on top (as a program rank's would be), its exit code 0
    handed to the engine (`launch.finish`), the launcher watched (`launch.die_with_launcher`),
    and multiprocessing's default start method the platform's again, as in a fresh
    interpreter (the server's would register a rank's semaphores with its tracker)."""
    import multiprocessing as mp

    from meshtrain import launch
    wrapper = _engine_wrapper()
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(wrapper["env_"])
    launch.forked_from_a_server()
    launch.on_finish_code(lambda code: _hand_over(wrapper["ret_val_"], code))
    mp.set_start_method(None, force=True)


def _engine_wrapper() -> dict:
    """The locals of the engine's `_wrap` frame that runs this rank."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and all(name in frame.f_locals for name in _WRAPPER_NAMES):
            return frame.f_locals
        frame = frame.f_back
    raise RuntimeError("meshtrain's forked ranks need torchrun's engine wrapper (_wrap); start them as programs")


def _hand_over(queue, code: int) -> None:
    if code == 0:
        queue.put(0)  # written to the pipe before `put` returns: the process may leave at once
