"""Sharded checkpoints restore the state exactly: optimizer groups by parameter name on every
rank, the scheduler per rank, parameters in any memory layout, tied weights; a save failing
on one rank raises on every rank within seconds; and a checkpoint's index and marker name
only files inside it, and only known dtypes."""

import json
import time

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks

import meshtrain
from meshtrain.checkpoint import folders
from meshtrain.checkpoint.dcp import INDEX
from meshtrain.checkpoint.sharded import STATE, CheckpointError

DECAY, FLAT = {"lr": 1e-3, "weight_decay": 0.1}, {"lr": 5e-3, "weight_decay": 0.0}


def two_groups(named):
    """AdamW with a decay group (matrices) and a no-decay group (vectors), empty ones left
    out: a ZeRO rank holding only vectors has one group."""
    groups = [{"params": [p for _, p in named if len(meshtrain.full_shape(p)) >= 2], **DECAY},
              {"params": [p for _, p in named if len(meshtrain.full_shape(p)) < 2], **FLAT}]
    return torch.optim.AdamW([g for g in groups if g["params"]])


def one_group(named):
    return torch.optim.AdamW([p for _, p in named], lr=1e-3)


def halving(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)


class MatrixThenVectors(nn.Module):
    """128 elements of a matrix, then 128 of vectors: ZeRO over two ranks gives rank 0 the
    matrix and rank 1 the vectors."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(8, 16, bias=False)
        self.a, self.b = nn.Parameter(torch.ones(64)), nn.Parameter(torch.zeros(64))

    def forward(self, x):
        return self.w(x).repeat(1, 4) * self.a + self.b


def mse(out, target):
    return (out - target).pow(2).mean()


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 64, generator=g)


def _zero1_job(mesh):
    torch.manual_seed(0)
    return meshtrain.parallelize(MatrixThenVectors(), mesh, optimizer=two_groups, loss_fn=mse, zero=1,
                                 lr_scheduler=halving)


def _groups(job):
    names = {id(h.tensor): h.name for h in job.parallel.holdings.checkpointed()}
    return [(sorted(names[id(p)] for p in g["params"]), g["lr"], g["weight_decay"], g["initial_lr"])
            for g in job.optimizer.param_groups]


def _zero1_saved(mesh, folder):
    job = _zero1_job(mesh)
    for i in range(2):
        job.step(*_batch(i))
    saved = _groups(job), job.lr_scheduler.state_dict()
    job.save(folder)
    fresh = _zero1_job(mesh)
    fresh.load(folder)
    return saved, (_groups(fresh), fresh.lr_scheduler.state_dict())


def test_optimizer_groups_and_the_scheduler_come_back_per_parameter_name_on_every_rank(tmp_path):
    ranks = run_ranks(_zero1_saved, 2, str(tmp_path / "c"), timeout=120)
    assert [len(saved[0]) for saved, _ in ranks] == [1, 1]  # rank 0: the matrix; rank 1: the vectors
    assert ranks[0][0][0][0][0] == ["w.weight"] and ranks[1][0][0][0][0] == ["a", "b"]
    for rank, (saved, loaded) in enumerate(ranks):
        assert loaded == saved, rank  # each rank its own groups' lr, weight decay and scheduler
    assert ranks[1][1][0][0][1:3] == (5e-3 * 0.25, 0.0)
    # in another layout (one process: both groups on one rank) each group by its members' names
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse,
                                lr_scheduler=halving)
    job.load(tmp_path / "c")
    assert _groups(job) == [(["w.weight"], 1e-3 * 0.25, 0.1, 1e-3), (["a", "b"], 5e-3 * 0.25, 0.0, 5e-3)]
    assert job.lr_scheduler.base_lrs == [1e-3, 5e-3] and job.lr_scheduler.get_last_lr() == [2.5e-4, 1.25e-3]
    job.step(*_batch(2))
    assert [g["lr"] for g in job.optimizer.param_groups] == [1e-3 / 8, 5e-3 / 8]


def test_a_group_whose_members_were_saved_with_different_hyper_parameters_is_refused(tmp_path):
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    job.step(*_batch(0))
    job.save(tmp_path / "c")
    other = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=one_group, loss_fn=mse)
    before = other.module.w.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"optimizer group 0 holds a and w\.weight, saved with different "
                                              r"hyper-parameters \(lr 0\.005 and 0\.001") as e:
        other.load(tmp_path / "c")
    assert "\n" not in str(e.value)
    assert torch.equal(other.module.w.weight, before)  # refused before anything was read


def test_a_checkpoint_with_positional_groups_still_loads(tmp_path):
    """A checkpoint of an earlier meshtrain: rank 0's groups by position in state.json."""
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    job.step(*_batch(0))
    job.save(tmp_path / "c")
    state = json.loads((tmp_path / "c" / STATE).read_text())
    hyper = state.pop("optimizer_groups")
    state["param_groups"] = [dict(hyper["hyper"][hyper["of"][n]], lr=0.5) for n in ("w.weight", "a")]
    (tmp_path / "c" / STATE).write_text(json.dumps(state))
    other = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    other.load(tmp_path / "c", check=False)
    assert [(g["lr"], g["weight_decay"]) for g in other.optimizer.param_groups] == [(0.5, 0.1), (0.5, 0.0)]


