"""One job at a time per output folder: a lease, held by meshtrain's launcher across its
restarts (or by rank 0 under an outside launcher) while the run lives.

The lease is the newest of the numbered files `OUT/.lock.<n>`. A job takes it by creating
the next number with `O_CREAT | O_EXCL`, which is atomic on local disks, NFSv3+ and Lustre:
of two contenders, on one host or two, exactly one creates it; the loser judges the winner
again. The holder's file names it (host, machine, pid, launch, since when) and carries a
heartbeat counter it rewrites every `heartbeat_s`; at the end it marks the file released
(the newest file is never deleted, so the numbers only grow).

A contender takes the newest lease over at once when it is released, when its holder is of
the same launch (torchrun's run id, the Slurm job id, meshtrain's launcher token: a restart,
wherever it lands — not the run id, which every `--resume` carries), or when the holder ran
on this machine (same host name and kernel boot id) and is gone: the kernel dropped its
`flock`, or its pid is gone from this pid namespace. Otherwise it watches the counter: a
change means the holder lives (refused, one line); no change for `stale_s` on the
contender's own monotonic clock means it is gone (taken over). No clocks are compared
across hosts, and a duplicate host name on another machine has another boot id. `flock`
is used where the file system has it and not needed where it does not (ENOSYS, ENOLCK,
EOPNOTSUPP: Lustre's default mount, NFS with local locks).

The holder's heartbeat also looks for a newer lease: one taken over by another job (its
heartbeat seemed stopped: a host cut off, a frozen process) makes `on_lost` run with one
line within one heartbeat, and the job stops."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Callable

LEASE_PREFIX = ".lock."
OLD_LOCK_FILE = ".lock"  # meshtrain before leases; never read, skipped like a lease
HEARTBEAT_S = 20.0
STALE_S = 120.0  # a holder whose counter has not moved for this long is gone
HEARTBEAT_ENV = "MESHTRAIN_LOCK_HEARTBEAT_S"
NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP))
_LEASE = re.compile(r"^\.lock\.(\d+)$")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class OutLocked(ValueError):
    """Another live job holds the folder: one line naming it."""


def is_lock_file(name: str) -> bool:
    """Whether a name in an output folder is the lease's (never moved aside nor exported)."""
    return name == OLD_LOCK_FILE or _LEASE.match(name) is not None


def launch_of_environment() -> str | None:
    """The launch this process belongs to, the same in each of its restarts wherever they
    land: torchrun's run id (not `--standalone`'s 'none'), the Slurm job (and step) id,
    meshtrain's launcher token; None where none is set."""
    from meshtrain.checkpoint.lineage import JOB_ENV  # torch-free
    torchrun, slurm = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("SLURM_JOB_ID", "")
    if torchrun not in ("", "none"):
        return f"torchrun:{torchrun}"
    if slurm:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm:{slurm}" + (f".{step}" if step else "")
    return f"meshtrain:{os.environ[JOB_ENV]}" if os.environ.get(JOB_ENV) else None


def heartbeat_of_environment() -> tuple[float, float]:
    """(heartbeat_s, stale_s): `MESHTRAIN_LOCK_HEARTBEAT_S` sets the heartbeat (a cluster
    whose file system answers slowly, a test), the stale time six of them."""
    try:
        beat = float(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_S))
    except ValueError:
        beat = HEARTBEAT_S
    beat = beat if beat > 0 else HEARTBEAT_S
    return beat, beat * STALE_S / HEARTBEAT_S


