"""A simulated host for the lease tests (`test_lease.py`): one process that takes `--out`'s
lease as a job on another machine would, with its host name, kernel boot id, wall clock and
`flock` patched, and prints what happened as JSON lines (`acquired`, `refused`, `lost`,
`released`), each with the real time it happened.

    python lease_host.py OUT --host NAME --boot ID [--launch L] [--skew S] [--flock real|none|local]
                         [--heartbeat S] [--stale S] [--hold S] [--start-at T] [--slow-listing S]

--flock none: the file system has no flock (ENOSYS); local: a flock that does not reach the
other hosts (NFS with local locks: every lock succeeds). --hold: keep the lease that long
(0: release at once), then release it. --start-at: wait until that real time first (for
simultaneous starts); --slow-listing: each listing of the folder
takes that long to come back (every host then sees the folder as it was before the others
acted)."""

import argparse
import errno
import fcntl
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

real_time = time.time


def say(event: str, **fields) -> None:
    print(json.dumps({"event": event, "at": real_time(), "pid": os.getpid(), **fields}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--host", required=True)
    p.add_argument("--boot", required=True)
    p.add_argument("--launch")
    p.add_argument("--skew", type=float, default=0.0)
    p.add_argument("--flock", choices=["real", "none", "local"], default="real")
    p.add_argument("--heartbeat", type=float, default=0.2)
    p.add_argument("--stale", type=float, default=1.5)
    p.add_argument("--hold", type=float, default=30.0)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--slow-listing", type=float, default=0.0)
    a = p.parse_args()

    from meshtrain.checkpoint import lock
    socket.gethostname = lambda: a.host
    lock._boot_id = lambda: a.boot
    time.time = lambda: real_time() + a.skew  # this host's wall clock (the lease's "since")
    skewed_monotonic = time.monotonic
    time.monotonic = lambda: skewed_monotonic() + a.skew  # and its own monotonic clock, offset too
    if a.flock == "none":
        def no_flock(fd, op):
            raise OSError(errno.ENOSYS, "Function not implemented")
        fcntl.flock = no_flock
    elif a.flock == "local":
        fcntl.flock = lambda fd, op: None

    if a.slow_listing:  # a shared file system's latency: what a listing saw is that old when acted on
        listdir = os.listdir

        def slow_listdir(path):
            names = listdir(path)
            time.sleep(a.slow_listing)
            return names
        os.listdir = slow_listdir
    while real_time() < a.start_at:
        time.sleep(0.001)
    held = lock.OutLock(a.out, log=lambda line: say("log", line=line), launch=a.launch,
                        heartbeat_s=a.heartbeat, stale_s=a.stale,
                        on_lost=lambda line: (say("lost", line=line), os._exit(3)))
    try:
        held.acquire()
    except lock.OutLocked as e:
        say("refused", line=str(e))
        return
    say("acquired", number=held.number)
    time.sleep(a.hold)
    held.release()
    say("released")


if __name__ == "__main__":
    main()
