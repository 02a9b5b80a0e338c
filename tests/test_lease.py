"""`--out`'s lease (`checkpoint/lock.py`) across hosts, each host a process of its own
(`lease_host.py`) with its host name, kernel boot id, clocks and `flock` patched: a restart
of the same launch on another host takes over at once; a different launch is refused while
the holder beats and takes over once it has stood still; two hosts starting at once end with
one holder; a skewed clock or a duplicate host name never takes a live lease; a holder whose
lease was taken stops within one heartbeat; all of it without `flock`. And the command line's
holder (meshtrain's launcher) stopping its ranks when its lease is taken."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, is_running, ranks_of, start_cli

HOST = Path(__file__).with_name("lease_host.py")
BEAT, STALE = 0.2, 1.5  # the simulated hosts' heartbeat and stale time (s)


def host(out: Path, name: str, boot: str, *flags) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HOST), str(out), "--host", name, "--boot", boot,
                             "--heartbeat", str(BEAT), "--stale", str(STALE), *map(str, flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(proc: subprocess.Popen, timeout: float = 30) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")] or [{"event": "none", "err": err}]


def wait_for(proc: subprocess.Popen, event: str, timeout: float = 30) -> dict:
    """Read `proc`'s events until `event` (the others are dropped)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        e = json.loads(line)
        if e["event"] == event:
            return e
    raise AssertionError(f"no {event} from {proc.args[2:6]}: {proc.stderr.read() if proc.poll() is not None else ''}")


def ended(*events_: dict) -> list[str]:
    return [e["event"] for e in events_ if e["event"] != "log"]


@pytest.mark.parametrize("flock", ["real", "none"])
def test_a_restart_of_the_same_launch_on_another_host_takes_over_at_once_and_the_old_holder_stops(tmp_path, flock):
    """The holder's host freezes (SIGSTOP: cut off, its heartbeat stopped); torchrun restarts
    rank 0 on another node, same launch: it takes over at once, far below the stale time.
    When the old holder wakes, its next heartbeat finds the newer lease: it stops, one line."""
    old = host(tmp_path, "node-a", "boot-a", "--launch", "torchrun:42", "--flock", flock)
    wait_for(old, "acquired")
    old.send_signal(signal.SIGSTOP)
    try:
        start = time.time()
        new = host(tmp_path, "node-b", "boot-b", "--launch", "torchrun:42", "--flock", flock, "--hold", 1)
        took = wait_for(new, "acquired")
        assert took["at"] - start < STALE / 2, took["at"] - start
    finally:
        old.send_signal(signal.SIGCONT)
    woke = time.time()
    lost = wait_for(old, "lost")
    assert lost["at"] - woke < BEAT + 0.5, lost["at"] - woke
    assert "another job took over this run's lock (host node-b" in lost["line"] and "torchrun:42" in lost["line"]
    assert old.wait(10) == 3
    assert "released" in ended(*events(new))


@pytest.mark.parametrize("flock", ["real", "none"])
def test_a_different_launch_is_refused_while_the_holder_beats_and_takes_over_once_it_stood_still(tmp_path, flock):
    holder = host(tmp_path, "node-a", "boot-a", "--launch", "torchrun:1", "--flock", flock)
    held = wait_for(holder, "acquired")
    start = time.time()
    refused = events(host(tmp_path, "node-b", "boot-b", "--launch", "torchrun:2", "--flock", flock))
    assert ended(*refused) == ["refused"], refused
    assert refused[-1]["at"] - start < STALE, "refused only once the holder's beat was seen"
    line = refused[-1]["line"]
    assert f"in use by another meshtrain job (host node-a, pid {held['pid']}, since " in line and "torchrun:1" in line
    holder.send_signal(signal.SIGKILL)  # gone, on another host: only its stopped heartbeat can tell
    holder.wait()
    start = time.time()
    taker = events(host(tmp_path, "node-b", "boot-b", "--launch", "torchrun:2", "--flock", flock, "--hold", 0))
    assert ended(*taker) == ["acquired", "released"], taker
    assert STALE <= taker[-2]["at"] - start < STALE + 2, taker[-2]["at"] - start
    assert any("took over the lock of a run whose heartbeat stood still" in e.get("line", "") for e in taker)


@pytest.mark.parametrize("flock", ["local", "none"])
def test_hosts_starting_at_once_end_with_one_holder(tmp_path, flock):
    """Four hosts (no flock between them) start within a millisecond of each other, in three
    folders at once, on a file system whose listings come back late (so each sees the folder
    empty before any creates the lease): in each exactly one holds it, the others are refused."""
    at = time.time() + 1.0
    folders = {attempt: [] for attempt in range(3)}
    for attempt, hosts in folders.items():
        (tmp_path / str(attempt)).mkdir()
        hosts.extend(host(tmp_path / str(attempt), f"node-{i}", f"boot-{i}", "--launch", f"job-{i}", "--flock", flock,
                          "--hold", 1, "--start-at", at, "--slow-listing", 0.3) for i in range(4))
    for attempt, hosts in folders.items():
        outcomes = sorted(ended(*events(h))[0] for h in hosts)
        assert outcomes == ["acquired", "refused", "refused", "refused"], (attempt, outcomes)