def _boot_id() -> str | None:
    """This kernel's boot id (Linux): two machines, even with one host name, have two."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def holder_line(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    launch = f", launch {holder['launch']}" if holder.get("launch") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {when}{launch}"


def _parse(content: bytes | None) -> dict:
    try:
        holder = json.loads(content or b"{}")
    except ValueError:  # being written
        return {}
    return holder if isinstance(holder, dict) else {}


class OutLock:
    """`acquire()` or `OutLocked`; `release()` at the end (also safe when never acquired).
    `on_lost(line)` runs on the heartbeat's thread when another job took the lease over."""

    def __init__(self, out: Path, log: Callable[[str], None], *, launch: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
                 on_lost: Callable[[str], None] | None = None):
        self.out, self.log = Path(out), log
        self.launch = launch if launch is not None else launch_of_environment()
        self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
        self.on_lost = on_lost or log
        self.number: int | None = None
        self._fd: int | None = None
        self._me: dict = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost: str | None = None

    # ---- taking it --------------------------------------------------------------------------

    def acquire(self) -> "OutLock":
        watching: tuple[int, bytes, float] | None = None  # (lease, its content, since when on my clock)
        while True:
            number, content = self._newest()
            if number is None:
                if self._create(1):
                    return self
                continue
            holder = _parse(content)
            why = self._gone_now(number, holder)
            if why is None:  # only its heartbeat can tell
                if watching is None or watching[0] != number:
                    watching = (number, content, time.monotonic())
                    if holder:
                        self.log(f"{self.out}: held by another job ({holder_line(holder)}); watching its "
                                 f"heartbeat for up to {self.stale_s:.0f} s")
                elif content != watching[1]:  # it wrote since: alive
                    why = "alive"
                elif time.monotonic() - watching[2] >= self.stale_s:
                    why = f"a run whose heartbeat stood still for {self.stale_s:.0f} s"
                if why is None:
                    time.sleep(min(1.0, self.heartbeat_s / 4))
                    continue
            if why == "alive":
                raise OutLocked(self._refusal(holder))
            if self._create(number + 1):
                if why != "released":
                    self.log(f"{self.out}: took over the lock of {why} ({holder_line(holder)})")
                return self
            watching = None  # another contender took it first: judge the new holder

    def _gone_now(self, number: int, holder: dict) -> str | None:
        """Why the lease can be taken at once ("released", or a description for the log),
        "alive" when its holder is known to live, None when only its heartbeat can tell."""
        if not holder:
            return None  # being written: its writer lives
        if holder.get("released"):
            return "released"
        if self.launch and holder.get("launch") == self.launch:
            return "this launch's earlier attempt"
        if holder.get("host") != socket.gethostname() or not holder.get("machine") or \
                holder.get("machine") != _boot_id():
            return None
        held = self._flock_held(number)
        if held is not None:
            return "alive" if held else "a run that is gone"
        if holder.get("pidns") and holder.get("pidns") == _pid_namespace() and not _pid_alive(holder.get("pid")):
            return "a run that is gone"
        return None

    def _flock_held(self, number: int) -> bool | None:
        """Whether a process of this machine holds lease `number`'s flock (its holder locks it
        before writing its name): None where the file system has no flock."""
        try:
            fd = os.open(self._path(number), os.O_RDWR)  # NFS's flock is a write lock: it needs write access
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in NO_FLOCK:
                return None
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        finally:
            os.close(fd)  # closing drops a lock we got
        return False

    def _create(self, number: int) -> bool:
        """Lease `number`, if this process creates it first: flocked, then named and beating."""
        try:
            fd = os.open(self._path(number), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in NO_FLOCK:
                os.close(fd)
                raise
        self._fd, self.number = fd, number
        self._me = {"host": socket.gethostname(), "machine": _boot_id(), "pidns": _pid_namespace(),
                    "pid": os.getpid(), "launch": self.launch, "since": time.time(), "beat": 0}
        self._write()
        for name in os.listdir(self.out):  # the leases before it, which no one reads again
            old = _LEASE.match(name)
            if old and int(old.group(1)) < number:
                try:
                    os.unlink(self.out / name)
                except OSError:
                    pass
        self._beat = threading.Thread(target=self._heartbeat, name="meshtrain-out-lease", daemon=True)
        self._beat.start()
        return True

    # ---- holding it -------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                taker = self._taken_by()
            except OSError:
                continue  # a file system hiccup: the next beat looks again
            if taker is not None:
                whose = f"another job took over this run's lock ({holder_line(taker)})" if taker else \
                    f"this run's lock {self._path(self.number)} was removed"
                self.lost = f"--out {self.out}: {whose}; stopping without writing more"
                self.on_lost(self.lost)
                return
            self._me["beat"] += 1
            try:
                self._write()
            except OSError:
                pass  # a file system hiccup: the next beat tries again

    def _taken_by(self) -> dict | None:
        """The holder of a newer lease than ours, or of none when ours is gone; None while ours
        is the newest."""
        number, content = self._newest()
        if number == self.number:
            return None
        return _parse(content) if number is not None and number > self.number else {}

    def release(self, remove: bool = False) -> None:
        """Mark the lease released (`remove`: delete it — an export's folder is a model's, for
        other tools; a contender that judged it meanwhile takes the next number, and the
        heartbeats settle a clash within one beat)."""
        if self._fd is None:
            return
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        try:
            if self.lost is None and self._taken_by() is None:
                self._me["released"] = True
                self._write()
                if remove:
                    os.unlink(self._path(self.number))
        except OSError:
            pass  # the folder is gone or unwritable: nothing to give back
        os.close(self._fd)  # drops the flock
        self._fd = None

    def _write(self) -> None:
        data = (json.dumps(self._me) + "\n").encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.fsync(self._fd)  # on NFS: to the server, where other hosts read it

    # ---- reading ----------------------------------------------------------------------------

    def _path(self, number: int) -> Path:
        return self.out / f"{LEASE_PREFIX}{number}"

    def _newest(self) -> tuple[int | None, bytes | None]:
        """The newest lease's number and content (None, None when there is none)."""
        while True:
            numbers = [int(m.group(1)) for m in map(_LEASE.match, os.listdir(self.out)) if m]
            if not numbers:
                return None, None
            try:
                return max(numbers), self._path(max(numbers)).read_bytes()
            except FileNotFoundError:  # an older one removed by a new holder as we listed: again
                continue

    def _refusal(self, holder: dict) -> str:
        return (f"--out {self.out} is in use by another meshtrain job ({holder_line(holder)}); wait for it "
                f"to end, stop it, or choose another --out (a job whose heartbeat in {self.out}/"
                f"{LEASE_PREFIX}N stops for {self.stale_s:.0f} s is taken over)")