# ---- memory layouts and tied weights ------------------------------------------------------------

class Strided(nn.Module):
    """A channels-last convolution and a parameter that is a transposed view."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.t = nn.Parameter(torch.randn(5, 4).t())

    def forward(self, x):
        return self.conv(x).mean((2, 3)) @ self.t


def _strided_job(seed, precision):
    torch.manual_seed(seed)
    return meshtrain.parallelize(Strided(), meshtrain.init(), optimizer=one_group, loss_fn=mse, precision=precision)


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_channels_last_and_a_transposed_parameter_are_restored(precision, tmp_path):
    job = _strided_job(0, precision)
    assert not job.module.conv.weight.is_contiguous() and not job.module.t.is_contiguous()
    g = torch.Generator().manual_seed(0)
    job.step(torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 5, generator=g))
    job.save(tmp_path / "c")
    other = _strided_job(1, precision)
    other.load(tmp_path / "c")
    want, got = job.state_dict(), other.state_dict()
    for name, w in want["model"].items():
        assert torch.equal(got["model"][name], w), name
        assert torch.equal(dict(other.module.named_parameters())[name], dict(job.module.named_parameters())[name])
    for name, entry in want["optim"].items():
        for key, v in entry.items():
            assert torch.equal(got["optim"][name][key], v), (name, key)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


def test_a_tied_head_round_trips_through_the_state_dict():
    torch.manual_seed(0)
    job = meshtrain.parallelize(Tied(), meshtrain.init(), optimizer=one_group)
    g = torch.Generator().manual_seed(0)
    job.step(torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5), generator=g))
    state = job.state_dict()
    assert state["model"].keys() == Tied().state_dict().keys()  # the head too, as torch names it
    plain = Tied()
    plain.load_state_dict(state["model"])  # strict: every name a plain model has
    assert torch.equal(plain.head.weight, job.module.embed.weight)
    torch.manual_seed(1)
    other = meshtrain.parallelize(Tied(), meshtrain.init(), optimizer=one_group)
    other.load_state_dict(state)
    assert other.module.head.weight is other.module.embed.weight  # still one tensor
    assert torch.equal(other.module.embed.weight, job.module.embed.weight)
    other.load_state_dict(job.state_dict())
    head_only = {"model": {"head.weight": state["model"]["embed.weight"] * 2}, "steps": 1}  # the alias alone
    other.load_state_dict(head_only)
    assert torch.equal(other.module.embed.weight, state["model"]["embed.weight"] * 2)


# ---- a failure anywhere raises everywhere ---------------------------------------------------------

def _dp2_job(mesh):
    torch.manual_seed(0)
    return meshtrain.parallelize(MatrixThenVectors(), mesh, optimizer=two_groups, loss_fn=mse)


def _failing_saves(mesh, folder):
    job = _dp2_job(mesh)
    job.step(*_batch(0))
    rank, out = mesh.rank, {}

    def attempt(case, **kwargs):
        t0 = time.perf_counter()
        try:
            job.save(f"{folder}/{case}", **kwargs)
            out[case] = ("saved", "", time.perf_counter() - t0)
        except Exception as e:
            out[case] = (type(e).__name__, str(e), time.perf_counter() - t0)

    attempt("missing-file", files=[f"{folder}/absent"] if rank == 0 else [])  # rank 0 copies the files
    attempt("meta", note=object())  # rank 0 writes state.json
    group = job.optimizer.param_groups[0]
    if rank == 1:
        group["tag"] = object()  # this rank's hyper-parameters
    attempt("rank-1-group")
    group.pop("tag", None)
    job.parallel.comm.barrier()  # no collective was left half-matched
    attempt("good")
    fresh = _dp2_job(mesh)
    fresh.load(f"{folder}/good")
    out["loaded"] = torch.equal(fresh.module.w.weight, job.module.w.weight)
    return out


def test_a_save_failing_on_one_rank_raises_on_every_rank_within_seconds(tmp_path):
    r0, r1 = run_ranks(_failing_saves, 2, str(tmp_path), timeout=90)
    assert r0["missing-file"][0] == "FileNotFoundError" and r1["missing-file"][0] == "CheckpointError"
    assert "rank 0 failed" in r1["missing-file"][1] and "FileNotFoundError" in r1["missing-file"][1]
    assert r0["meta"][0] == "TypeError" and r1["meta"][0] == "CheckpointError"
    assert "rank 0 failed" in r1["meta"][1] and "not plain data" in r1["meta"][1]
    assert r1["rank-1-group"][0] == "TypeError" and r0["rank-1-group"][0] == "CheckpointError"
    assert "rank 1 failed" in r0["rank-1-group"][1] and "not plain data" in r0["rank-1-group"][1]
    for r in (r0, r1):
        for case in ("missing-file", "meta", "rank-1-group"):
            assert r[case][2] < 5, (case, r[case])  # not the collective timeout
            assert "\n" not in r[case][1]
            assert not (tmp_path / case).exists() and not (tmp_path / f"{case}.tmp").exists()
        assert r["good"][0] == "saved" and r["loaded"]


# ---- names and dtypes read from a checkpoint ----------------------------------------------------

def _saved(tmp_path):
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    job.step(*_batch(0))
    job.save(tmp_path / "c")
    return tmp_path / "c"


def _rewrite(folder, name, edit):
    """Edit the JSON file `name` of a checkpoint and record its new size and checksum in the
    marker, as a crafted checkpoint would."""
    path = folder / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    marker = json.loads((folder / folders.COMPLETE).read_text())
    marker["files"][name] = folders.describe(path)
    (folder / folders.COMPLETE).write_text(json.dumps(marker))


def _set_path(path):
    def edit(index):
        index["storage"][0][2] = path
    return edit


def _set_dtype(dtype):
    def edit(index):
        index["tensors"][next(iter(index["tensors"]))]["dtype"] = dtype
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set_path("/etc/passwd"), "names '/etc/passwd', which is not a file in the checkpoint"),
    (_set_path("../outside.distcp"), "names '../outside.distcp', which is not a file in the checkpoint"),
    (_set_path(".."), "names '..', which is not a file in the checkpoint"),
    (_set_dtype("Tensor"), "dtype 'Tensor', not one of"),
    (_set_dtype("float8_e8m0fnu"), "dtype 'float8_e8m0fnu', not one of"),
], ids=["absolute", "dot-dot", "parent", "not-a-dtype", "unlisted-dtype"])
def test_an_index_naming_a_path_outside_or_an_unknown_dtype_is_refused_in_one_line(edit, message, tmp_path):
    folder = _saved(tmp_path)
    _rewrite(folder, INDEX, edit)
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    with pytest.raises(CheckpointError, match=message) as e:
        job.load(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["/etc/passwd", "../c/index.json", "sub/index.json", ".."])
def test_a_marker_naming_a_path_outside_is_refused_in_one_line(name, tmp_path):
    folder = _saved(tmp_path)
    marker = json.loads((folder / folders.COMPLETE).read_text())
    marker["files"][name] = {"bytes": 1, "crc32": 0}
    (folder / folders.COMPLETE).write_text(json.dumps(marker))
    job = meshtrain.parallelize(MatrixThenVectors(), meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    with pytest.raises(CheckpointError, match=f"{folders.COMPLETE} names '{name}', which is not a file in the "
                                              f"checkpoint") as e:
        job.load(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,message", [
    (_set_path("../outside.distcp"), "names '../outside.distcp', which is not a file in the checkpoint"),
    (_set_dtype("Tensor"), "dtype 'Tensor', not one of"),
], ids=["dot-dot", "not-a-dtype"])
def test_export_of_such_a_checkpoint_exits_2_in_one_line(edit, message, tmp_path):
    """Through the command line's `main` in this process (test_export_hf runs export itself)."""
    from helpers import run_main
    folder = _saved(tmp_path)
    _rewrite(folder, INDEX, edit)
    r = run_main("export", "--ckpt", folder, "--out", tmp_path / "x")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists(), r.stderr


def test_a_dtype_no_checkpoint_may_hold_is_refused_at_save_and_nothing_is_left(tmp_path):
    """What `read_index` would refuse is refused when saving, before anything is written."""
    model = MatrixThenVectors()
    model.register_buffer("counts", torch.zeros(3, dtype=torch.uint16))
    job = meshtrain.parallelize(model, meshtrain.init(), optimizer=two_groups, loss_fn=mse)
    with pytest.raises(CheckpointError, match=r"buffer/counts is torch\.uint16, which checkpoints do not hold") as e:
        job.save(tmp_path / "c")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
