"""`verify --resume-at K [--resume-layout L]` (and `meshtrain.verify(..., resume_at=,
resume_layout=)`): the layout trains steps 1..K and saves, a second layout loads the
checkpoint and trains K+1..N, and the whole run is checked against one process trained
straight through — lockstep at the sampled steps (K and K+1 among them) with verify's
tolerances, and the state after the load equal to the state saved, bit for bit.

The matrix runs both parts in the same spawned ranks (`verifier.record_resumed`, as under
a launcher); one test goes through the command line, whose parent starts each part's own
ranks. Two mutants must fail it: optimizer groups applied by position on load, and a resume
that leaves the random-number state as it was."""

from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from distributed import run_ranks
from helpers import TINY, last_json, run_cli, verdict
from test_api import TinyLM, batches

import meshtrain
from meshtrain.cli import config as C
from meshtrain.cli.resume_at import resumed_config
from meshtrain.cli.validate import validate
from meshtrain.parallel.options import parse_layout
from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.job import Job

STEPS, AT = 5, 2  # lockstep at steps 1, 2 (saved after it), 3 (the first resumed) and 5


def resume_config(resume_layout: str | None, **layout) -> C.Config:
    c = C.Config()
    c.model.name = "gpt-test"
    c.layout.dp, c.layout.bucket_mb = 2, 0.02  # several buckets
    for k, v in layout.items():
        setattr(c.layout, k, v)
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size = STEPS, 8, 32, 256
    c.train.warmup, c.train.device = 1, "cpu"
    c.train.resume_at, c.train.resume_layout = AT, resume_layout
    validate(c)
    return c


def _resumed_record(mesh, cfg, second):
    return verify.record_resumed(cfg, second, Comm(mesh), "layout")


# name -> (the first layout, its mesh axes for run_ranks, the resume layout)
MATRIX = {
    "dp2 -> tp2": (resume_config("tp=2"), {}),
    "dp2-zero3 -> pp2": (resume_config("pp=2 microbatches=2", zero=3), {}),
    "tp2-sp -> dp2-zero2": (resume_config("dp=2 zero=2", dp=1, tp=2, sp=True), {"tp": 2}),
    # in the same world: a loaded entry's keys come in the checkpoint index's order, which
    # differs between tensors (ZeRO's state stream once paired ranks' keys by that order)
    "dp2 -> dp2-zero1": (resume_config("dp=2 zero=1"), {}),
    "dp2 -> dp2-zero3": (resume_config("dp=2 zero=3"), {}),
}


@pytest.mark.parametrize("name", MATRIX)
def test_resume_in_another_layout_passes_with_tolerances_unchanged(name):
    cfg, axes = MATRIX[name]
    second = resumed_config(cfg)
    assert second.layout.world_size == cfg.layout.world_size == 2
    rec = run_ranks(_resumed_record, 2, cfg, second, **axes)[0]
    result = verdict(cfg, rec)
    assert result["passed"], result["failures"]
    assert result["lockstep_steps"] == [1, 2, 3, 5]
    assert result["resume_at"] == AT and result["resume_layout"] == second.layout.summary()
    assert result["max_resume_rel_diff"] == 0.0  # weights and Adam's moments come back bit for bit
    assert result["max_grad_rel_diff"] <= verify.GRAD_TOLERANCE / 10  # a margin, not a scrape
    assert result["max_update_rel_diff"] <= verify.UPDATE_TOLERANCE
    assert len(result["losses"]["layout"]) == STEPS


