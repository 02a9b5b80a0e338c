"""A step's batch cut into this rank's rows: the rows of a tensor or a dict of them, and
which of a global batch (or of the share each rank passed) this rank trains on, with one
line for a batch the layout cannot split."""

from __future__ import annotations

import torch

from meshtrain.comm import METRICS, Comm
from meshtrain.loss_terms import LossTerms
from meshtrain.mesh import Mesh
from meshtrain.parallel.state import digest


def take_rows(batch, rows: slice):
    """Those rows of a tensor, of each tensor of a dict; anything else (None) as it is."""
    if batch is None:
        return None
    if isinstance(batch, dict):
        return {k: take_rows(v, rows) for k, v in batch.items()}
    return batch[rows] if torch.is_tensor(batch) else batch


def batch_rows(batch) -> int:
    """Rows of a tensor or of a dict's tensors (all alike); one line if they differ."""
    if torch.is_tensor(batch):
        return batch.shape[0]
    sizes = {k: v.shape[0] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0}
    if not sizes or len(set(sizes.values())) != 1:
        raise ValueError(f"the batch dict's tensors must share their first (row) dimension; they have {sizes}")
    return next(iter(sizes.values()))


def step_rows(mesh: Mesh, comm: Comm, loss: LossTerms, microbatches: int, inputs, targets, n: int, rows: str,
              check: bool = False, share: tuple[int, int] = (0, 1)) -> tuple[slice, int, object]:
    """Collective where `rows="local"`: (this rank's rows of the `n` it was passed, where they
    start in the global batch, the global count of loss terms: a number or a 0-dim tensor),
    with one line for a batch the layout cannot split. Local shares are compared across ranks
    on the first step and when `check` asks (an object gather: the host waits for every rank).
    `share` (i, k): the batch is that of k replica groups (`meshtrain.replicas`), this group's
    rows its i-th k-th; the count is still the whole batch's."""
    m, dp = microbatches, mesh.batch_dp  # the ranks of a cp group share their rows
    index, groups = share
    if rows == "global":
        if n % (groups * dp * m):
            split = f"{groups} replica groups · " if groups > 1 else ""
            raise ValueError(f"a global batch of {n} rows does not split into {split}dp·microbatches = {dp}·{m}; "
                             f"pass a multiple of {groups * dp * m} rows")
        group = n // groups
        mine = mesh.rows(group)
        mine = slice(index * group + mine.start, index * group + mine.stop)
        return mine, mine.start, loss.count(targets, n)
    if rows != "local":
        raise ValueError(f"rows={rows!r}: use 'global' (every rank passes the global batch) or 'local'")
    if groups > 1:
        raise ValueError("rows='local' under replica groups: pass the global batch (rows='global'); each group "
                         "trains its share of the live groups' rows")
    if n % m:
        raise ValueError(f"rows='local': this rank's {n} rows do not split into microbatches={m}")
    if check or not loss.settled:
        check_local_shares(mesh, comm, inputs, n)
    if loss.watched:  # its terms are counted as it runs
        return slice(0, n), mesh.batch_coord * n, 1.0
    count = torch.as_tensor(loss.count(targets, n)).to(mesh.device, torch.float64)
    comm.all_reduce(count, "dp", purpose=METRICS)  # over dp × cp: each row cp times
    return slice(0, n), mesh.batch_coord * n, count / mesh.size("cp")


def check_local_shares(mesh: Mesh, comm: Comm, inputs, n: int) -> None:
    """Collective: with `rows="local"`, every rank passed a share of the same size, the ranks
    of one data-parallel replica the same rows, and the replicas different ones."""
    shares = comm.all_gather_object((mesh.batch_coord, n, fingerprint(inputs)))
    sizes = {s[1] for s in shares}
    if len(sizes) != 1:
        raise ValueError(f"rows='local': ranks passed shares of different sizes {sorted(sizes)}; pass "
                         f"batch[mesh.rows(global_batch_size)] on every rank")
    by_coord: dict[int, set] = {}
    for coord, _, fp in shares:
        by_coord.setdefault(coord, set()).add(fp)
    if any(len(fps) > 1 for fps in by_coord.values()):
        raise ValueError("rows='local': ranks of the same data-parallel replica (its tp and pp ranks) passed "
                         "different rows; each must pass batch[mesh.rows(global_batch_size)]")
    if mesh.batch_dp > 1 and len({next(iter(fps)) for fps in by_coord.values()}) == 1:
        raise ValueError("rows='local': every data-parallel rank passed the same rows; pass "
                         "batch[mesh.rows(global_batch_size)], or rows='global' with the whole batch")


def fingerprint(batch) -> bytes:
    """A digest of a tensor's values, of each of a dict's (by key), or of anything else's repr."""
    if isinstance(batch, dict):
        return b"".join(fingerprint(batch[k]) for k in sorted(batch))
    return digest(batch) if torch.is_tensor(batch) else repr(batch).encode()
