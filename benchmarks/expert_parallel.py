"""Expert parallelism on this machine: `moe-small` (8 experts, top-2, balanced routing, so
every layout moves the same rows) trained N steps by the command line in each layout, the
layouts alternated R rounds so they see the same load:

  one process      dp 1
  ep 1             dp 2, every rank holding all 8 experts
  ep 2             dp 2, each rank holding 4 (the experts' rows travel by all-to-all)
  ep 2 ZeRO-1      as ep 2, the optimizer states sharded (the experts' over their edp)

Reported per layout: the median of the runs' median step times and its ratio to ep 1 and
to one process, each rank's model-state bytes (parameters, gradients, optimizer states), the
bytes per step on every axis (`comm_bytes_per_step`: ep is the all-to-all), and the peak RSS.
On 2 cores the 2-rank layouts share the cores: time here says what the exchange costs
beside compute on one machine, not what a cluster would see.

    python benchmarks/expert_parallel.py --steps 20 --rounds 3 --out benchmarks/results/expert_parallel.json

`--overlap` instead times one MoE layer of moe-small's shapes alone (forward and backward,
2 ranks, ep 2, 1 thread each) with the dispatch overlapped with the rank's own experts'
work and without (`parallel/experts.dispatch_and_run(overlap=...)`), alternated, medians:

    python benchmarks/expert_parallel.py --overlap --iters 40 --out benchmarks/results/expert_overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = {"one process": ["--dp", "1"], "ep 1": ["--dp", "2"], "ep 2": ["--dp", "2", "--ep", "2"],
           "ep 2 ZeRO-1": ["--dp", "2", "--ep", "2", "--zero", "1"]}


def run(args, layout: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "meshtrain", "train", "--model", "moe-small", "--moe-routing", "balanced",
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--device", "cpu", "--out", out, "--json", *layout]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _overlap_rank(rank: int, port: int, iters: int, tokens: int, queue) -> None:
    import time

    import torch
    from functools import partial

    from meshtrain.comm import Comm
    from meshtrain.launch import RankEnv, init_distributed
    from meshtrain.mesh import Mesh
    from meshtrain.models.moe import Experts
    from meshtrain.parallel import experts as ep
    from meshtrain.recipes import PRESETS

    torch.set_num_threads(1)
    device = init_distributed(RankEnv("bench", rank, 2, rank, 2, "127.0.0.1", port), torch.device("cpu"))
    comm = Comm(Mesh.build(1, 2, 1, device, ep=2))
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.experts = Experts(PRESETS["moe-small"])
    for p in holder.experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ep.apply_expert_parallel(holder, comm, split_tp=False)
    experts, k, n_experts = holder.experts, 2, 8
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    chosen = torch.rand(tokens, n_experts, generator=torch.Generator().manual_seed(9 + rank)).topk(k, -1).indices
    weights = torch.full((tokens, k), 0.5)
    times = {True: [], False: []}
    for i in range(iters + 5):
        for overlap in ((True, False) if i % 2 else (False, True)):
            run = partial(ep.dispatch_and_run, overlap=overlap)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            order, token, counts = experts.sort_rows(chosen)
            y = experts.weigh(x, run(experts.compute, x[token], counts, comm), token, order, weights)
            y.square().sum().backward()
            elapsed = torch.tensor(time.perf_counter() - t0)
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            if i >= 5:
                times[overlap].append(elapsed.item())
    if rank == 0:
        queue.put(times)
    torch.distributed.destroy_process_group()


def overlap(args) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_overlap_rank, args=(r, port, args.iters, args.rows * args.seq_len, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    times = queue.get()
    for p in procs:
        p.join()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"what": "forward+backward of moe-small's experts (d 256, 8 experts of 352, top-2), 2 ranks, ep 2, "
                    "CPU, gloo, 1 thread per rank", "tokens_per_rank": args.rows * args.seq_len,
            "iters": args.iters, "overlapped_median_s": on, "serial_median_s": off, "ratio_overlapped_over_serial":
            on / off, "overlapped_s": times[True], "serial_s": times[False]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--overlap", action="store_true", help="time the dispatch overlapped and not (one layer)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.overlap:
        result = overlap(args)
        report(result, args.out, {k: v for k, v in result.items() if not k.endswith("_s") or "median" in k})
        return
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name, layout in LAYOUTS.items():
            runs[name].append(run(args, layout))
            print(f"round {r + 1}: {name}: {runs[name][-1]['step_time_median_s']:.3f} s/step", file=sys.stderr)
    out = {"model": "moe-small", "steps": args.steps, "rounds": args.rounds, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "layouts": {}}
    medians = {name: statistics.median(r["step_time_median_s"] for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        last = rs[-1]
        out["layouts"][name] = {
            "step_time_median_s": medians[name], "step_times_s": [r["step_time_median_s"] for r in rs],
            "vs_ep1": medians[name] / medians["ep 1"], "vs_one_process": medians[name] / medians["one process"],
            "model_state_bytes_per_rank": [s["total"] for s in last["model_state_bytes_per_rank"]],
            "comm_bytes_per_step": last["comm_bytes_per_step"], "peak_rss_mib_per_rank": last["peak_rss_mib_per_rank"],
            "final_loss": last["final_loss"]}
    report(out, args.out)


def report(result: dict, path: str | None, shown: dict | None = None) -> None:
    """Print `shown` (default: all of `result`) as JSON; write all of it to `path` if given."""
    print(json.dumps(result if shown is None else shown, indent=1))
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
