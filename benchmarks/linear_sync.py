"""All-reduce vs all-gather data parallelism for linear layers, swept over the global batch.

Run under torchrun, one process per dp rank (benchmarks/linear_sync.sh does):
    torchrun --nproc-per-node 4 benchmarks/linear_sync.py --batches 16,64,256 --out FILE.json

For each global batch B, the same MLP (digits, hidden widths 1024,1024) is set up four ways in
the same ranks — `--dp-linear-sync allreduce`, `allgather`, `auto`, and torch DDP (the native
all-reduce) — and their steps are interleaved (the order rotating every step), so a noisy
machine slows all alike. Recorded per B: median step time of each, the dp bytes each rank
sent per step as counted by comm.py (DDP's are not counted: it calls torch directly), and the
per-layer choice of auto beside each layer's predicted crossover, B < 2·(n_in + 1)·n_out/(n_in + n_out)."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from meshtrain.cli import config as C
from meshtrain.cli.validate import validate
from meshtrain.bench import interleaved
from meshtrain.bench.ddp import ddp_setup
from meshtrain.cli import bench_options
from meshtrain.comm import Comm, linear_sync_crossover
from meshtrain.launch import detect, init_distributed, shutdown_distributed
from meshtrain.mesh import Mesh
from meshtrain.parallel.linear_gather import choose_linear_syncs
from meshtrain.train import job_for, setup, train_step

SYNCS = ("allreduce", "allgather", "auto")


def config(sync: str, dp: int, batch: int, hidden: str, steps: int) -> C.Config:
    cfg = C.Config()
    cfg.model.name, cfg.model.mlp_hidden, cfg.train.data = "mlp", hidden, "digits"
    cfg.layout.dp, cfg.layout.dp_linear_sync = dp, sync
    cfg.train.batch_size, cfg.train.steps, cfg.train.device = batch, steps, "cpu"
    validate(cfg, world_size=dp)
    return cfg


def measure(comm: Comm, batch: int, hidden: str, steps: int) -> dict:
    """Collective: the four set-ups at one global batch, steps interleaved."""
    dp = comm.mesh.size("dp")
    runs = {}
    for sync in SYNCS:
        cfg = config(sync, dp, batch, hidden, steps)
        data, runs[sync] = setup(cfg, comm)
    peer = bench_options(config("allreduce", dp, batch, hidden, steps), "ddp").peer
    runs["ddp"] = job_for(ddp_setup(peer, comm), cfg)
    measured = interleaved(runs, data, lambda job, data, i: train_step(job, data, i, cfg), steps, comm, f"B={batch}")
    layers = choose_linear_syncs(runs["allreduce"].module, "auto", batch, dp, grad_size=4, activation_size=4)
    return {
        "batch": batch,
        "step_time_median_s": {name: statistics.median(t) for name, t in measured.times.items()},
        "dp_bytes_per_step": {name: statistics.median(s.get("dp", 0.0) for s in sent)
                              for name, sent in measured.sent.items() if name != "ddp"},
        "auto_choices": {c.name: c.sync for c in layers},
        "layer_bytes": {c.name: c.sent for c in layers},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--hidden", default="1024,1024")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    renv = detect()
    device = init_distributed(renv, torch.device("cpu"))
    torch.set_num_threads(1)
    mesh = Mesh.build(1, renv.world_size, 1, device)
    comm = Comm(mesh)
    points = []
    for batch in (int(b) for b in args.batches.split(",")):
        points.append(measure(comm, batch, args.hidden, args.steps))
        if mesh.is_main:
            p = points[-1]
            t = p["step_time_median_s"]
            print(f"dp={mesh.size('dp')} B={batch}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
                  + f"; auto: {p['auto_choices']}", flush=True)
    if mesh.is_main:
        widths = (64, *(int(w) for w in args.hidden.split(",")), 10)
        result = {"dp": mesh.size("dp"), "hidden": args.hidden, "steps": args.steps, "points": points,
                  "predicted_crossover": {f"{a}→{b}": linear_sync_crossover(a, b) for a, b in zip(widths, widths[1:])}}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    shutdown_distributed()


if __name__ == "__main__":
    main()
