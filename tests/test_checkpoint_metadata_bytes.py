"""Metadata that scales (issue 49): the bytes each rank receives from meshtrain's own exchanges
at a save and a load, measured on 2 and 4 real gloo ranks. What only rank 0 writes goes to
rank 0 alone, and every verdict is decided there (or all-reduced) and broadcast, so rank 0's
bytes grow with the world and every other rank's do not. torch DCP's own planning exchanges
are measured beside them (not ours to change). The old exchanges (everything all-gathered to
every rank) are run as a mutant in the same ranks: the same measurement must catch them.

Counted where the bytes move: torch.distributed's tensor collectives, which its object
collectives (and ours) are made of, each call's bytes of other ranks' data that reach this
rank — an all-gather's other n−1 parts, a gather's on its root only, a broadcast's or a
scatter's off the source, an all-reduce's result once — attributed to DCP when the call comes
from inside `torch.distributed.checkpoint`, else to meshtrain.

Also: the same-model check, now an all-reduce over the saved tensors, still refuses another
model naming the first differing tensor on every rank, where the ranks hold different
tensors (ZeRO-3 pieces) and none alone sees the whole model."""

import inspect
import sys
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
from distributed import run_ranks

import meshtrain
from meshtrain.checkpoint import sharded
from meshtrain.checkpoint.sharded import CheckpointError
from meshtrain.comm import Comm

LAYERS = 24
PRIMITIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "gather", "broadcast", "scatter")
DCP_FILES = "torch/distributed/checkpoint/"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_source(a: dict, group) -> bool:
    """Whether this rank is the source of a broadcast or scatter called with arguments `a`."""
    if a.get("group_src") is not None:
        return a["group_src"] == dist.get_rank(group)
    return a.get("src") == dist.get_rank()


def _arriving(name: str, a: dict) -> int:
    """Bytes of other ranks' data that reach this rank in one call of the primitive `name`."""
    if name == "all_reduce":
        return _nbytes(a["tensor"])
    if name == "all_gather":
        return (len(a["tensor_list"]) - 1) * _nbytes(a["tensor"])
    if name == "all_gather_into_tensor":
        return _nbytes(a["output_tensor"]) - _nbytes(a["input_tensor"])
    if name == "gather":
        return 0 if a.get("gather_list") is None else (len(a["gather_list"]) - 1) * _nbytes(a["tensor"])
    return 0 if _is_source(a, a.get("group")) else _nbytes(a["tensor"])  # broadcast, scatter


class Received:
    """Counts, in this rank, the bytes arriving through torch.distributed's tensor collectives
    while a `phase` is open: {phase: {"meshtrain" | "dcp": bytes}}."""

    def __init__(self):
        self.bytes: dict[str, dict[str, int]] = {}
        self._phase = None

    @contextmanager
    def phase(self, name: str):
        self.bytes[name] = {"meshtrain": 0, "dcp": 0}
        self._phase = name
        try:
            yield
        finally:
            self._phase = None

    def patches(self) -> list:
        """Each primitive wrapped where torch's object collectives (module `distributed_c10d`)
        and callers of `torch.distributed` look it up."""
        out = []
        for name in PRIMITIVES:
            real = getattr(c10d, name, None)
            if real is None:  # not in this torch
                continue
            counted = self._counted(name, real)
            out.append(mock.patch.object(c10d, name, counted))
            if getattr(dist, name, None) is real:
                out.append(mock.patch.object(dist, name, counted))
        return out

    def _counted(self, name: str, real):
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            if self._phase is not None:
                bound = signature.bind(*args, **kwargs)
                owner = "dcp" if _called_from(DCP_FILES) else "meshtrain"
                self.bytes[self._phase][owner] += _arriving(name, bound.arguments)
            return real(*args, **kwargs)
        return call


def _called_from(path_part: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if path_part in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _everything_to_every_rank() -> list:
    """The old exchanges, as a mutant: what is gathered to rank 0 all-gathered instead, and
    the same-model check's names (each rank's, 19–22 kB in a 48-layer MoE) all-gathered to
    every rank before it."""
    real_check = sharded._check_same_model

    def check(parallel, metadata, restored, folder):
        parallel.comm.all_gather_object({h.name: tuple(h.shape) for h in restored})
        return real_check(parallel, metadata, restored, folder)
    return [mock.patch.object(Comm, "gather_object", lambda self, obj: self.all_gather_object(obj)),
            mock.patch.object(sharded, "_check_same_model", check)]


def _mse(out, target):
    return (out - target).pow(2).mean()


def _layers_job(mesh):
    """The test's model: `LAYERS` small linear layers, AdamW, one step taken."""
    torch.manual_seed(0)
    job = meshtrain.parallelize(nn.Sequential(*(nn.Linear(8, 8) for _ in range(LAYERS))), mesh, loss_fn=_mse,
                                optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-3))
    job.step(torch.randn(2 * mesh.world_size, 8), torch.zeros(2 * mesh.world_size, 8))
    return job


