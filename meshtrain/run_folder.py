"""A training run's `--out` around the loop: whose it is (`this_run`), what a resumed run must
share with the one that saved (`run_identity`), where it resumes and what a roll-back moves
aside (`resume`, `start_lineage`, over `checkpoint.lineage`), the checkpoints it writes
(`save`, `checkpoint_after`) and a SIGTERM's clean stop (`Preemption`, `Preempted`). Every
function here is collective: rank 0 decides or writes, and every rank learns the outcome, so
none is left waiting in a collective for one that failed alone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from meshtrain import faults
from meshtrain.checkpoint import folders, lineage, owner
from meshtrain.checkpoint.folders import CorruptCheckpoint
from meshtrain.checkpoint.sharded import CheckpointError, read_meta
from meshtrain.cli.run_model import imported_record
from meshtrain.comm import Comm
from meshtrain.cli.config import Config, lr_at
from meshtrain.data.tokenizer import TOKENIZER_FILE
from meshtrain.job import Job


class RunRefused(ValueError):
    """What a run cannot do, found once the ranks have started (every rank alike): one line."""


class Preempted(Exception):
    """A SIGTERM reached a rank: every rank saved the state after `step` in `folder`."""

    def __init__(self, step: int, folder: Path):
        super().__init__(f"stopped by SIGTERM after step {step}; saved {folder} (resume with --resume)")
        self.step, self.folder = step, folder


class Preemption:
    """Remembers a SIGTERM instead of dying of it, until `restore` (the main thread only)."""

    def __init__(self):
        self.seen = False
        self._before = None
        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame) -> None:
        self.seen = True

    def restore(self) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)



def run_identity(cfg: Config) -> dict:
    """What a resumed run must share with the run that saved: what defines the trained model —
    the model, the data, the global batch (the step is then the position in the data), the
    seed, dropout, and the optimizer's learning rate, warm-up, weight decay and clipping. The
    layout may differ, and so may `--steps` (the schedule is re-derived from it: `resume`)."""
    tr = cfg.train
    return {"model": cfg.model.name, "data": tr.data, "vocab_size": tr.vocab_size, "batch_size": tr.batch_size,
            "seq_len": tr.seq_len, "seed": tr.seed, "dropout": cfg.model.dropout, "pad_documents": tr.pad_documents,
            "lr": tr.lr, "warmup": tr.warmup, "weight_decay": tr.weight_decay, "clip": tr.clip}


def this_run(cfg: Config, comm: Comm) -> str:
    """Collective: the id of the run, as rank 0 knows it — from the command line, which
    claimed OUT before any rank started (`checkpoint.owner.claim`), or claimed here for a
    caller of `train` that did not (the same refusals, as `RunRefused`)."""
    tr = cfg.train

    def claimed():
        try:
            return os.environ.get(owner.RUN_ID_ENV) or owner.claim(
                Path(tr.out), resume=tr.resume, resume_from=tr.resume_from, overwrite=tr.overwrite, log=_say,
                restarted=faults.restart_count() > 0)
        except owner.OwnerError as e:
            return RunRefused(str(e))
    run = _on_rank_0_value(comm, claimed)
    if isinstance(run, RunRefused):
        raise run
    return run


def checkpoint_after(job: Job, cfg: Config, data, step: int, preemption: Preemption | None, run_id: str) -> None:
    """Collective, after `step` (1-based): its checkpoint when --save-every says so, and when
    any rank had seen a SIGTERM by the step's update (then `Preempted`, on every rank: the
    ranks agreed in the gradient norm's all-reduce, `Job.stop_requested`; a SIGTERM later
    than that is acted on after the next step)."""
    tr, rank = cfg.train, job.mesh.rank
    faults.inject("kill", rank, step)
    due = bool(tr.save_every) and (step % tr.save_every == 0 or step == tr.steps)
    if due:
        save(job, cfg, data, step, run_id, background=tr.async_save)
    if preemption is not None and job.stop_requested:
        if not due:
            save(job, cfg, data, step, run_id)
        job.wait_for_saves()
        folder, out = folders.step_dir(Path(tr.out), step), Path(tr.out)
        stopped = {"by": "SIGTERM", "step": step, "saved": str(folder), "at": time.time()}
        # What meshtrain's launcher reads to exit 0 after a clean stop.
        _on_rank_0(job.parallel.comm, f"writing {out / owner.RUN_FILE}",
                   lambda: owner.write_run(out, {**owner.read_run(out), "stopped": stopped}))
        raise Preempted(step, folder)


def save(job: Job, cfg: Config, data, step: int, run_id: str, background: bool = False) -> None:
    """Collective: the sharded checkpoint OUT/step-N; then this run's oldest beyond --keep
    removed. `background` (--async-save): written by a thread once the state is staged, the
    prune run there too, after the commit."""
    out, folder, main = Path(cfg.train.out), folders.step_dir(Path(cfg.train.out), step), job.mesh.is_main
    t0 = time.perf_counter()
    tokenizer = Path(getattr(data, "folder", None) or "", TOKENIZER_FILE)

    def then(comm) -> None:
        _on_rank_0(comm, f"writing {out / owner.RUN_FILE}", lambda: lineage.record_head(out, folder))
        if cfg.train.keep:  # the head's history: never a newer checkpoint of another branch
            folders.prune(out, cfg.train.keep, comm, run=run_id, upto=step)
        if main:
            print(f"meshtrain: saved {folder} in {time.perf_counter() - t0:.1f} s"
                  + (" (in the background)" if background else ""), file=sys.stderr)

    blocked = job.save(folder, run=run_identity(cfg), run_id=run_id, layout_flags=cfg.layout.short(),
                       config=cfg.to_dict(), vocab_size=getattr(data, "vocab_size", None),
                       files=[tokenizer] if tokenizer.is_file() else [], background=background, then=then,
                       pinned=False if cfg.train.async_pageable else None, **imported_record(cfg))
    if background and main:
        print(f"meshtrain: saving {folder} in the background (the step blocked {blocked:.2f} s)", file=sys.stderr)


def _on_rank_0(comm: Comm, doing: str, write) -> None:
    """Collective: `write()` on rank 0, then every rank raises if it failed (no rank is left
    waiting in a collective for one that left)."""
    error = None
    if comm.mesh.is_main:
        try:
            write()
        except Exception as e:
            error = e
    folders.decide(comm, error, doing)


def _say(msg: str) -> None:
    print(f"meshtrain: {msg}", file=sys.stderr)


def resume(job: Job, cfg: Config, run_id: str) -> tuple[int, str | None]:
    """Collective: with --resume or --resume-from, or after a restart, load the checkpoint
    (any layout's) that `lineage.resume_plan` names — the run's head and its history below it,
    a damaged one passed by for the one before — and return its step and folder; else (0,
    None). Everything that can refuse it is checked before the state is loaded, and nothing in
    OUT is written here: a refused resume leaves OUT as it was."""
    tr, comm = cfg.train, job.parallel.comm
    # A restarted replica group other than 0 (--ft-replicas) heals from a live group instead.
    restarted = faults.restart_count() > 0 and not (cfg.ft.replicas and cfg.ft.replica_id)
    if not (tr.resume or tr.resume_from or restarted):
        return 0, None
    say = _say if job.mesh.is_main else (lambda msg: None)
    plan = _on_rank_0_value(comm, lambda: lineage.resume_plan(
        Path(tr.out), run_id, resume=tr.resume, resume_from=tr.resume_from, restarted=restarted,
        job=lineage.job_id()))
    for folder in plan.folders:
        problem = folders.check(folder, comm)
        if problem is None:
            try:
                meta = _checked_load(job, cfg, folder)
                break
            except CorruptCheckpoint as e:  # a box failing its checksum as it loaded
                if plan.named:
                    raise
                problem = str(e).removeprefix(f"{folder}: ")
        if plan.named:
            raise CheckpointError(f"--resume-from {folder}: {problem}")
        say(f"checkpoint {folder}: {problem}; trying the one before")
    else:
        if plan.empty == "error":
            raise CheckpointError(f"--resume: no good checkpoint of run {run_id or '(unnamed)'} in {tr.out} "
                                  f"(write them with --save-every N)")
        if restarted:
            say(f"restart {faults.restart_count()}: no checkpoint of this run in {tr.out} yet; starting over")
        return 0, None
    planned = (meta.get("config") or {}).get("train", {}).get("steps")
    if isinstance(planned, int) and planned != tr.steps and job.lr_scheduler is None:
        say(f"--steps {tr.steps}: the saved run planned {planned}; its learning-rate schedule is re-derived from "
            f"{tr.steps} (at step {meta['steps'] + 1}: {lr_at(meta['steps'], tr):.3g}, where the saved plan had "
            f"{lr_at(meta['steps'], replace(tr, steps=planned)):.3g})")
    say(f"resumed from {folder} (step {meta['steps']}, saved as {meta.get('layout_flags', '?')})")
    return meta["steps"], str(folder)


def start_lineage(comm: Comm, out: Path, run_id: str, start: int, resumed_from: str | None) -> None:
    """Collective, once a resume at `start` is accepted (or a fresh run begins): rank 0 moves
    aside what the run's history no longer holds (`lineage.roll_back`: its checkpoints newer
    than `start`, and their log), then writes run.json with the head (the resumed checkpoint,
    or none) and this job's id, which restarts follow."""
    def write() -> None:
        rolled = lineage.roll_back(out, run_id, start)
        if rolled is not None:
            aside, later = rolled
            _say(f"rolled back to step {start}: moved this run's later checkpoints (step "
                 f"{', '.join(map(str, later))}) and their log records into {aside}")
        owner.write_run(out, {**owner.started_record(run_id, resumed_from=resumed_from, step=start),
                              lineage.HEAD: lineage.head_name(out, resumed_from), lineage.JOB: lineage.job_id()})
    _on_rank_0(comm, f"writing {out / owner.RUN_FILE}", write)


def _on_rank_0_value(comm: Comm, decide):
    """Collective: what `decide()` returns on rank 0, on every rank (one decision, so every rank
    reads the same checkpoints; broadcast: what a rank receives does not grow with the world)."""
    return comm.broadcast_object(decide() if comm.mesh.is_main else None)


def _checked_load(job: Job, cfg: Config, folder: Path) -> dict:
    """Collective: the checkpoint in `folder` (checked good: `folders.check`) loaded, once
    what the run's identity and --steps ask of it hold; its saved facts."""
    tr, meta = cfg.train, read_meta(folder)
    saved, mine = meta.get("run", {}), run_identity(cfg)
    for key in mine:
        if key in saved and saved[key] != mine[key]:
            raise CheckpointError(f"{folder} was saved by a run with {key} {saved[key]!r}, not {mine[key]!r}; "
                                  f"resume with the same model, data, global batch and optimizer settings "
                                  f"(the layout and --steps may differ)")
    if meta["steps"] >= tr.steps:
        raise CheckpointError(f"{folder} is at step {meta['steps']}, and --steps is {tr.steps}: nothing left to "
                              f"train; raise --steps")
    return job.load(folder, check=False)
