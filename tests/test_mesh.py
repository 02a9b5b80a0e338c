import pytest
import torch
from distributed import run_ranks

from meshtrain.comm import Comm
from meshtrain.mesh import AXES, Mesh


def _mesh_facts(mesh):
    comm = Comm(mesh)
    sums = {}
    for axis in AXES:
        t = torch.tensor([float(mesh.rank)])
        comm.all_reduce(t, axis)
        sums[axis] = t.item()
    return {"rank": mesh.rank, "coords": mesh.coords(), "sums": sums,
            "sizes": {a: mesh.size(a) for a in AXES}, "comm": comm.totals(),
            "next": {a: mesh.neighbour(a, +1) for a in AXES}, "prev": {a: mesh.neighbour(a, -1) for a in AXES}}


def test_mesh_dp2_tp2_groups_and_neighbours():
    for f in run_ranks(_mesh_facts, 4, tp=2):
        r = f["rank"]
        assert f["coords"] == {"pp": 0, "dp": r // 2, "tp": r % 2}
        assert f["sums"] == {"pp": r, "dp": (r % 2) * 2 + 2, "tp": (r // 2) * 4 + 1}
        assert f["next"] == {"pp": None, "dp": r + 2 if r < 2 else None, "tp": r + 1 if r % 2 == 0 else None}
        assert f["prev"] == {"pp": None, "dp": r - 2 if r >= 2 else None, "tp": r - 1 if r % 2 == 1 else None}


@pytest.mark.slow
def test_mesh_2x2x2_tp_innermost_pp_outermost():
    facts = run_ranks(_mesh_facts, 8, pp=2, tp=2)
    for f in facts:
        r = f["rank"]
        assert f["coords"] == {"pp": r // 4, "dp": (r // 2) % 2, "tp": r % 2}
        assert f["sizes"] == {"pp": 2, "dp": 2, "tp": 2}
        # each axis group holds exactly the ranks that differ only in that coordinate
        assert f["sums"]["tp"] == r - r % 2 + (r - r % 2 + 1)
        dp_base = r - ((r // 2) % 2) * 2
        assert f["sums"]["dp"] == dp_base + dp_base + 2
        assert f["sums"]["pp"] == r % 4 + r % 4 + 4
        # 4 bytes all-reduced over 2 ranks: 2(n-1)/n * 4 = 4 bytes sent on each axis
        assert f["comm"] == {"pp": 4.0, "dp": 4.0, "tp": 4.0}
        # the next pipeline stage is the rank with the same dp and tp coordinates on the next stage
        assert f["next"]["pp"] == (r + 4 if r < 4 else None) and f["prev"]["pp"] == (r - 4 if r >= 4 else None)


def test_single_process_mesh_needs_no_group():
    mesh = Mesh.single(torch.device("cpu"))
    t = torch.ones(3)
    Comm(mesh).all_reduce(t, "dp")
    assert mesh.world_size == 1 and mesh.coords() == {"pp": 0, "dp": 0, "tp": 0} and t.tolist() == [1, 1, 1]


def test_a_mesh_prints_the_sizes_it_answers():
    """Under cp the dp axis is the parameters' replicas, dp × cp: printed as `size("dp")`
    says, with the batch's dp and cp beside it."""
    mesh = Mesh({"dp": 1, "cp": 2, "tp": 2}, torch.device("cpu"))
    assert mesh.size("dp") == 2 and mesh.batch_dp == 1
    assert repr(mesh) == "Mesh(pp=1, dp=2 (batch dp 1 × cp 2), cp=2, tp=2, rank=0)"
    assert repr(Mesh({"dp": 2, "pp": 2}, torch.device("cpu"))) == "Mesh(pp=2, dp=2, tp=1, rank=0)"
