"""The strategies' own typed options: what `parallelize` applies, independent of the command
line (the CLI's `LayoutConfig` and the Python API both translate into this)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
PRECISIONS = ("fp32", "bf16")
GRAD_DTYPES = ("compute", "fp32")
LINEAR_SYNCS = ("allreduce", "allgather", "auto")
CP_MODES = ("ring", "ulysses")  # context parallelism's attention


@dataclass(frozen=True)
class Strategies:
    """How to parallelize a model on a mesh whose axis sizes are already fixed.

    `zero`: 0 (plain data parallelism) or the ZeRO stage 1-3; `precision`: "fp32" or "bf16"
    (fp32 masters); `grad_dtype`: "fp32" (gradients accumulated and reduced in fp32) or
    "compute" (in the compute dtype); `recompute`: none | full | selective | segments[:K];
    `sp`: sequence parallelism over tp; `schedule`, `chunks`, `microbatches`, `stage_layers`:
    the pipeline's; `bucket_mb`: data parallelism's bucket size; `keep_gathered`: ZeRO-3
    keeps a block's parameters from forward to backward; `dp_linear_sync`: allreduce |
    allgather | auto per linear layer; `strict_p2p`: check pipeline transfers under NCCL's
    rules on gloo; `cp_mode`: how attention runs when the mesh has cp > 1 ("ring")."""
    zero: int = 0
    precision: str = "fp32"
    grad_dtype: str = "fp32"
    recompute: str = "none"
    sp: bool = False
    schedule: str = "1f1b"
    chunks: int = 1
    microbatches: int = 1
    stage_layers: tuple[int, ...] | None = None
    bucket_mb: float = 25.0
    keep_gathered: bool = False
    dp_linear_sync: str = "allreduce"
    strict_p2p: bool = False
    cp_mode: str = "ring"

    def __post_init__(self):
        checks = [("zero", self.zero in (0, 1, 2, 3), "0, 1, 2 or 3"),
                  ("precision", self.precision in PRECISIONS, " or ".join(PRECISIONS)),
                  ("grad_dtype", self.grad_dtype in GRAD_DTYPES, " or ".join(GRAD_DTYPES)),
                  ("schedule", self.schedule in SCHEDULES, ", ".join(SCHEDULES)),
                  ("chunks", isinstance(self.chunks, int) and self.chunks >= 1, "an integer ≥ 1"),
                  ("microbatches", isinstance(self.microbatches, int) and self.microbatches >= 1, "an integer ≥ 1"),
                  ("dp_linear_sync", self.dp_linear_sync in LINEAR_SYNCS, ", ".join(LINEAR_SYNCS)),
                  ("cp_mode", self.cp_mode in CP_MODES, " or ".join(CP_MODES))]
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: use {allowed}")
        try:
            parse_recompute(self.recompute)
        except ValueError:
            raise ValueError(f"recompute={self.recompute!r}: use none, full, selective or segments[:K]") from None


def parse_recompute(policy: str) -> tuple[str, int | None]:
    """'segments:3' -> ('segments', 3); 'segments' -> ('segments', None); 'full' -> ('full',
    None); ValueError for anything else."""
    mode, colon, k = policy.partition(":")
    if mode not in ("none", "full", "selective", "segments") or (colon and mode != "segments"):
        raise ValueError(policy)
    if colon:
        if not k.isdigit() or int(k) < 1:
            raise ValueError(policy)
        return mode, int(k)
    return mode, None
