"""A run owns its --out: another run's checkpoints are refused (or moved aside), --keep and
--resume see only the run's own, a refused resume changes nothing, one job at a time holds
the folder, and the launcher's ranks end with it."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from helpers import TINY, is_running, ranks_of, run_cli, run_main, start_cli

from meshtrain.faults import FAULT_ENV

from meshtrain import report
from meshtrain.checkpoint import folders, owner
from meshtrain.checkpoint.lock import is_lock_file


def _snapshot(out: Path) -> dict:
    """Every file under `out` with its bytes: what must not change (the lease aside: each job
    that holds the folder, refused or not, takes the next one)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
            and not is_lock_file(p.name)}


def _train(out, *flags, **kw):
    return run_cli("train", *TINY, "--dp", "1", "--out", out, *flags, **kw)


def _train_here(out, *flags):
    """A one-rank run through the command line's `main` in this process: the same claims,
    refusals, resumes and prunes as `_train`'s command, without its interpreter."""
    return run_main("train", *TINY, "--dp", "1", "--out", out, *flags)


def test_a_fresh_run_into_another_runs_out_is_refused_and_a_refused_resume_changes_nothing(tmp_path):
    out = tmp_path / "run"
    assert _train_here(out, "--steps", "4", "--save-every", "2", "--keep", "1").returncode == 0
    first = owner.read_run(out)["run_id"]
    assert folders.steps_in_local(out) == [4] and folders.run_of(out / "step-4") == first
    before = _snapshot(out)
    refusals = [
        (["--steps", "4"], "holds another run's checkpoints"),  # a fresh run
        (["--steps", "6", "--resume", "--lr", "0.002"], "lr 0.001, not 0.002"),
        (["--steps", "6", "--resume", "--warmup", "3"], "warmup 20, not 3"),
        (["--steps", "4", "--resume"], "nothing left to train"),
    ]
    for flags, said in refusals:
        r = _train_here(out, *flags)
        assert r.returncode == 2 and said in r.stderr, (flags, r.stderr)
        assert _snapshot(out) == before, flags  # the log (4 records), run.json, the checkpoint
    assert "--overwrite" in _train_here(out, "--steps", "4").stderr

    r = _train_here(out, "--steps", "6", "--resume")
    assert r.returncode == 0, r.stderr
    assert "re-derived from 6" in r.stderr  # --steps may grow: the schedule follows it, and says so
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in log] == [1, 2, 3, 4, 5, 6]
    assert owner.read_run(out)["run_id"] == first and owner.read_run(out)["resumed_from"].endswith("step-4")

    r = _train_here(out, "--steps", "2", "--save-every", "1", "--keep", "1", "--overwrite")
    assert r.returncode == 0, r.stderr
    aside, = out.glob("replaced-*")
    assert folders.steps_in_local(aside) == [4] and (aside / "metrics.jsonl").is_file()
    assert folders.steps_in_local(out) == [2] and owner.read_run(out)["run_id"] != first


def test_keep_and_resume_see_only_this_runs_checkpoints(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert _train_here(ours, "--steps", "4", "--save-every", "2").returncode == 0
    assert _train_here(theirs, "--steps", "6", "--save-every", "6").returncode == 0
    shutil.copytree(theirs / "step-6", ours / "step-6")  # a newer checkpoint of another run
    r = _train_here(ours, "--steps", "5", "--save-every", "5", "--keep", "1", "--resume")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ours}/step-4" in r.stderr  # not the newer step-6
    assert folders.steps_in_local(ours) == [6, 5]  # ours pruned to one; theirs untouched
    assert folders.run_of(ours / "step-6") == owner.read_run(theirs)["run_id"]


def test_the_whole_log_is_plotted_after_a_resume(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n"
                                                    for s in range(1, 7)))
    drawn = {}
    monkeypatch.setattr(report, "plot_losses", lambda steps, losses, path, title, val_losses=(): drawn.update(
        steps=steps, losses=losses))

    class Resumed:  # the resumed run's own result holds steps 5 and 6 only
        losses, first_step, val_losses = [1.0, 0.0], 5, []
    report.plot_run(Resumed, tmp_path, "t")
    assert drawn["steps"] == [1, 2, 3, 4, 5, 6]


def test_one_job_per_out_and_a_killed_launchers_lock_and_ranks(tmp_path):
    out = tmp_path / "run"
    launcher = start_cli("train", *TINY, "--dp", "2", "--steps", "5000", "--save-every", "4000", "--out", out,
                         stdout=os.devnull, stderr=os.devnull)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.2)
    second = _train(out, "--steps", "4")
    assert second.returncode == 2, second.stderr
    assert f"in use by another meshtrain job (host {os.uname().nodename}, pid {launcher.pid}, since" in second.stderr
    ranks = list(ranks_of(launcher.pid).values())
    assert len(ranks) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(is_running(p) for p in ranks):
        time.sleep(0.2)
    assert not any(is_running(p) for p in ranks)  # the ranks ended with their launcher
    assert not _lease(out)["released"]  # left held by the kill
    r = _train(out, "--steps", "2", "--overwrite")
    assert r.returncode == 0, r.stderr
    assert f"took over the lock of a run that is gone (host {os.uname().nodename}, pid {launcher.pid}" in r.stderr
    assert _lease(out)["released"]  # the newest lease, the second run's, given back at its end


