"""Who an output folder belongs to: one run. A fresh run draws a run id; it is written in
`OUT/run.json` and in every checkpoint's `state.json`, so `--keep` prunes, and restarts and
`--resume` take, only that run's checkpoints. A fresh run into a folder that holds another
run's checkpoints is refused before any rank starts (or, with `--overwrite`, those are moved
aside into `OUT/replaced-<time>/`, never deleted).

A run is a lineage: a resumed run keeps the id of the run it continues (`--resume-from` a
folder elsewhere included), so its new checkpoints sit beside the old ones as one run's.
Checkpoints written before run ids existed belong to the unnamed run "".

Reading a checkpoint's run needs no torch: the command line decides before any rank starts."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

from meshtrain.atomic import atomic_write
from meshtrain.checkpoint.aside import ASIDE_PREFIX, move_into_aside
from meshtrain.checkpoint.folders import recover, run_of, step_dir, steps_in_local, unfinished_saves
from meshtrain.checkpoint.weight_files import WEIGHTS

RUN_FILE = "run.json"  # the run's id and start; at its end also its configuration (`cli.run_model.save_model`)
RUN_ID_ENV = "MESHTRAIN_RUN_ID"  # how meshtrain's launcher hands the run id to its ranks
METRICS_FILE = "metrics.jsonl"  # the run's log, a record a step (`metrics.StepLog`)
# What a fresh run moves aside with --overwrite besides the checkpoints: the old run's record.
RUN_RECORDS = (RUN_FILE, METRICS_FILE, "loss.png", "tensorboard", WEIGHTS)


class OwnerError(ValueError):
    """The folder belongs to another run, or holds no run to resume: one line naming the ways out."""


def new_run_id() -> str:
    """A fresh run's id: when it started, and 8 random hex digits."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def runs_in(out: Path) -> dict[str, list[int]]:
    """The runs whose finished checkpoints `out` holds: run id -> steps, newest first."""
    found: dict[str, list[int]] = {}
    for step in steps_in_local(Path(out)):
        found.setdefault(run_of(step_dir(out, step)), []).append(step)
    return found


def read_run(out: Path) -> dict:
    """`OUT/run.json` ({} when there is none or it is unreadable)."""
    try:
        record = json.loads((Path(out) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_run(out: Path, record: dict) -> None:
    """`OUT/run.json`, replaced whole (a reader never sees half of it)."""
    atomic_write(Path(out) / RUN_FILE, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n"))


def _describe(runs: dict[str, list[int]]) -> str:
    return "; ".join(f"run {run or '(unnamed)'}: step {', '.join(map(str, steps[:3]))}"
                     f"{' ...' if len(steps) > 3 else ''}" for run, steps in runs.items())


def claim(out: Path, *, resume: bool, resume_from: str | None, overwrite: bool,
          log: Callable[[str], None], restarted: bool = False) -> str:
    """Before any rank starts: the id of the run about to train into `out`, or `OwnerError`.
    - a fresh run: a new id; `out` may hold no checkpoint of another run (`--overwrite`
      moves them, and the old run's log, aside);
    - `--resume`: the run of `run.json` when its checkpoints are there, else the one run found;
    - `--resume-from`: the run of that checkpoint; `out` may hold no other run's checkpoints.
    - a restart (by an outside launcher, whose rank 0 claims again): the run of `run.json`.
    Nothing in `out` changes here except what `--overwrite` moves aside, and a commit or a
    prune that a kill cut short, finished first (`folders.recover`, one line each)."""
    out = Path(out)
    for line in recover(out):
        log(line)
    if restarted:
        return read_run(out).get("run_id") or new_run_id()
    runs = runs_in(out)
    if resume:
        recorded = read_run(out).get("run_id")
        if recorded in runs:
            return recorded
        if len(runs) == 1:
            return next(iter(runs))
        raise OwnerError(f"--resume: {out} holds checkpoints of {len(runs)} runs ({_describe(runs)}) and its "
                         f"{RUN_FILE} names none of them; name one with --resume-from {out}/step-N")
    run = run_of(Path(resume_from)) if resume_from else new_run_id()
    others = {r: steps for r, steps in runs.items() if r != run}
    if not others:
        return run
    if resume_from:  # --overwrite is a fresh run's (the command line refuses it with --resume-from)
        raise OwnerError(f"--out {out} holds another run's checkpoints ({_describe(others)}); resume "
                         f"{resume_from} into another --out, or continue that run with --resume")
    if not overwrite:
        raise OwnerError(f"--out {out} holds another run's checkpoints ({_describe(others)}); continue that run "
                         f"with --resume, choose another --out, or pass --overwrite to move them aside into "
                         f"{out}/{ASIDE_PREFIX}<time>/")
    aside = move_aside(out, [step for steps in others.values() for step in steps])
    log(f"--overwrite: moved {_describe(others)} and the old run's records into {aside}")
    return run


def move_aside(out: Path, steps: list[int]) -> Path:
    """Move the given checkpoints of `out`, its unfinished saves and the old run's records
    into a new `out/replaced-<time>/` (renames: nothing is copied or deleted)."""
    out = Path(out)
    moved = {step_dir(out, s).name for s in steps}
    moved |= {tmp.name for tmp in unfinished_saves(out).values()}
    moved |= {name for name in RUN_RECORDS if (out / name).exists()}
    return move_into_aside(out, moved)


def started_record(run_id: str, *, resumed_from: str | None, step: int, argv: list[str] | None = None) -> dict:
    """What `OUT/run.json` says of a run that has just started or resumed."""
    return {"run_id": run_id, "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "resumed_from": resumed_from, "first_step": step, **({"argv": argv} if argv is not None else {})}

