"""A checkpoint folder is written whole or not at all, and read only when it is whole: every
rank writes into `NAME.tmp/`, each file is synced, the checksums of all files go into the
`COMPLETE` marker (the last file written), and then the folder is renamed into place. A
checkpoint is good when its marker lists every file with the right size and checksum.

Every decision about what exists or is good is collective: each rank checks its share of the
files and the verdicts are gathered to rank 0, which broadcasts the decision, so all ranks
choose the same folder or fail together (a rank never decides alone while the others wait in
a collective), and what a rank other than 0 receives does not grow with the world."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Callable

from meshtrain import faults
from meshtrain.atomic import plain_name

COMPLETE = "COMPLETE"
STATE = "state.json"  # the checkpoint's JSON facts (`sharded.py` writes it)
STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here (another model, a bad folder), or a save that
    failed on another rank: one line."""


class CorruptCheckpoint(CheckpointError):
    """Bytes a load read that fail their checksum: the checkpoint is damaged (the one before
    it may be good)."""


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes: it catches every flipped bit and burst a disk or a copy makes
    (an integrity check, not a signature)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def describe(path: Path) -> dict:
    """What the marker records of a file: its size and CRC-32 (or, for a data file whose
    boxes carry their own CRC-32 in the index, {"bytes", "checked": "by item"}: checked as
    a load reads them, so resuming reads each byte once)."""
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
    renames the folder to `final` (replacing one of that name).

    Every step that runs on one rank ends in a collective decision (`decide`): a step that
    fails on any rank (rank 0's folder, its JSON, the caller's files, the marker, the rename)
    raises on every rank, the failing one its own error and the others a `CheckpointError`
    naming it, and `final` is left as it was."""
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    mesh = comm.mesh
    error = None
    if mesh.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way
            tmp.mkdir(parents=True)
        except Exception as e:
            error = e
    decide(comm, error, f"checkpoint {final}: making its folder")
    mine, error = {}, None
    try:
        mine = write_files(tmp)
    except Exception as e:
        error = e
    step = STEP_DIR.match(final.name)
    faults.inject("kill-in-save", mesh.rank, int(step.group(1)) if step else None)
    try:
        everyone = decide(comm, error, f"checkpoint {final}: writing it", mine)
        error = None
        if mesh.is_main:
            try:
                _commit(tmp, final, {name: d for part in everyone for name, d in part.items()})
            except Exception as e:
                error = e
        decide(comm, error, f"checkpoint {final}: committing it")
    except BaseException:
        if mesh.is_main:  # every rank has left the write: nothing more comes into tmp
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: Path, final: Path, files: dict[str, dict]) -> None:
    """Rank 0: describe the files no rank described, write the marker, rename `tmp` to
    `final` (putting back the one it replaced if the rename fails). A kill between the two
    renames of a replacement leaves no `final` but both whole folders: `recover` finishes
    the commit."""
    files.update({f.name: describe(f) for f in sorted(tmp.iterdir()) if f.name not in files})
    write_synced(tmp / COMPLETE, json.dumps({"files": files}, indent=1).encode())
    fsync_dir(tmp)
    replaced = _replaced(final)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    try:
        os.replace(tmp, final)
    except BaseException:
        if replaced.exists() and not final.exists():
            os.replace(replaced, final)
        raise
    fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _replaced(final: Path) -> Path:
    return final.with_name(f".{final.name}.replaced")


def _pruned(final: Path) -> Path:
    return final.with_name(f".{final.name}.pruned")


def unfinished_saves(out: Path) -> dict[int, Path]:
    """step -> its `step-N.tmp/` folder: the saves a kill (or a failure) left in `out`."""
    out = Path(out)
    return {int(m.group(1)): p for p in (out.iterdir() if out.is_dir() else [])
            if p.name.endswith(".tmp") and (m := STEP_DIR.match(p.name[:-4]))}


def recover(out: Path) -> list[str]:
    """Before a run reads `out` (its owner, before any rank starts): finish what a kill cut
    short. A commit killed between its renames: its new folder, marked complete, takes its
    place (else the one it replaced is put back). A prune killed inside its delete: the rest of
    the hidden folder goes. Returns a line for each folder put in place."""
    out, done = Path(out), []
    if not out.is_dir():
        return done
    for step, tmp in sorted(unfinished_saves(out).items()):
        final = step_dir(out, step)
        if not final.exists() and (tmp / COMPLETE).is_file():
            os.replace(tmp, final)
            done.append(f"{final}: its save was committed when the run stopped; put in place")
    for replaced in sorted(out.glob(".step-*.replaced")):
        final = out / replaced.name[1:-len(".replaced")]
        if not final.exists() and (replaced / COMPLETE).is_file():
            os.replace(replaced, final)
            done.append(f"{final}: put back (its replacement had not been committed)")
        else:
            shutil.rmtree(replaced, ignore_errors=True)
    for pruned in out.glob(".step-*.pruned"):
        shutil.rmtree(pruned, ignore_errors=True)
    return done


def decide(comm, error: BaseException | None, doing: str, value=None) -> list | None:
    """Collective: every rank's `value` on rank 0 (None on the others: what they make, only
    rank 0 writes), once every rank has said whether its step failed (`error`). If any did,
    every rank raises: the failing rank its own error, the others a `CheckpointError` naming
    the first rank that failed and its reason, in one line. Gathered to rank 0, which
    broadcasts the verdict: what another rank receives does not grow with the world."""
    parts = comm.gather_object((None if error is None else one_line(error), None if error is not None else value))
    failed = comm.broadcast_object(
        None if parts is None else next(((rank, why) for rank, (why, _) in enumerate(parts) if why is not None), None))
    if error is not None:
        raise error
    if failed is not None:
        raise CheckpointError(f"{doing}: rank {failed[0]} failed ({failed[1]})")
    return None if parts is None else [v for _, v in parts]


def first_problem(comm, problem: str | None) -> str | None:
    """Collective: the lowest rank's `problem` that is not None (None if every rank's is), on
    every rank: gathered to rank 0, which broadcasts the one."""
    every = comm.gather_object(problem)
    return comm.broadcast_object(None if every is None else next((p for p in every if p is not None), None))


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def check(folder: Path, comm) -> str | None:
    """Collective: None if `folder` is a good checkpoint, else what is wrong with it (the
    first bad file, as every rank agrees). Data files checked by item are checked here for
    their size only: their boxes' checksums are checked by the load that reads them."""
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
            elif "crc32" in d and file_crc(path) != d["crc32"]:  # else its boxes are checked as read
                problem = f"{name} fails its checksum (corrupted)"
            if problem:
                break
    return first_problem(comm, problem)


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
    outside = next((name for name in files if not plain_name(name)), None)
    if outside is not None:
        return f"{COMPLETE} names {outside!r}, which is not a file in the checkpoint's folder (a damaged marker?)"
    return None