def _lease(out: Path) -> dict:
    """The one lease file of `out` (earlier ones are removed by the job that takes the next)."""
    leases = [p for p in out.iterdir() if p.name.startswith(".lock.")]
    assert len(leases) == 1, leases
    return {"released": False, **json.loads(leases[0].read_text())}


def _logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_roll_back_keeps_its_point_restarts_on_its_own_branch_and_resume_continues_it(tmp_path):
    """Run A saves step-4 and step-8; a roll-back to step-4 with --keep 2 whose rank 0 is
    killed at step 7: the roll-back point is kept, A's step-8 is moved aside with its log, the
    restart resumes the roll-back's own step-6 (and the launcher says so), and a later
    --resume continues the new branch."""
    out = tmp_path / "run"
    assert _train(out, "--dp", "2", "--steps", "8", "--save-every", "4").returncode == 0
    run = owner.read_run(out)["run_id"]
    assert owner.read_run(out)["head"] == "step-8" and _logged_steps(out) == list(range(1, 9))
    abandoned = (out / "step-8" / folders.COMPLETE).read_bytes()

    r = _train(out, "--dp", "2", "--steps", "10", "--resume-from", out / "step-4", "--save-every", "2",
               "--keep", "2", "--max-restarts", "1", env={FAULT_ENV: "kill:0:7"})
    assert r.returncode == 0, r.stderr
    aside, = out.glob("rolled-back-*")
    assert f"rolled back to step 4: moved this run's later checkpoints (step 8) and their log records into {aside}" \
        in r.stderr
    assert folders.steps_in_local(aside) == [8] and (aside / "step-8" / folders.COMPLETE).read_bytes() == abandoned
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == [5, 6, 7, 8]
    assert (aside / "model.safetensors").is_file()  # A's final model: the abandoned branch's
    assert f"restart 1 of 1, from {out}/step-6" in r.stderr
    assert f"resumed from {out}/step-6 (step 6" in r.stderr
    assert folders.steps_in_local(out) == [10, 8]  # --keep 2 of the new branch; step-4 pruned only now
    assert owner.read_run(out)["head"] == "step-10" and owner.read_run(out)["run_id"] == run
    assert _logged_steps(out) == list(range(1, 11))  # each step of the kept history once

    r = _train(out, "--dp", "2", "--steps", "12", "--resume", "--save-every", "2", "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {out}/step-10 (step 10" in r.stderr
    assert _logged_steps(out) == list(range(1, 13))


def test_a_sigterm_stop_logs_its_saved_step_and_a_resume_logs_each_step_once(tmp_path):
    out = tmp_path / "run"
    r = _train(out, "--dp", "2", "--steps", "6", "--save-every", "100", env={FAULT_ENV: "term:1:3"})
    assert r.returncode == 0 and "stopped by SIGTERM after step 3" in r.stderr, r.stderr
    assert _logged_steps(out) == [1, 2, 3] and owner.read_run(out)["head"] == "step-3"
    r = _train(out, "--dp", "2", "--steps", "6", "--resume")
    assert r.returncode == 0, r.stderr
    assert _logged_steps(out) == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow  # a real torchrun and its restart (20 s); its restarted workers once failed to join (torchrun's
# store kept the dead attempt's addresses), which make test emulates in test_restart_store.py
def test_a_torchrun_restart_resumes_its_own_jobs_head(tmp_path):
    """Under an outside launcher (torchrun --max-restarts) rank 0 claims again on a restart:
    the restarted ranks follow the head their own job wrote, not the roll-back's point."""
    out = tmp_path / "run"
    assert _train(out, "--steps", "4", "--save-every", "2").returncode == 0
    r = run_cli("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "meshtrain", "train", *TINY,
                "--dp", "2", "--steps", "6", "--out", out, "--resume-from", out / "step-2", "--save-every", "1",
                launcher=("-m", "torch.distributed.run"), env={FAULT_ENV: "kill:0:4"})
    assert r.returncode == 0, r.stderr
    assert f"resumed from {out}/step-2 (step 2" in r.stderr and f"resumed from {out}/step-3 (step 3" in r.stderr
    assert owner.read_run(out)["head"] == "step-6" and _logged_steps(out) == list(range(1, 7))
    aside, = out.glob("rolled-back-*")
    assert folders.steps_in_local(aside) == [4]
