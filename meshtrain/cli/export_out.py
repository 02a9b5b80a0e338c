"""Where `meshtrain export` writes (`--out`): never over a model unless asked, never over a
training run, never over what the export reads. Every refusal — `OutRefused`, or the lock's
`OutLocked` — comes before anything is written.

- A non-empty --out is refused unless --overwrite, which renames everything there into
  `OUT/replaced-<time>/` (`checkpoint.aside`) once every check, the checkpoint's included,
  has passed: the folder then holds the new export alone (no old shard, index or tokenizer
  beside it for a loader to mix in), and nothing is deleted.
- A training run's --out (step-N checkpoints, a run.json naming a run id, metrics.jsonl) and
  a checkpoint folder are refused even with --overwrite: those files are the run's lineage,
  which --resume, restarts and --keep follow. Moving them aside for an export would cut the
  run off, and writing beside them would replace its final model and its run.json; a folder
  of its own (inside the run's folder, if wished) loses nothing.
- The --ckpt folder (or one holding it) and the --init-from folder of the run that saved it
  (or one holding it) are refused even with --overwrite: the export reads the first, and the
  second is the model the run fine-tuned. A relative --init-from is taken from here.
- The export holds the folder's lock (`checkpoint.lock`) while it writes: a folder a live
  job holds is refused, and no run starts into it meanwhile."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from meshtrain.checkpoint.aside import ASIDE_PREFIX, move_into_aside
from meshtrain.checkpoint.folders import COMPLETE, STATE, STEP_DIR
from meshtrain.checkpoint.lock import OutLock, is_lock_file
from meshtrain.checkpoint.owner import METRICS_FILE, RUN_FILE, read_run



class OutRefused(ValueError):
    """--out cannot take this export: one line naming the flag to change."""


@contextmanager
def writing_into(out: Path, ckpt: Path, *, overwrite: bool, log: Callable[[str], None]) -> Iterator[Callable[[], None]]:
    """Hold `out` for an export of `ckpt`, or refuse it (see above) before anything is written.
    Yields `ready()`, for the export to call once its own checks passed, before its first
    write: it moves the old files aside (--overwrite) and makes the folder."""
    out, ckpt = Path(out), Path(ckpt)
    _refuse_sources(out, ckpt)
    lock = _lock(out, log) if out.is_dir() else None
    try:
        moved = _files_to_move(out, overwrite)

        def ready() -> None:
            nonlocal lock
            if moved:
                log(f"--overwrite: moved {len(moved)} file(s) of {out} into {move_into_aside(out, moved)}")
            out.mkdir(parents=True, exist_ok=True)
            lock = lock or _lock(out, log)
        yield ready
    finally:
        if lock is not None:
            lock.release(remove=True)


def _within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def _refuse_sources(out: Path, ckpt: Path) -> None:
    """The folders the export reads or was made from are never written over."""
    if _within(ckpt, out):
        what = "is" if out.resolve() == ckpt.resolve() else "holds"
        raise OutRefused(f"--out {out} {what} --ckpt {ckpt}, which the export reads; choose another --out")
    init_from = _init_from(ckpt)
    if init_from and _within(Path(init_from), out):
        raise OutRefused(f"--out {out}: the run that saved {ckpt} fine-tuned {init_from} (--init-from), which is "
                         f"never written over, even with --overwrite; choose another --out")


def _init_from(ckpt: Path) -> str | None:
    """The --init-from folder of the run that saved `ckpt` (in a checkpoint's state.json, or
    a run folder's or export's run.json), None when there is none."""
    for name in (STATE, RUN_FILE):
        try:
            config = json.loads((ckpt / name).read_text()).get("config") or {}
            return (config.get("model") or {}).get("init_from")
        except (OSError, ValueError, AttributeError):
            continue
    return None


def _lock(out: Path, log) -> OutLock:
    try:
        return OutLock(out, log).acquire()
    except OSError as e:  # a folder of someone else's, a read-only file system
        raise OutRefused(f"--out {out}: cannot write there ({e.strerror or e}); choose another folder") from None


def _files_to_move(out: Path, overwrite: bool) -> list[str]:
    """What --overwrite moves aside: everything in `out` but earlier `replaced-*` folders and
    the lock; refuses a run's folder, and a non-empty one without --overwrite."""
    if not out.exists():
        return []
    if not out.is_dir():
        raise OutRefused(f"--out {out} is a file; give a folder")
    run = _run_in(out)
    if run:
        raise OutRefused(f"--out {out} {run}: an export never writes over a run's files nor moves them aside, even "
                         f"with --overwrite (--resume and --keep follow them); choose another --out")
    names = sorted(p.name for p in out.iterdir() if not is_lock_file(p.name) and not p.name.startswith(ASIDE_PREFIX))
    if names and not overwrite:
        shown = names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        raise OutRefused(f"--out {out} is not empty ({shown}); choose another --out, or pass --overwrite to move "
                         f"its files aside into {out}/{ASIDE_PREFIX}<time>/")
    return names


def _run_in(out: Path) -> str | None:
    """What makes `out` a training run's folder or a checkpoint; None when it is neither."""
    if (out / COMPLETE).exists():
        return "is a checkpoint"
    steps = sorted(p.name for p in out.iterdir() if STEP_DIR.match(p.name.removesuffix(".tmp")))
    if steps:
        return f"holds a training run's checkpoints ({', '.join(steps[:3])}{' ...' if len(steps) > 3 else ''})"
    run = read_run(out).get("run_id")
    if run:
        return f"is the folder of training run {run} ({RUN_FILE})"
    return f"holds a training run's {METRICS_FILE}" if (out / METRICS_FILE).exists() else None
