"""The math attention kernel's score tiles, bounded: the ring's math block kernel (what runs
where no fused one does: `block_kernels.math_kernel`) takes a block's queries in row chunks
whose fp32 scores stay within `MATH_TILE_BYTES`, as a fused kernel's tiles are bounded; a
(s/2cp)² tile per head would be gigabytes at long sequences. Torch-free: the planner counts
the same tiles."""

MATH_TILE_BYTES = 64 * 2 ** 20


def tile_rows(batch: int, heads: int, queries: int, keys: int, budget: int = MATH_TILE_BYTES) -> int:
    """How many query rows of a block one fp32 score tile of at most `budget` bytes holds
    (at least one, at most all `queries`)."""
    return max(1, min(queries, budget // (batch * heads * keys * 4)))
