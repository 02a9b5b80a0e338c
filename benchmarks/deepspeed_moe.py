"""meshtrain's expert-parallel MoE layer against DeepSpeed's (`deepspeed.moe.layer.MoE`,
dropless), on CPU with gloo: 2 ranks, ep=2, one thread each.

Both layers have moe-small's shapes (d=256, 8 SwiGLU experts of I=352, top-2), the same
weights (DeepSpeed's expert e, on ep rank e // 4, gets meshtrain's `gate_up_proj[e]` and
`down_proj[e]`; its gate `wg` gets meshtrain's router weight) and the same input tokens
(`--rows` × `--seq-len` per rank). Routing is made identical where DeepSpeed allows it:
k=2 with `top2_2nd_expert_sampling=False` (no Gumbel noise on the second expert) is a
softmax top-2 renormalised over the two, as meshtrain's router with `norm_topk`. Neither
layer's auxiliary balancing loss reaches the backward (meshtrain: balance="none"; DeepSpeed
computes `l_aux` in its forward, unused). What is timed, per iteration: forward + backward
of the layer alone (router included) from a barrier, the slowest rank's time; the two
implementations alternated in the same processes (their order swapped every iteration).

Reported: each implementation's median seconds and the ratio meshtrain / DeepSpeed; the
outputs' and gradients' max abs differences after one forward+backward (which says whether
routing and weights matched); DeepSpeed's dropless capacity C (the max over experts and ep
ranks of the rows an expert receives, agreed by an all-reduce MAX, then read on the host:
`int(C)` in `MOELayer.forward`) against what it needs, whether any route was dropped, and
the padding its [E, C, d] all-to-all buffers carry; the collectives each implementation
runs per forward+backward (from torch.profiler).

On 2 cores the two ranks share the machine: the timings say what the layers cost beside each
other here, not on a cluster.

Set-up (a separate venv: DeepSpeed is not a meshtrain dependency):

    python -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0        # the local CPU build
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    /tmp/dsvenv/bin/pip install numpy 'tokenizers>=0.15' tqdm matplotlib scikit-learn safetensors
    /tmp/dsvenv/bin/pip install -e . --no-deps

Run (from the repository root):

    /tmp/dsvenv/bin/python benchmarks/deepspeed_moe.py --out benchmarks/results/deepspeed_moe.json

Without DeepSpeed installed (or if its layer fails) the meshtrain half still runs, and the
JSON says why DeepSpeed's did not (`deepspeed.error`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from expert_parallel import report  # benchmarks/, the script's own folder

WORLD = 2
EP = 2
D, I, E, K = 256, 352, 8, 2  # moe-small's MoE layer


class SwiGLU(nn.Module):
    """One expert for DeepSpeed: meshtrain's stacked expert e as two Linears (gate rows first)."""

    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collectives(fn) -> dict[str, int]:
    """The c10d collectives one call of `fn` runs (forward and backward), by name."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for ev in prof.events():
        if ev.name.startswith("c10d::") or ev.name.startswith("gloo:"):
            counts[ev.name] = counts.get(ev.name, 0) + 1
    return counts


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rank_main(rank: int, port: int, args, out_path: str) -> None:
    from meshtrain.comm import Comm
    from meshtrain.launch import RankEnv, init_distributed
    from meshtrain.mesh import Mesh
    from meshtrain.models.moe import MoE as MeshMoE
    from meshtrain.models.specs import MoESpec
    from meshtrain.parallel.experts import apply_expert_parallel

    cpu = torch.device("cpu")
    init_distributed(RankEnv("bench", rank, WORLD, rank, WORLD, "127.0.0.1", port), cpu)
    torch.set_num_threads(1)
    mesh = Mesh.build(1, WORLD, 1, cpu, ep=EP)
    result: dict = {}

    # ---- meshtrain: router + stacked experts, the experts split over ep ------------------------
    spec = MoESpec(n_layers=1, n_heads=8, n_kv_heads=4, d_model=D, ffn_dim=704, n_experts=E, top_k=K,
                   expert_ffn_dim=I, max_seq_len=512, balance="none", experts=args.experts)
    torch.manual_seed(0)  # the same full weights on both ranks
    mt = MeshMoE(spec)
    nn.init.normal_(mt.gate.weight, std=args.router_std)
    nn.init.normal_(mt.experts.gate_up_proj, std=D ** -0.5)
    nn.init.normal_(mt.experts.down_proj, std=I ** -0.5)
    full = {"router": mt.gate.weight.detach().clone(), "gate_up": mt.experts.gate_up_proj.detach().clone(),
            "down": mt.experts.down_proj.detach().clone()}
    apply_expert_parallel(mt, Comm(mesh), split_tp=False)
    mt.train()

    x = torch.randn(args.rows, args.seq_len, D, generator=torch.Generator().manual_seed(100 + rank))
    g = torch.randn(args.rows, args.seq_len, D, generator=torch.Generator().manual_seed(200 + rank))
    local = E // EP

    def run_mt():
        xi = x.clone().requires_grad_()
        out = mt(xi)
        out.backward(g)
        return out, xi

    impls = {"meshtrain": run_mt}

    # ---- DeepSpeed: deepspeed.moe.layer.MoE, dropless ----------------------------------------
    ds_info: dict = {}
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DSMoE

        ds_info["version"] = deepspeed.__version__
        deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group made above
        ds = DSMoE(hidden_size=D, expert=SwiGLU(D, I), num_experts=E, ep_size=EP, k=K, drop_tokens=False,
                   use_residual=False, top2_2nd_expert_sampling=False)
        ds.set_deepspeed_parallelism()  # what deepspeed.initialize does: the ep_size_2 groups
        with torch.no_grad():
            ds.deepspeed_moe.gate.wg.weight.copy_(full["router"])
            for j, expert in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
                expert.gate_up.weight.copy_(full["gate_up"][rank * local + j])
                expert.down.weight.copy_(full["down"][rank * local + j])
        ds.train()

        def run_ds():
            xi = x.clone().requires_grad_()
            out, _l_aux, _counts = ds(xi)
            out.backward(g)
            return out, xi

        # Dropless? The gate's capacity against the largest per-expert count over the ep ranks.
        with torch.no_grad():
            _, cap, _, indices, _, _, counts = ds.deepspeed_moe.gate(x.reshape(-1, D), None, True, False)
        need = counts.clone()
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        ds_info.update(capacity=int(cap), max_rows_per_expert_over_ranks=int(need.max()),
                       expert_counts_this_rank=counts.tolist(), dropped_routes=int((indices < 0).sum()),
                       routes=int(indices.numel()),
                       buffer_rows_per_rank=E * int(cap), routed_rows_per_rank=int(indices.numel()),
                       padding_factor=E * int(cap) / indices.numel())
        impls["deepspeed"] = run_ds
    except Exception as exc:  # noqa: BLE001 - reported, the meshtrain half still runs
        ds_info["error"] = f"{type(exc).__name__}: {exc}"
        ds_info["traceback"] = traceback.format_exc()
        print(f"rank {rank}: DeepSpeed's MoE did not run:\n{ds_info['traceback']}", file=sys.stderr)
    # Both ranks must agree on what runs (a collective on one rank only would hang the other).
    ok = torch.tensor([1 if "deepspeed" in impls else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        impls.pop("deepspeed", None)
    result["deepspeed"] = ds_info

    # ---- the same tokens, the same weights: do the outputs agree? ------------------------------
    if "deepspeed" in impls:
        for p in [*mt.parameters(), *ds.parameters()]:
            p.grad = None
        out_m, x_m = run_mt()
        out_d, x_d = run_ds()
        ds_experts = ds.deepspeed_moe.experts.deepspeed_experts
        ds_gate_up = torch.stack([e.gate_up.weight.grad for e in ds_experts])
        ds_down = torch.stack([e.down.weight.grad for e in ds_experts])
        diffs = {"output": (out_m - out_d).abs().max().item(),
                 "output_max_abs": out_m.abs().max().item(),
                 "input_grad": (x_m.grad - x_d.grad).abs().max().item(),
                 "router_grad": (mt.gate.weight.grad - ds.deepspeed_moe.gate.wg.weight.grad).abs().max().item(),
                 "gate_up_grad": (mt.experts.gate_up_proj.grad - ds_gate_up).abs().max().item(),
                 "down_grad": (mt.experts.down_proj.grad - ds_down).abs().max().item()}
        # the routes themselves: meshtrain's top-2 against DeepSpeed's
        with torch.no_grad():
            _, chosen, _ = mt.gate(x.reshape(-1, D))
            _, _, _, ds_idx, _, _, _ = ds.deepspeed_moe.gate(x.reshape(-1, D), None, True, False)
        same = (chosen.sort(-1).values == ds_idx.t().long().sort(-1).values).all(-1)
        diffs["tokens_routed_differently"] = int((~same).sum())
        result["max_abs_diff"] = {k: max_over_ranks([v])[0] if isinstance(v, float) else v for k, v in diffs.items()}

    # ---- collectives per forward+backward ------------------------------------------------------
    result["collectives_per_fwd_bwd"] = {}
    for name, fn in impls.items():
        fn()  # warm
        result["collectives_per_fwd_bwd"][name] = collectives(fn)

    # ---- timing --------------------------------------------------------------------------------
    times: dict[str, list[float]] = {name: [] for name in impls}
    order = list(impls)
    params = [*mt.parameters()] + ([*ds.parameters()] if "deepspeed" in impls else [])
    for it in range(args.warmup + args.iters):
        for name in (order if it % 2 == 0 else order[::-1]):
            for p in params:
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            impls[name]()
            elapsed = time.perf_counter() - t0
            if it >= args.warmup:
                times[name].append(elapsed)
    result["times_s"] = {name: max_over_ranks(ts) for name, ts in times.items()}  # slowest rank per iteration
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--experts", default="grouped", choices=["grouped", "loop"], help="meshtrain's expert kernel")
    parser.add_argument("--router-std", type=float, default=0.02)
    parser.add_argument("--out")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.spawn(rank_main, args=(free_port(), args, path), nprocs=WORLD, join=True)
        with open(path) as f:
            r = json.load(f)
    out = {"what": "forward+backward of one MoE layer (router + experts), CPU, gloo, 2 ranks, ep=2, 1 thread/rank",
           "command": "/tmp/dsvenv/bin/python " + " ".join(sys.argv),
           "versions": {"torch": torch.__version__, "deepspeed": r["deepspeed"].get("version"),
                        "python": sys.version.split()[0]},
           "shapes": {"d_model": D, "expert_ffn_dim": I, "n_experts": E, "top_k": K, "ep": EP, "world": WORLD,
                      "rows_per_rank": args.rows, "seq_len": args.seq_len, "tokens_per_rank": args.rows * args.seq_len,
                      "dtype": "float32", "meshtrain_experts_kernel": args.experts, "router_std": args.router_std},
           "iters": args.iters, "warmup": args.warmup,
           "loadavg_1min_before_after": [load_before[0], os.getloadavg()[0]]}  # other work sharing the cores
    out["median_s"] = {name: statistics.median(ts) for name, ts in r["times_s"].items()}
    out["min_s"] = {name: min(ts) for name, ts in r["times_s"].items()}
    if "deepspeed" in out["median_s"]:
        out["ratio_meshtrain_over_deepspeed"] = out["median_s"]["meshtrain"] / out["median_s"]["deepspeed"]
        out["ratio_of_minima"] = out["min_s"]["meshtrain"] / out["min_s"]["deepspeed"]
    out["times_s"] = r["times_s"]
    for key in ("max_abs_diff", "collectives_per_fwd_bwd"):
        if key in r:
            out[key] = r[key]
    ds = dict(r["deepspeed"])
    if "error" not in ds:
        ds.pop("traceback", None)
    out["deepspeed"] = ds
    report(out, args.out)


if __name__ == "__main__":
    main()