def _moe_48_job(mesh):
    """The issue's case (benchmarks/checkpoint_metadata.py): moe-test with 48 layers, every
    rank holding all of it (531 tensors; their names 21.9 kB pickled, the optimizer groups
    19.3 kB), the command line's AdamW, one step taken."""
    import dataclasses

    from meshtrain.recipes import PRESETS, add_preset
    from meshtrain.recipes.build import build_model
    if "moe-test-48" not in PRESETS:
        add_preset("moe-test-48", dataclasses.replace(PRESETS["moe-test"], n_layers=48))
    job = meshtrain.parallelize(build_model("moe-test-48", 0), mesh, optimizer=meshtrain.adamw(1e-3, 0.1))
    tokens = torch.randint(0, 256, (mesh.world_size, 8), generator=torch.Generator().manual_seed(0))
    job.step(tokens, tokens)
    return job


JOBS = {"layers": _layers_job, "moe-48": _moe_48_job}


def _received_at_save_and_load(mesh, folder, model):
    """This rank's bytes received at a save and at a load (checked first, as `Job.load`
    does) of `JOBS[model]`, with the exchanges as they are and as they were."""
    job, out = JOBS[model](mesh), {}
    for case, mutant in (("now", []), ("all-gathered", _everything_to_every_rank())):
        count = Received()
        with ExitStack() as stack:
            for patch in count.patches() + mutant:
                stack.enter_context(patch)
            with count.phase("save"):
                job.save(f"{folder}/{case}")
            with count.phase("load"):
                job.load(f"{folder}/{case}")
        out[case] = count.bytes
    return out


def measured(folder, worlds=(2, 4), model: str = "layers") -> dict[int, list[dict]]:
    """{world: each rank's {case: {phase: {"meshtrain" | "dcp": bytes}}}}, `case` "now" or
    "all-gathered" (the old exchanges)."""
    return {n: run_ranks(_received_at_save_and_load, n, f"{folder}/world-{n}", model, timeout=300) for n in worlds}


def test_what_a_rank_other_than_0_receives_does_not_grow_with_the_world(tmp_path):
    got = measured(str(tmp_path))

    def ours(world, case, phase, ranks):
        return [got[world][r][case][phase]["meshtrain"] for r in ranks]

    for phase in ("save", "load"):
        two, four = ours(2, "now", phase, [1]), ours(4, "now", phase, [1, 2, 3])
        assert max(four) <= two[0], (phase, two, four)  # another rank: no more at 4 ranks than at 2
        assert ours(4, "now", phase, [0])[0] > ours(2, "now", phase, [0])[0], phase  # rank 0 gathers
        old_two, old_four = ours(2, "all-gathered", phase, [1]), ours(4, "all-gathered", phase, [1, 2, 3])
        assert min(old_four) > old_two[0] + 1000, (phase, old_two, old_four)  # the mutant: caught
        assert all(got[n][r]["now"][phase]["dcp"] > 0 for n in got for r in range(n))  # DCP's counted apart


# ---- the same-model check, where no rank holds the whole model ---------------------------------

class MatrixThenVectors(nn.Module):
    """128 elements of a matrix and 128 of vectors: ZeRO-3 over two ranks gives one rank the
    matrix and the other the vectors. Another model for the checkpoint: other `vectors`, or
    another number of the matrix's `rows` (the forward is the first model's)."""

    def __init__(self, vectors=("a", "b"), rows: int = 16):
        super().__init__()
        self.w = nn.Linear(8, rows, bias=False)
        for name in vectors:
            setattr(self, name, nn.Parameter(torch.zeros(64)))

    def forward(self, x):
        return self.w(x).repeat(1, 4) * self.a + self.b


def _one_block(**model) -> nn.Module:
    """The model as the one block of a block list: one ZeRO-3 unit, cut in two flat halves."""
    return nn.Sequential(MatrixThenVectors(**model))


def _zero3_job(mesh, **model):
    torch.manual_seed(0)
    return meshtrain.parallelize(_one_block(**model), mesh, zero=3, loss_fn=_mse,
                                 optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-3))


def _refusals(mesh, folder):
    """Each rank's held names, and what loading each model into the checkpoint of the first
    says (None: loaded)."""
    job = _zero3_job(mesh)
    job.step(torch.randn(4, 8), torch.zeros(4, 64))
    job.save(f"{folder}/c")
    out = {"holds": sorted(h.name for h in job.parallel.holdings.restored())}
    for case, model in (("same", {}), ("more", {"vectors": ("a", "b", "c")}), ("fewer", {"vectors": ("a",)}),
                        ("shape", {"rows": 8})):
        try:
            _zero3_job(mesh, **model).load(f"{folder}/c")
            out[case] = None
        except CheckpointError as e:
            out[case] = str(e)
    return out


def test_another_model_is_refused_on_every_rank_naming_the_first_difference(tmp_path):
    r0, r1 = run_ranks(_refusals, 2, str(tmp_path), timeout=120)
    assert sorted(r0["holds"] + r1["holds"]) == ["0.a", "0.b", "0.w.weight"]  # the case: no rank holds the whole
    for r in (r0, r1):
        assert r["same"] is None
        assert r["more"] == f"{tmp_path}/c holds another model's weights (it lacks 0.c; 1 missing, 0 extra, " \
                            f"0 of another shape)"
        assert r["fewer"] == f"{tmp_path}/c holds another model's weights (it has 0.b, which this model lacks; " \
                             f"0 missing, 1 extra, 0 of another shape)"
        assert r["shape"] == f"{tmp_path}/c holds another model's weights (0.w.weight is [16, 8] there, [8, 8] " \
                             f"here; 0 missing, 0 extra, 1 of another shape)"
