"""A run's history follows its head (`checkpoint.lineage`), and a kill at any point of a
commit or a prune leaves the run folder whole (`folders.recover`): unit tests without ranks.
The whole scenarios, with ranks, restarts and signals, are in test_run_folder.py."""

import json
import os
from pathlib import Path

import torch

from meshtrain.checkpoint import folders, lineage, owner
from meshtrain.comm import Comm
from meshtrain.mesh import Mesh

COMM = Comm(Mesh.single(torch.device("cpu")))


def _save(out: Path, step: int, payload: bytes, run: str = "r1") -> Path:
    def write_files(tmp: Path) -> dict:
        (tmp / folders.STATE).write_text(json.dumps({"run_id": run}))
        return {"data": folders.write_synced(tmp / "data", payload)}
    folders.write(folders.step_dir(out, step), COMM, write_files)
    return folders.step_dir(out, step)


def test_a_commit_killed_between_its_renames_is_finished_or_put_back(tmp_path):
    _save(tmp_path, 2, b"old")
    _save(tmp_path, 4, b"new")  # stands for the new step-2's save, committed up to its marker
    # The kill: the old step-2 renamed away, the new one not yet renamed into place.
    os.replace(tmp_path / "step-2", tmp_path / ".step-2.replaced")
    os.replace(tmp_path / "step-4", tmp_path / "step-2.tmp")
    assert folders.steps_in_local(tmp_path) == []
    assert len(folders.recover(tmp_path)) == 1
    assert (tmp_path / "step-2" / "data").read_bytes() == b"new" and folders.check(tmp_path / "step-2", COMM) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]

    # Killed before the new one's marker: the old one is put back.
    os.replace(tmp_path / "step-2", tmp_path / ".step-2.replaced")
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-2.tmp" / "data").write_bytes(b"half")
    folders.recover(tmp_path)
    assert (tmp_path / "step-2" / "data").read_bytes() == b"new" and folders.steps_in_local(tmp_path) == [2]


def test_prune_renames_before_deleting_and_keeps_what_is_above_the_head(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, b"x")
    folders.prune(tmp_path, 1, COMM, run="r1", upto=4)  # the head is step-4: step-6 and 8 are not its history
    assert folders.steps_in_local(tmp_path) == [8, 6, 4]
    # A prune killed inside its delete leaves a hidden folder, never a `step-N` with a marker
    # and no data; the next owner removes it.
    (tmp_path / ".step-2.pruned").mkdir()
    (tmp_path / ".step-2.pruned" / folders.COMPLETE).write_text("{}")
    assert folders.steps_in_local(tmp_path) == [8, 6, 4]
    folders.recover(tmp_path)
    assert not (tmp_path / ".step-2.pruned").exists()


def test_resume_and_restarts_follow_the_head_and_the_job_that_wrote_it(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, b"x")
    owner.write_run(tmp_path, {"run_id": "r1", lineage.HEAD: "step-4", lineage.JOB: "job-a"})
    plan = lineage.resume_plan(tmp_path, "r1", resume=True, resume_from=None, restarted=False)
    assert plan.folders == (tmp_path / "step-4", tmp_path / "step-2") and plan.empty == "error"
    # A restart of the job that wrote the head follows it...
    same = lineage.resume_plan(tmp_path, "r1", resume=False, resume_from=str(tmp_path / "step-2"), restarted=True,
                               job="job-a")
    assert same.folders[0] == tmp_path / "step-4" and not same.named
    # ... one whose ranks died before writing theirs does what its job was asked first.
    other = lineage.resume_plan(tmp_path, "r1", resume=False, resume_from=str(tmp_path / "step-2"), restarted=True,
                                job="job-b")
    assert other.folders == (tmp_path / "step-2",) and other.named
    # A folder written before heads existed: the run's newest first, as before.
    owner.write_run(tmp_path, {"run_id": "r1"})
    assert lineage.resume_plan(tmp_path, "r1", resume=True, resume_from=None, restarted=False).folders[0] == \
        tmp_path / "step-6"
    # A head outside OUT (a resume from elsewhere, before its first commit) is followed alone.
    owner.write_run(tmp_path, {"run_id": "r1", lineage.HEAD: lineage.head_name(tmp_path, "/elsewhere/step-9"),
                               lineage.JOB: "job-a"})
    assert lineage.resume_plan(tmp_path, "r1", resume=True, resume_from=None, restarted=False).folders == \
        (Path("/elsewhere/step-9"),)


def test_a_roll_back_moves_later_checkpoints_and_their_log_aside(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, b"x")
    _save(tmp_path, 8, b"x", run="someone-else")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    aside, later = lineage.roll_back(tmp_path, "r1", 2)
    assert later == [6, 4] and folders.steps_in_local(aside) == [6, 4]
    assert folders.steps_in_local(tmp_path) == [8, 2]  # another run's are not this run's history
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == [3, 4, 5, 6]
    assert lineage.roll_back(tmp_path, "r1", 2) is None  # nothing later: nothing moved
