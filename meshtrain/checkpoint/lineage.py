"""A run's history is a lineage, not the largest step number.

`OUT/run.json` records the run's head: the checkpoint it resumed from until it commits one of
its own, then the last one it committed (`record_head`, after each commit). `--resume`, a
restart and `--keep` follow the head: they see the run's checkpoints at or below it
(`resume_plan`, `lineage_steps`). Rolling back — resuming from a checkpoint older than the
run's newest, `--resume-from OUT/step-N` of its own folder say — moves the run's later
checkpoints, and the steps they logged, into `OUT/rolled-back-<time>/` (`roll_back`: renames,
nothing deleted) before the new branch writes its head, so that a later `--resume` continues
the new branch and never the abandoned one.

A restart (meshtrain's `--max-restarts`, or an outside torchrun's) resumes from the head that
its own job's ranks wrote (`JOB`, one id per launch of the job, the same in each of its
restarts: `job_id`); when they died before writing any (a failed load, say), the restart does
what the job was first asked to do. The launcher reads the same plan to say where a restart
resumes. Torch-free: the command line reads it before any rank starts."""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from meshtrain.atomic import atomic_write
from meshtrain.checkpoint.aside import move_into_aside
from meshtrain.checkpoint.folders import STEP_DIR, run_of, step_dir, steps_in_local, unfinished_saves
from meshtrain.checkpoint.owner import METRICS_FILE, read_run, write_run
from meshtrain.checkpoint.weight_files import WEIGHTS as FINAL_WEIGHTS  # a finished run's model

HEAD = "head"  # run.json's key: "step-N" inside OUT, an absolute path outside it, or null (nothing yet)
JOB = "job"  # run.json's key: the launch whose ranks wrote the record
JOB_ENV = "MESHTRAIN_JOB_ID"  # set by the process that owns OUT for meshtrain's own launcher's ranks
ROLLED_BACK_PREFIX = "rolled-back-"


def job_id() -> str:
    """This launch of the job, the same in each of its restarts: meshtrain's launcher hands its
    ranks an id; torchrun's run id (`--rdzv-id`, random under `--standalone`) names every
    node's workers alike; else the host and the agent's pid (the parent of every attempt's
    workers)."""
    torchrun = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return os.environ.get(JOB_ENV) or (f"torchrun:{torchrun}" if torchrun not in ("", "none") else
                                       f"{socket.gethostname()}:{os.getppid()}")


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def head_name(out: Path, folder: Path | str | None) -> str | None:
    """How run.json names a head: its folder name when it is OUT's, else its absolute path."""
    if folder is None:
        return None
    folder = Path(folder)
    inside = folder.parent.resolve() == Path(out).resolve() and STEP_DIR.match(folder.name)
    return folder.name if inside else str(folder.resolve())


def head_folder(out: Path, record: dict) -> Path | None:
    """The head run.json names, as a folder (None when it names none)."""
    head = record.get(HEAD)
    if not isinstance(head, str) or not head:
        return None
    return Path(out) / head if STEP_DIR.match(head) else Path(head)


def record_head(out: Path, folder: Path) -> None:
    """Rank 0, once `folder` is committed: it is the run's head."""
    write_run(out, {**read_run(out), HEAD: head_name(out, folder)})


def lineage_steps(out: Path, run: str, record: dict) -> list[int]:
    """The steps of the run's checkpoints in OUT that its head's history holds, newest first:
    those at or below the head; none when the head is null or outside OUT; every one of the
    run's when run.json records no head (a folder written before heads existed)."""
    steps = steps_in_local(Path(out), run)
    if HEAD not in record:
        return steps
    head = record.get(HEAD)
    m = STEP_DIR.match(head) if isinstance(head, str) else None
    return [s for s in steps if s <= int(m.group(1))] if m else []


@dataclass(frozen=True)
class ResumePlan:
    """Where a run (re)starts: the checkpoints to try, in order (a damaged one is passed by for
    the next), or none. `named`: the first is what the user named (--resume-from): a damaged
    one is refused, not passed by. `empty`: what having none means: "start" (a fresh run, or a
    restart before its first checkpoint) or "error" (--resume with nothing to resume)."""
    folders: tuple[Path, ...]
    named: bool = False
    empty: str = "start"

    def describe(self) -> str:
        return f"{self.folders[0]}" + (" (or the newest good one before it)" if len(self.folders) > 1 else "") \
            if self.folders else "the start (no checkpoint of this run yet)"


def resume_plan(out: Path, run: str, *, resume: bool, resume_from: str | None, restarted: bool,
                job: str | None = None) -> ResumePlan:
    """Where the ranks resume. A restart of the job whose ranks wrote run.json: its head, then
    the lineage below it. Otherwise as asked: --resume-from's folder; --resume: the head, then
    the lineage below it; a fresh run: the start."""
    out, record = Path(out), read_run(out)
    if restarted and job is not None and record.get(JOB) == job:
        return _following_head(out, run, record, empty="start")
    if resume_from:
        return ResumePlan((Path(resume_from),), named=True)
    if resume:
        return _following_head(out, run, record, empty="error")
    return ResumePlan(())


def _following_head(out: Path, run: str, record: dict, empty: str) -> ResumePlan:
    if record.get("run_id", run) != run:  # run.json is another run's: this run's newest first
        record = {}
    head = head_folder(out, record)
    below = [step_dir(out, s) for s in lineage_steps(out, run, record)]
    first = [head] if head is not None else []
    return ResumePlan(tuple(first + [f for f in below if f != head]), empty=empty)


def later_steps(out: Path, run: str, step: int) -> list[int]:
    """The run's checkpoints in OUT newer than `step`: what resuming at `step` abandons."""
    return [s for s in steps_in_local(Path(out), run) if s > step]


def roll_back(out: Path, run: str, step: int) -> tuple[Path, list[int]] | None:
    """Rank 0, once a resume at `step` is accepted: move the run's checkpoints in OUT newer than
    `step`, their unfinished saves and the records the log keeps of steps after `step`, into a
    new `OUT/rolled-back-<time>/` (renames: nothing deleted); None when there are none."""
    out = Path(out)
    later = later_steps(out, run, step)
    if not later:
        return None
    names = {step_dir(out, s).name for s in later}
    names |= {tmp.name for s, tmp in unfinished_saves(out).items() if s > step and run_of(tmp) in (run, "")}
    if _finished_after(read_run(out), step) and (out / FINAL_WEIGHTS).is_file():
        names.add(FINAL_WEIGHTS)  # the abandoned branch's final model
    aside = move_into_aside(out, names, prefix=ROLLED_BACK_PREFIX)
    _split_log(out / METRICS_FILE, aside / METRICS_FILE, step)
    return aside, later


def _finished_after(record: dict, step: int) -> bool:
    """Whether run.json says its last attempt finished (its configuration is written at the
    end) with more steps than `step`."""
    steps = ((record.get("config") or {}).get("train") or {}).get("steps")
    return isinstance(steps, int) and steps > step


def _split_log(log: Path, aside: Path, step: int) -> None:
    """The log's records of steps after `step` into `aside`; the others stay (replaced whole)."""
    if not log.is_file():
        return
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    later = [line for line in lines if _step_of(line) > step]
    if later:
        aside.write_text("".join(line + "\n" for line in later))
        atomic_write(log, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines
                                                                 if _step_of(line) <= step)))


def _step_of(line: str) -> int:
    try:
        step = json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return 0
    return step if isinstance(step, int) else 0
