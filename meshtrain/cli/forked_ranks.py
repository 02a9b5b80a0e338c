"""Local ranks forked from a preloaded server instead of started as fresh interpreters.

A fresh interpreter spends seconds of CPU importing torch and torch._dynamo (which a torch
optimizer imports when it is built) before a rank does anything: 3.3 s a rank here, every
rank of every run and restart. torchrun's engine can run a function as each rank instead of
a program, from multiprocessing's fork server (`start_method="forkserver"`), which imports
what a rank needs once (`PRELOAD`) and forks each rank from there: a rank starts in a tenth
of a second, and the ranks share the imported pages (a 2-rank `train` here: 12.4-13.4 s of
CPU as programs, 8.1-8.7 s forked). The server is a clean interpreter of its own (it has
imported and nothing else: no thread, no CUDA context, no lock of the launcher's), started
once per launcher and reused by its restarts. Its ranks are its children, not the
launcher's: each watches the launcher (`launch.die_with_launcher`), and `ps` names it
`meshtrain rN` (`launch.name_this_rank`).

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


def start_server() -> None:
    """Start the fork server now (it imports `PRELOAD`, seconds), while the launcher sets up
    its rendezvous; later calls find it running."""
    import multiprocessing as mp
    from multiprocessing import forkserver
    mp.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


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
