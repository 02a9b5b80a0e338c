"""A checkpoint folder is written whole or not at all, and read only when it is whole: every
rank writes into `NAME.tmp/`, each file is synced, the checksums of all files go into the
`COMPLETE` marker (the last file written), and then the folder is renamed into place. A
checkpoint is good when its marker lists every file with the right size and checksum.

Every decision about what exists or is good is collective: each rank checks its share of the
files and the verdicts are gathered, so all ranks choose the same folder or fail together
(a rank never decides alone while the others wait in a collective)."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Callable

from meshtrain import faults

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 24


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes: it catches every flipped bit and burst a disk or a copy makes
    (an integrity check, not a signature)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def describe(path: Path) -> dict:
    """What the marker records of a file: its size and CRC-32."""
    return {"bytes": path.stat().st_size, "crc32": file_crc(path)}


def write_synced(path: Path, data: bytes) -> dict:
    """Write `data` to `path`, wait until it is on disk; returns its description."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dir(out: Path, step: int) -> Path:
    return Path(out) / f"step-{step}"


def write(final: Path, comm, write_files: Callable[[Path], dict[str, dict]]) -> None:
    """Collective: `write_files(tmp)` on every rank (a collective write into `tmp`), which
    returns the description (`describe`) of each file it wrote, taken as it wrote them;
    rank 0 describes any other file by reading it, writes the marker with all of them, and
    renames the folder to `final` (replacing one of that name)."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    mesh = comm.mesh
    if mesh.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
        tmp.mkdir(parents=True)
    comm.barrier()
    mine = write_files(tmp)
    step = STEP_DIR.match(final.name)
    faults.inject("kill-in-save", mesh.rank, int(step.group(1)) if step else None)
    everyone = comm.all_gather_object(mine)
    if mesh.is_main:
        files = {name: d for part in everyone for name, d in part.items()}
        files.update({f.name: describe(f) for f in sorted(tmp.iterdir()) if f.name not in files})
        write_synced(tmp / COMPLETE, json.dumps({"files": files}, indent=1).encode())
        fsync_dir(tmp)
        replaced = final.with_name(f".{final.name}.replaced")
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)
    comm.barrier()


def check(folder: Path, comm) -> str | None:
    """Collective: None if `folder` is a good checkpoint, else what is wrong with it (the
    first bad file, as every rank agrees)."""
    problem = _marker_problem(folder)
    if problem is None:
        files = sorted(json.loads((folder / COMPLETE).read_text())["files"].items())
        mesh = comm.mesh
        for name, d in files[mesh.rank::mesh.world_size]:  # each rank its share
            path = folder / name
            if not path.is_file():
                problem = f"{name} is missing"
            elif path.stat().st_size != d["bytes"]:
                problem = f"{name} has {path.stat().st_size} bytes, not {d['bytes']} (truncated?)"
            elif file_crc(path) != d["crc32"]:
                problem = f"{name} fails its checksum (corrupted)"
            if problem:
                break
    verdicts = [v for v in comm.all_gather_object(problem) if v]
    return verdicts[0] if verdicts else None


def _marker_problem(folder: Path) -> str | None:
    marker = Path(folder) / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (not a checkpoint, or its save did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return f"{COMPLETE} is unreadable"
    return None


def steps_in(out: Path, comm) -> list[int]:
    """Collective: the steps of the `step-N` folders with a marker that every rank sees,
    newest first."""
    seen = set(steps_in_local(out))
    for other in comm.all_gather_object(seen):
        seen &= other
    return sorted(seen, reverse=True)


def latest_good(out: Path, comm, log: Callable[[str], None]) -> Path | None:
    """Collective: the newest good checkpoint in `out` (one line for each bad one passed by)."""
    for step in steps_in(out, comm):
        folder = step_dir(out, step)
        problem = check(folder, comm)
        if problem is None:
            return folder
        if comm.mesh.is_main:
            log(f"checkpoint {folder}: {problem}; trying the one before")
    return None


def prune(out: Path, keep: int, comm) -> None:
    """Collective (rank 0 removes): all but the newest `keep` good-looking `step-N` folders.
    Called after a save has completed on every rank."""
    if comm.mesh.is_main:
        for step in steps_in_local(out)[keep:]:
            shutil.rmtree(step_dir(out, step), ignore_errors=True)
    comm.barrier()


def steps_in_local(out: Path) -> list[int]:
    """The steps of the `step-N` folders with a marker that this rank sees, newest first."""
    out = Path(out)
    return sorted((int(m.group(1)) for p in (out.iterdir() if out.is_dir() else [])
                   if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()), reverse=True)
