"""What each rank sends in a collective under the bandwidth-optimal (ring) algorithms the
papers' formulas assume: the counts `comm.Comm` records and the planner predicts with (pure
arithmetic, no torch: `meshtrain plan` answers without loading it). See `comm` for the
table and the choices built on them."""


def all_reduce_bytes(nbytes: float, n: int) -> float:
    """What each of `n` ranks sends to all-reduce `nbytes` (ring: reduce-scatter, all-gather)."""
    return 2 * (n - 1) / n * nbytes


def all_gather_bytes(total_nbytes: float, n: int) -> float:
    """What each of `n` ranks sends to all-gather `total_nbytes` in all (or to reduce-scatter
    them, or to broadcast them)."""
    return (n - 1) / n * total_nbytes
