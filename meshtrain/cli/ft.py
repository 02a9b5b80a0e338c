"""`train --ft-replicas R` before any rank starts: its checks, and from a shell the lighthouse
and the R replica groups (`meshtrain.replicas`).

From a shell this process starts torchft's lighthouse and R group launchers, each
`meshtrain train ... --ft-replica-id I --ft-lighthouse ADDR`, which starts its group's ranks
as any run does, restarting them (`--max-restarts N`: per group) — a restarted group heals
from a live one. Group 0 writes the run's folder (checkpoints, log, report, `--json`); the
others train and write nothing. On a cluster each group is a launch of its own (torchrun per
group) and the lighthouse is started once (docs/fault-tolerance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from meshtrain.cli.config import Config, ConfigError, flag_of
from meshtrain.faults import FT_REPLICA_ENV
from meshtrain.launch import HOST_RANKS_ENV

CONNECT_S = 5.0  # how long the check waits for the lighthouse to answer


def check_before_planning(cfg: Config) -> None:
    """What must be refused before a --layout-search plans (which may calibrate the host)."""
    if cfg.ft.replicas and cfg.search.enabled:
        raise ConfigError("--ft-replicas with --layout-search: not composed yet; give the layout of one replica "
                          "group (plan it with --layout-search without --ft-replicas)")


def check(cfg: Config, renv) -> None:
    """Refuse what `--ft-replicas` cannot run, in one line; fill the lighthouse from the
    environment under a launcher."""
    ft, lay, tr = cfg.ft, cfg.layout, cfg.train
    if not ft.replicas:
        given = [flag_of("ft", name) for section, name in sorted(cfg.given) if section == "ft" and name != "replicas"]
        if given:
            raise ConfigError(f"{given[0]} applies with --ft-replicas R; add it, or drop {given[0]}")
        if ft.replicas < 0:
            raise ConfigError(f"--ft-replicas {ft.replicas}: must be a positive number of replica groups")
        return
    if ft.replicas < 0:
        raise ConfigError(f"--ft-replicas {ft.replicas}: must be a positive number of replica groups")
    for name in ("timeout", "quorum_timeout", "heartbeat_timeout", "bucket_mb"):
        if not getattr(ft, name) > 0:
            raise ConfigError(f"{flag_of('ft', name)} {getattr(ft, name)}: must be positive")
    rows = ft.replicas * (lay.dp or 1) * lay.microbatches
    if tr.batch_size % rows:
        raise ConfigError(f"--batch-size {tr.batch_size} does not split over --ft-replicas {ft.replicas} groups of "
                          f"dp·microbatches = {lay.dp or 1}·{lay.microbatches}: use a multiple of {rows}")
    ours = os.environ.get(FT_REPLICA_ENV) is not None  # a group meshtrain's own launcher started
    if renv is None and not ours and ft.replica_id is not None:
        raise ConfigError("--ft-replica-id is for a launcher's ranks (torchrun per group); from a shell "
                          "meshtrain starts the --ft-replicas groups itself: drop --ft-replica-id")
    from meshtrain.replicas import LIGHTHOUSE_ENV, MISSING, available
    if not available():
        raise ConfigError(MISSING)
    if renv is None and not ours:
        if ft.lighthouse:
            reachable(ft.lighthouse)
        return
    if ft.replica_id is None:
        raise ConfigError(f"--ft-replicas {ft.replicas} under a launcher: each replica group is a launch of its own; "
                          f"give this one's --ft-replica-id (0 to {ft.replicas - 1})")
    if not 0 <= ft.replica_id < ft.replicas:
        raise ConfigError(f"--ft-replica-id {ft.replica_id}: use 0 to {ft.replicas - 1} (--ft-replicas {ft.replicas})")
    ft.lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not ft.lighthouse:
        raise ConfigError(f"--ft-replicas under a launcher needs torchft's lighthouse: --ft-lighthouse "
                          f"http://HOST:PORT or {LIGHTHOUSE_ENV} (start one: torchft_lighthouse --min_replicas 1)")
    # Asked once by meshtrain's own launcher of the groups: a group launcher that asked would
    # hold torchft's runtime (threads) in the process its ranks are forked from.
    if renv is not None and renv.rank == 0 and not ours:
        reachable(ft.lighthouse)


def reachable(address: str) -> None:
    """One line when no lighthouse answers at `address`."""
    from meshtrain.replicas import quiet
    quiet()
    from datetime import timedelta

    from torchft._torchft import LighthouseClient
    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=CONNECT_S))
    except Exception as e:  # torchft raises RuntimeError with the transport's reason
        reason = str(e).splitlines()[0].split(":")[0] if str(e) else type(e).__name__
        raise ConfigError(f"--ft-lighthouse {address}: no lighthouse answers there within {CONNECT_S:g} s "
                          f"({reason}); start one (torchft_lighthouse --min_replicas 1 --bind [::]:29510) or "
                          f"give its address") from None


def group_log(replica_id: int) -> str:
    """The step log of replica group `replica_id` > 0, in OUT (group 0's is metrics.jsonl)."""
    return f"ft-group-{replica_id}.jsonl"


def launches_groups(cfg: Config, renv) -> bool:
    """This process, from a shell, starts the R groups (not a group itself)."""
    return renv is None and bool(cfg.ft.replicas) and os.environ.get(FT_REPLICA_ENV) is None


def is_a_group_launcher(cfg: Config, renv) -> bool:
    """This process is one replica group's launcher, started by `launch_groups`."""
    return renv is None and bool(cfg.ft.replicas) and os.environ.get(FT_REPLICA_ENV) is not None


def launch_groups(cfg: Config, argv: list[str], log) -> int:
    """Start the lighthouse (unless --ft-lighthouse names one) and the R groups; wait for them.
    The run's exit code is group 0's: the group that writes its folder and its report."""
    ft = cfg.ft
    server = None
    address = ft.lighthouse
    if not address:
        from meshtrain.replicas import quiet
        quiet()
        from torchft._torchft import LighthouseServer
        server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=int(ft.heartbeat_timeout * 1000))
        address = server.address()
    log(f"fault tolerant: {ft.replicas} replica groups of {cfg.layout.world_size} ranks "
        f"({cfg.layout.short()}), lighthouse {address}")
    groups = []
    gpus = _gpus_per_group(cfg)
    try:
        for i in range(ft.replicas):
            env = {**os.environ, FT_REPLICA_ENV: str(i), HOST_RANKS_ENV: str(ft.replicas * cfg.layout.world_size)}
            if gpus is not None:  # each group its own GPUs: group i the i-th W of them
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * cfg.layout.world_size:(i + 1) * cfg.layout.world_size])
            groups.append(subprocess.Popen([sys.executable, "-m", "meshtrain", *argv, "--ft-replica-id", str(i),
                                            "--ft-lighthouse", address], env=env))
        codes = _wait(groups)
    finally:
        for g in groups:
            if g.poll() is None:
                g.terminate()
        for g in groups:
            try:
                g.wait(timeout=30)
            except subprocess.TimeoutExpired:
                g.kill()
        if server is not None:
            server.shutdown()
    failed = [i for i, code in enumerate(codes) if code]
    if failed and codes[0] == 0:
        log(f"warning: replica group {', '.join(map(str, failed))} ended with an error; group 0 finished the run")
    return codes[0]


def _gpus_per_group(cfg: Config) -> list[str] | None:
    """On CUDA, the GPUs this host offers (CUDA_VISIBLE_DEVICES' or all), which the groups
    split in order; None on the CPU (`launch.choose_device` refused too few GPUs already)."""
    if cfg.train.device == "cpu":
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def _wait(groups: list[subprocess.Popen]) -> list[int]:
    """Every group's exit code, once all have ended."""
    while any(g.poll() is None for g in groups):
        time.sleep(0.2)
    return [g.returncode for g in groups]