def test_verify_resume_at_from_the_shell():
    """The parent starts each part's own ranks (here dp=2, then tp=2) and prints the verdict;
    --json adds resume_at and resume_layout to verify's keys."""
    r = run_cli("verify", *TINY, "--dp", "2", "--steps", "4", "--warmup", "1", "--resume-at", "2",
                "--resume-layout", "tp=2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    j = last_json(r.stdout)
    assert j["passed"] and j["lockstep_steps"] == [1, 2, 3, 4] and len(j["losses"]["layout"]) == 4
    assert j["resume_at"] == 2 and j["resume_layout"]["tp"] == 2 and j["resume_layout"]["dp"] == 1
    assert j["max_resume_rel_diff"] == 0.0 and j["layout"]["dp"] == 2
    assert "resuming after step 2: starting 2 local ranks" in r.stderr and "resumed in tp=2" in r.stderr
    assert "starting 2 local ranks (dp=2 tp=1 pp=1 microbatches=1 fp32)" in r.stderr  # every axis (ep, cp) it has


# ---- bad input: one line each, before any rank starts -----------------------------------------

def test_resume_layout_parses_flags_and_refuses_unknown_keys():
    assert parse_layout("tp=2 pp=2 zero=1 sp schedule=gpipe") == {"tp": 2, "pp": 2, "zero": 1, "sp": True,
                                                                    "schedule": "gpipe"}
    assert parse_layout("keep-gathered sp=0 bucket_mb=0.5") == {"keep_gathered": True, "sp": False,
                                                                   "bucket_mb": 0.5}
    for text, says in (("tp=2 fast=1", "unknown key 'fast'"), ("tp=two", "give tp=<int>"), ("", "name a layout"),
                       ("sp=maybe", "'sp=0' off")):
        with pytest.raises(C.ConfigError, match=says):
            parse_layout(text)


def test_resumed_config_fills_dp_and_refuses_what_cannot_resume():
    cfg = resume_config("tp=2 pp=2")  # from a shell: a world of its own (4 ranks)
    assert resumed_config(cfg).layout.world_size == 4
    assert resumed_config(resume_config("tp=2")).layout.dp == 1  # dp fills the first layout's world
    assert resumed_config(resume_config(None)).layout == resume_config(None).layout
    with pytest.raises(C.ConfigError, match=r"1×1×2×2 = 4, but the launcher started 2 processes"):
        resumed_config(cfg, world_size=2)  # under a launcher the same processes resume
    with pytest.raises(C.ConfigError, match="write precision=fp32"):
        resumed_config(resume_config("tp=2 precision=bf16"))
    with pytest.raises(C.ConfigError, match="--resume-layout 'tp=3'.*--tp 3 does not divide"):
        resumed_config(resume_config("tp=3"))
    late = resume_config(None)
    late.train.resume_at = STEPS
    with pytest.raises(C.ConfigError, match="--resume-at 5: save after a step from 1 to 4"):
        resumed_config(late)
    alone = resume_config("tp=2")
    alone.train.resume_at = None
    with pytest.raises(C.ConfigError, match="give --resume-at K too"):
        resumed_config(alone)


def test_the_resumed_layout_inherits_the_precision_it_must_keep():
    """A bf16 run resumes in bf16 without `precision=bf16` repeated in --resume-layout (it
    cannot change); naming another is still refused."""
    second = resumed_config(resume_config("dp=2 zero=1", precision="bf16"))
    assert second.layout.precision == "bf16" and (second.layout.dp, second.layout.zero) == (2, 1)
    with pytest.raises(C.ConfigError, match="precision fp32, but the run saved in bf16; write precision=bf16"):
        resumed_config(resume_config("zero=1 precision=fp32", precision="bf16"))


@pytest.mark.parametrize("argv, says", [
    (["verify", "--resume-at", "2", "--resume-layout", "tp=2 fast=1"], "unknown key 'fast'"),
    (["train", "--resume-at", "2"], "are verify's"),
])
def test_bad_resume_flags_exit_2_in_one_line(argv, says):
    r = run_cli(*argv[:1], *TINY, "--steps", "4", *argv[1:])
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- the mutants --------------------------------------------------------------------------

def groups_applied_by_position():
    """Optimizer groups restored by position from rank 0's saved list, not per parameter:
    rank 0's groups are gathered when saving (whatever the checkpoint keeps) and, after the
    real load, laid over each rank's own groups in order (patches `Job.save` and `Job.load`)."""
    real_save, real_load, saved = Job.save, Job.load, {}

    def save(self, directory, **kwargs):
        mine = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        saved["groups"] = self.parallel.comm.all_gather_object(mine)[0] if self.mesh.world_size > 1 else mine
        return real_save(self, directory, **kwargs)

    def load(self, directory, **kwargs):
        meta = real_load(self, directory, **kwargs)
        for group, hyper in zip(self.optimizer.param_groups, saved["groups"]):
            group.update(hyper)
        return meta
    return [mock.patch.object(Job, "save", save), mock.patch.object(Job, "load", load)]


def rng_state_not_restored():
    """A resume that leaves torch's random-number state as it found it (patches `Job.load`)."""
    real_load = Job.load

    def load(self, directory, **kwargs):
        before = torch.get_rng_state()
        try:
            return real_load(self, directory, **kwargs)
        finally:
            torch.set_rng_state(before)
    return [mock.patch.object(Job, "load", load)]


def _patched(mutant):
    stack = ExitStack()
    for patch in mutant() if mutant else []:
        stack.enter_context(patch)
    return stack


# Mutant 1's case. meshtrain's own AdamW gives every rank of every layout the same groups in the
# same order ([decay, no-decay]) with one learning rate, so a positional load changes nothing
# there. A user's factory that lists its no-decay group first, with its own learning rate, and
# leaves empty groups out, does: under ZeRO-1 with small buckets rank 1 holds matrices only, so
# its one group is a decay group, and by position it gets rank 0's first — lr 5e-3, no decay.
def no_decay_first(named):
    groups = [{"params": [p for _, p in named if len(meshtrain.full_shape(p)) < 2], "lr": 5e-3, "weight_decay": 0.0},
              {"params": [p for _, p in named if len(meshtrain.full_shape(p)) >= 2], "lr": 1e-3, "weight_decay": 0.1}]
    return torch.optim.AdamW([g for g in groups if g["params"]])


def make_tiny():
    torch.manual_seed(0)
    return TinyLM()


def _api_verdicts(mesh):
    out = {}
    for name, mutant in (("real", None), ("groups_applied_by_position", groups_applied_by_position)):
        with _patched(mutant):
            report = meshtrain.verify(make_tiny, batches(4), optimizer=no_decay_first, mesh=mesh, clip_grad_norm=1.0,
                                      resume_at=2, resume_layout="zero=1 bucket-mb=0.001")
        out[name] = report
    ranks_groups = len(meshtrain.parallelize(make_tiny(), mesh, optimizer=no_decay_first, zero=1,
                                             bucket_mb=0.001).optimizer.param_groups)
    return out, mesh.comm.all_gather_object(ranks_groups)


def test_groups_applied_by_position_fail_verify_across_a_resume():
    """dp=2, saved after step 2, resumed under ZeRO-1 (rank 1's pieces: matrices only)."""
    verdicts, groups_per_rank = run_ranks(_api_verdicts, 2)[0]
    assert groups_per_rank == [2, 1]  # the case: rank 1 has one group, rank 0 two
    real, mutant = verdicts["real"], verdicts["groups_applied_by_position"]
    assert real.passed, real.failures
    assert real.result["max_resume_rel_diff"] == 0.0 and real.result["resume_at"] == 2
    assert not mutant.passed, "groups applied by position slipped through verify"
    first = mutant.failures[0]
    assert first.startswith("step 3:") and "update" in first and "weight" in first, first


class Noisy(TinyLM):
    """A user's model whose training draws from torch's global generator (inverted dropout
    written with torch.rand): the one kind of model whose results a random-number state
    changes — meshtrain's own dropout is keyed by (seed, step, row), never by that state."""

    def forward(self, ids):
        x = self.embed(ids)
        if self.training:
            x = x * (torch.rand_like(x) >= 0.1) / 0.9
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_noisy():
    torch.manual_seed(0)
    return Noisy()


@pytest.mark.parametrize("mutant", [None, rng_state_not_restored], ids=["real", "rng_state_not_restored"])
def test_a_resume_that_skips_the_rng_state_fails_verify(mutant):
    """One process (the only layout such a model can pass in: every rank would draw its own),
    saved after step 2 and resumed in the same layout: the checkpoint gives the state back."""
    with _patched(mutant):
        report = meshtrain.verify(make_noisy, batches(4), optimizer=no_decay_first, clip_grad_norm=1.0, resume_at=2)
    losses, diffs = report.result["losses"], report.result["loss_rel_diffs"]
    assert report.result["resume_rng_checked"]
    if mutant is None:
        assert report.passed, report.failures
        assert losses["layout"] == losses["reference"]  # one process both times: bit for bit, resumed or not
        return
    assert not report.passed, "a resume without the random-number state slipped through verify"
    assert report.failures[0].startswith("step 3: rank 0's random-number state after the resume"), report.failures
    assert diffs[:2] == [0.0, 0.0] and min(diffs[2:]) > 1e-4  # the steps after the resume trained otherwise


def test_resume_layout_must_fill_the_same_world_in_the_api():
    with pytest.raises(ValueError, match="resume_layout: .*1 process"):
        meshtrain.verify(make_tiny, batches(3), optimizer=no_decay_first, resume_at=1, resume_layout="dp=2")
    with pytest.raises(ValueError, match="resume_at=3: save after a step from 1 to 2"):
        meshtrain.verify(make_tiny, batches(3), optimizer=no_decay_first, resume_at=3)
    with pytest.raises(C.ConfigError, match="unknown key 'fast'"):
        meshtrain.verify(make_tiny, batches(3), optimizer=no_decay_first, resume_at=1, resume_layout="fast=1")


def test_the_api_resume_layout_inherits_the_precision():
    """The reference trains in one precision throughout: a resume layout that does not name it
    keeps the first layout's (bf16 here), as `--resume-layout` does."""
    report = meshtrain.verify(make_tiny, batches(4), optimizer=no_decay_first, precision="bf16", resume_at=2,
                              resume_layout="bucket-mb=0.001")
    assert report.passed, report.failures
    assert report.result["resume_layout"]["precision"] == "bf16"
