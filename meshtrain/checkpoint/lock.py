"""One job at a time per output folder: `OUT/.lock`, held by meshtrain's launcher across its
restarts (or by rank 0 under an outside launcher) while the run lives.

On one host the lock is an advisory `flock` on the file, which the kernel releases when its
holder dies however it dies (`kill -9` included), so a lock left behind is taken over at
once. The file also names its holder (host, pid, since when) and its mtime is a heartbeat,
touched every `HEARTBEAT_S`: on a shared file system where `flock` does not reach other
hosts, a holder on another host is alive while its heartbeat is younger than `STALE_S`."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Callable

LOCK_FILE = ".lock"
HEARTBEAT_S = 20.0
STALE_S = 120.0  # a holder on another host whose heartbeat is older than this is gone


class OutLocked(ValueError):
    """Another live job holds the folder: one line naming it."""


def _holder_line(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}"


class OutLock:
    """`acquire()` or `OutLocked`; `release()` at the end (also safe when never acquired)."""

    def __init__(self, out: Path, log: Callable[[str], None]):
        self.path = Path(out) / LOCK_FILE
        self.log = log
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> "OutLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutLocked(self._refusal(self._read())) from None
            try:  # the file we locked may have been removed by a holder releasing it meanwhile
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = self._read()
        if holder and not self._gone(holder):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise OutLocked(self._refusal(holder))
        if holder:
            self.log(f"{self.path.parent}: took over the lock of a run that is gone ({_holder_line(holder)})")
        self._fd = fd
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._beat = threading.Thread(target=self._heartbeat, name="meshtrain-out-lock", daemon=True)
        self._beat.start()
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        try:
            os.unlink(self.path)  # while still locked: a waiter that opened it retries on the new file
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def _read(self) -> dict:
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _gone(self, holder: dict) -> bool:
        """Whether the holder named in a file we could lock is dead. On this host it is: the
        kernel dropped its lock. On another host: when its heartbeat is older than STALE_S."""
        if holder.get("host") == socket.gethostname():
            return True
        try:
            return time.time() - self.path.stat().st_mtime > STALE_S
        except FileNotFoundError:
            return True

    def _refusal(self, holder: dict) -> str:
        return (f"--out {self.path.parent} is in use by another meshtrain job ({_holder_line(holder)}); wait for it "
                f"to end, stop it, or choose another --out (a holder on another host that stops touching "
                f"{self.path} for {STALE_S:.0f} s is taken over)")