def steps_in(out: Path, comm, run: str | None = None) -> list[int]:
    """Collective: the steps of the `step-N` folders with a marker that every rank sees (of
    run `run` only, when given), newest first."""
    every = comm.gather_object(set(steps_in_local(out, run)))
    return comm.broadcast_object(None if every is None else sorted(set.intersection(*every), reverse=True))


def prune(out: Path, keep: int, comm, run: str | None = None, upto: int | None = None) -> None:
    """Collective (rank 0 removes): all but the newest `keep` good-looking `step-N` folders
    (of run `run` only, when given: another run's are never touched; at or below step `upto`
    only, when given: the run's head, whose history `--keep` follows). Called after a save has
    completed on every rank. A folder is renamed out of the `step-N` names before it is
    deleted, so a kill inside the delete never leaves a marker without its files."""
    error = None
    if comm.mesh.is_main:
        try:
            steps = [s for s in steps_in_local(out, run) if upto is None or s <= upto]
            for step in steps[keep:]:
                doomed = _pruned(step_dir(out, step))
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(step_dir(out, step), doomed)
                shutil.rmtree(doomed)
        except Exception as e:
            error = e
    decide(comm, error, f"removing the checkpoints of {out} beyond --keep {keep}")


def steps_in_local(out: Path, run: str | None = None) -> list[int]:
    """The steps of the `step-N` folders with a marker that this rank sees (of run `run`
    only, when given), newest first."""
    out = Path(out)
    return sorted((int(m.group(1)) for p in (out.iterdir() if out.is_dir() else [])
                   if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()
                   and (run is None or run_of(p) == run)), reverse=True)


def run_of(checkpoint: Path) -> str:
    """The id of the run that wrote a checkpoint, from its `state.json` ("" when it was
    written before run ids existed, or cannot be read). `checkpoint.owner` says why."""
    try:
        run = json.loads((Path(checkpoint) / STATE).read_text()).get("run_id", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return run if isinstance(run, str) else ""