@pytest.mark.parametrize("who", ["clock-an-hour-behind", "clock-an-hour-ahead", "same-host-name"])
def test_a_skewed_clock_or_a_duplicate_host_name_never_takes_a_live_lease(tmp_path, who):
    """The old lock compared the file's age with the contender's clock, and trusted `flock`
    on a host of the same name: both took over a live holder on another machine."""
    holder = host(tmp_path, "node-a", "boot-a", "--launch", "job-1", "--flock", "local")
    wait_for(holder, "acquired")
    name, skew = {"clock-an-hour-behind": ("node-b", -3600), "clock-an-hour-ahead": ("node-b", 3600),
                  "same-host-name": ("node-a", 0)}[who]
    contender = events(host(tmp_path, name, "boot-b", "--launch", "job-2", "--flock", "local", "--skew", skew))
    assert ended(*contender) == ["refused"], contender
    holder.send_signal(signal.SIGTERM)
    holder.wait()


@pytest.mark.parametrize("flock", ["real", "none"])
def test_on_one_machine_a_dead_holder_is_taken_over_at_once_and_a_live_one_refused(tmp_path, flock):
    """Same host name and boot id: the kernel's flock says at once whether the holder lives;
    without flock, its pid in this pid namespace does. A released lease is taken quietly."""
    holder = host(tmp_path, "node-a", "boot-a", "--flock", flock)
    wait_for(holder, "acquired")
    refused = events(host(tmp_path, "node-a", "boot-a", "--flock", flock))
    assert ended(*refused) == ["refused"], refused
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.time()
    taker = events(host(tmp_path, "node-a", "boot-a", "--flock", flock, "--hold", 0))
    assert ended(*taker) == ["acquired", "released"], taker
    assert taker[-2]["at"] - start < STALE / 2
    assert any("took over the lock of a run that is gone (host node-a" in e.get("line", "") for e in taker)
    quiet = events(host(tmp_path, "node-b", "boot-b", "--flock", flock, "--hold", 0))
    assert [e["event"] for e in quiet] == ["acquired", "released"], quiet  # released: nothing to say
    assert [p.name for p in tmp_path.iterdir()] == [".lock.3"]  # the numbers only grow; older ones removed


def test_the_command_line_s_holder_stops_its_ranks_when_its_lease_is_taken(tmp_path):
    """meshtrain's launcher holds the lease of a two-rank run; another host judges it stale
    and takes the next lease. Within one heartbeat the launcher says so in one line and stops
    every rank at once (SIGKILL: no save into the folder it no longer holds), exit 2."""
    out = tmp_path / "run"
    err = tmp_path / "stderr"
    launcher = start_cli("train", *TINY, "--dp", "2", "--steps", "5000", "--out", out, stdout=os.devnull,
                         stderr=err, env={"MESHTRAIN_LOCK_HEARTBEAT_S": "0.3"})
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    ranks = list(ranks_of(launcher.pid).values())
    assert len(ranks) == 2
    (lease,) = [p for p in out.iterdir() if p.name.startswith(".lock.")]
    mine = json.loads(lease.read_text())
    assert mine["pid"] == launcher.pid and mine["launch"].startswith("meshtrain:")
    taken = time.time()
    fd = os.open(out / f".lock.{int(lease.name.rsplit('.', 1)[1]) + 1}", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    os.write(fd, json.dumps({"host": "node-b", "machine": "boot-b", "pid": 7, "launch": "slurm:9", "since": taken,
                             "beat": 0}).encode())
    os.close(fd)
    assert launcher.wait(30) == 2
    stopped = time.time() - taken
    deadline = time.time() + 10
    while time.time() < deadline and any(is_running(p) for p in ranks):
        time.sleep(0.05)
    assert not any(is_running(p) for p in ranks)
    lines = [line for line in err.read_text().splitlines() if "took over" in line]
    assert lines == [f"meshtrain: error: --out {out}: another job took over this run's lock (host node-b, pid 7, "
                     f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(taken))}, launch slurm:9); "
                     f"stopping without writing more"], err.read_text()[-2000:]  # a line of its own
    assert stopped < 0.3 + 2.0, stopped
    logged = len(metrics.read_text().splitlines())
    time.sleep(0.5)
    assert len(metrics.read_text().splitlines()) == logged
