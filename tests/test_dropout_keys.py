"""Keyed dropout drawn on the device (issue 51): each element of a mask is a hash of (seed,
step, site, global row, its index in the row's whole mask) in integer tensor operations, so
a rank computes only its own elements — its rows, tp's chunk, cp's tokens — and each
layout's shard equals the same slice of the one-process mask; the operations a call adds do
not grow with the rows; the masks keep 1 − p of the elements, and differ between sites,
steps and rows."""

import pytest
import torch
from distributed import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain.comm import Comm
from meshtrain.parallel.context import sequence_positions
from meshtrain.parallel.dropout import DropoutKeys, keyed_dropout

P, SITE = 0.3, "blocks.1.mlp.dropout"


def _mask(shape, rows=slice(0, 4), step=3, site=SITE, seed=7, **where) -> torch.Tensor:
    """keyed_dropout's kept elements of a tensor of ones of `shape`."""
    keys = DropoutKeys(seed)
    keys.use(step, rows)
    return keyed_dropout(torch.ones(shape), P, keys, site, **where) != 0


def test_a_masks_rows_are_the_rows_of_the_whole_batchs_mask():
    whole = _mask((8, 16, 32), rows=slice(0, 8))
    assert torch.equal(_mask((3, 16, 32), rows=slice(2, 5)), whole[2:5])


def test_the_masks_keep_one_minus_p_and_differ_by_site_step_and_row():
    mask = _mask((16, 64, 256), rows=slice(0, 16))
    assert abs(mask.float().mean().item() - (1 - P)) < 0.005
    assert not torch.equal(mask[0], mask[1])
    for other in (dict(site="blocks.2.mlp.dropout"), dict(step=4), dict(seed=8)):
        changed = _mask((16, 64, 256), rows=slice(0, 16), **other)
        assert (changed != mask).float().mean().item() > 0.3, other  # independent masks differ in 2p(1-p)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_operations_a_call_adds_do_not_grow_with_the_rows():
    """Was one generator and mask per row (54 operations at 2 rows, 222 at 16, per step)."""
    counts = []
    for rows in (2, 16):
        keys = DropoutKeys(7)
        keys.use(0, slice(0, rows))
        x = torch.ones(rows, 32, 64)
        with _Count() as count:
            keyed_dropout(x, P, keys, SITE)
        counts.append(count.ops)
    assert counts[0] == counts[1], counts


def _shards(mesh):
    """This rank's masks under tp (a feature chunk; a token chunk as SP holds it) and cp (its
    head-tail tokens, and under SP its tp chunk of them), against the one-process mask."""
    comm, out = Comm(mesh), {}
    tp, cp = mesh.size("tp"), mesh.size("cp")
    whole = _mask((4, 32, 24))
    if tp > 1:
        t = mesh.coord("tp")
        out["features"] = torch.equal(_mask((4, 32, 24 // tp), shard=(2, comm)), whole[:, :, t * 12:(t + 1) * 12])
        out["tokens"] = torch.equal(_mask((4, 32 // tp, 24), shard=(1, comm)), whole[:, t * 16:(t + 1) * 16])
    if cp > 1:
        tokens = sequence_positions(32, mesh.coord("cp"), cp)
        out["cp"] = torch.equal(_mask((4, 32 // cp, 24), tokens=(mesh.coord("cp"), cp)), whole[:, tokens])
    if tp > 1 and cp > 1:
        mine = tokens.narrow(0, mesh.coord("tp") * 8, 8)
        out["cp+sp"] = torch.equal(_mask((4, 8, 24), tokens=(mesh.coord("cp"), cp), shard=(1, comm)),
                                   whole[:, mine])
    return out


@pytest.mark.parametrize("axes", [{"tp": 2}, {"cp": 2}, {"tp": 2, "cp": 2}], ids=["tp2", "cp2", "cp2-tp2"])
def test_each_layouts_shard_is_the_same_slice_of_the_one_process_mask(axes):
    world = 2 * (2 if len(axes) == 2 else 1)
    for rank in run_ranks(_shards, world, **axes):
        assert rank and all(rank.values()), rank
