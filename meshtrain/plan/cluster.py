"""The cluster a plan runs on: how many devices, their memory, and how fast they compute
and communicate — a GPU preset or flags (`Cluster`), whose rates come from a roofline
(`GpuRates`), or a profile this machine measured (`meshtrain plan --calibrate`).

Every rate source answers the same three questions, which is all the step-time model asks:
`matmul_time(m, k, n, dtype, batch)`, `elementwise_time(nbytes)` and
`collective_time(kind, sent_bytes, across_nodes)`, with `sent_bytes` counted as
`meshtrain.comm` counts them (what one rank sends under the ring algorithms)."""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2 ** 30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_mem_gib: float
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # dense, in the plan's compute precision (bf16 tensor cores for the presets)
    peak_tflops_fp32: float = 67.0  # without tensor cores (meshtrain keeps TF32 off)
    intra_node_gbps: float = 3600.0  # Gbit/s per device and direction (NVLink 4: 450 GB/s)
    inter_node_gbps: float = 400.0  # Gbit/s per device (one 400G NIC per GPU)
    memory_tbps: float = 3.35  # device memory bandwidth, TB/s
    name: str = "custom"

    @property
    def memory_bytes(self) -> float:
        return self.gpu_mem_gib * GIB

    def peak_flops(self, precision: str) -> float:
        return 1e12 * (self.peak_tflops_fp32 if precision == "fp32" else self.peak_tflops)


# The vendors' dense figures (SXM parts), NVLink per direction, one NIC per GPU.
GPU_PRESETS: dict[str, Cluster] = {
    "a100-80g": Cluster(8, 80, 8, 312.0, 19.5, 2400.0, 200.0, 2.04, "a100-80g"),
    "h100-80g": Cluster(8, 80, 8, 989.0, 67.0, 3600.0, 400.0, 3.35, "h100-80g"),
    "h200": Cluster(8, 141e9 / GIB, 8, 989.0, 67.0, 3600.0, 400.0, 4.8, "h200"),
}


def cluster_from(gpu: str | None, **given) -> Cluster:
    """A preset (default h100-80g) with the flags given (None: keep the preset's)."""
    name = gpu or "h100-80g"
    if name not in GPU_PRESETS:
        raise ValueError(f"unknown GPU '{name}'; use --gpu {' | '.join(GPU_PRESETS)} or give the cluster flags")
    set_here = {k: v for k, v in given.items() if v is not None}
    for key, value in set_here.items():
        if value <= 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive (got {value})")
    if "peak_tflops" in set_here:  # the flag gives the peak of the plan's own precision, whichever it is
        set_here["peak_tflops_fp32"] = set_here["peak_tflops"]
    changed = set(set_here) - {"gpus"}
    return replace(GPU_PRESETS[name], **set_here, name=f"{name} (changed)" if changed else name)


@dataclass(frozen=True)
class GpuRates:
    """A roofline per kernel: a matmul runs at `MATMUL_EFFICIENCY` of the peak or at the
    memory bandwidth, whichever is slower; an elementwise kernel at `MEMORY_EFFICIENCY` of
    the bandwidth; a collective costs a latency plus its bytes over the link it crosses."""
    cluster: Cluster
    precision: str
    MATMUL_EFFICIENCY = 0.75  # what large cuBLAS GEMMs reach (Megatron's per-GEMM figures)
    MEMORY_EFFICIENCY = 0.8
    LATENCY_S = {False: 10e-6, True: 30e-6}  # within a node, across nodes

    def matmul_time(self, m: int, k: int, n: int, dtype: str | None = None, batch: int = 1) -> float:
        element = 4 if (dtype or self.precision) == "fp32" else 2
        compute = 2.0 * batch * m * k * n / (self.MATMUL_EFFICIENCY * self.cluster.peak_flops(dtype or self.precision))
        traffic = batch * (m * k + k * n + m * n) * element / (self.MEMORY_EFFICIENCY * self.cluster.memory_tbps * 1e12)
        return max(compute, traffic)

    def elementwise_time(self, nbytes: float) -> float:
        return nbytes / (self.MEMORY_EFFICIENCY * self.cluster.memory_tbps * 1e12)

    def collective_time(self, kind: str, sent_bytes: float, across_nodes: bool = False) -> float:
        if sent_bytes <= 0:
            return 0.0
        gbps = self.cluster.inter_node_gbps if across_nodes else self.cluster.intra_node_gbps
        return self.LATENCY_S[across_nodes] + sent_bytes * 8 / (gbps * 1e9)

    op_overhead_s = 0.0  # kernels launch asynchronously: the host stays ahead of the device
    comm_overlap = 1.0  # data-parallel reductions run on their own stream, under the backward
