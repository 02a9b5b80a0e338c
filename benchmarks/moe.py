"""The mixture-of-experts family on this machine, one process:

  balance  `moe-small` trained N steps with each balancing (none, the sequence-wise
           auxiliary loss, the auxiliary-loss-free bias): each router's busiest expert over
           the mean load per step (1 is even; 8, all tokens on one expert), summarised over
           the last tenth of the run, with the final loss;
  time     `moe-small` against the dense Llama of the same active size (`llama-small`: its
           SwiGLU is 704 wide, the MoE's two 352-wide experts per token), stepped alternately
           in one process so both see the same load: median step times and their ratio.

    python benchmarks/moe.py balance --steps 300 --out benchmarks/results/moe_balance.json
    python benchmarks/moe.py time --steps 30 --out benchmarks/results/moe_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.mesh import Mesh
from meshtrain.train import setup, train, train_step


def config(model: str, steps: int, batch: int, seq_len: int, **moe) -> Config:
    cfg = Config()
    cfg.model.name = model
    for k, v in moe.items():
        setattr(cfg.model, f"moe_{k}", v)
    cfg.layout.dp = 1
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.device = steps, batch, seq_len, "cpu"
    cfg.train.warmup = min(20, steps // 10)
    return cfg


def balance(args) -> dict:
    comm = Comm(Mesh.single(torch.device("cpu")))
    out = {}
    for kind in args.kinds.split(","):
        cfg = config("moe-small", args.steps, args.batch_size, args.seq_len, balance=kind)
        with tempfile.TemporaryDirectory() as folder:
            cfg.train.out = folder
            t0 = time.perf_counter()
            result = train(cfg, comm)
        ratios = result.expert_load_max_over_mean  # per step: each router's max/mean
        tail = ratios[-max(1, len(ratios) // 10):]
        out[kind] = {"steps": len(ratios), "final_loss": result.losses[-1],
                     "max_over_mean_worst_router_tail": statistics.mean(max(r) for r in tail),
                     "max_over_mean_mean_router_tail": statistics.mean(statistics.mean(r) for r in tail),
                     "max_over_mean_worst_router_first_10": statistics.mean(max(r) for r in ratios[:10]),
                     "per_router_tail": [statistics.mean(r[i] for r in tail) for i in range(len(tail[0]))],
                     "seconds": time.perf_counter() - t0}
        print(kind, json.dumps(out[kind]), file=sys.stderr)
    return out


def step_times(args) -> dict:
    comm = Comm(Mesh.single(torch.device("cpu")))
    jobs = {}
    for name in ("moe-small", "llama-small"):
        cfg = config(name, args.steps, args.batch_size, args.seq_len)
        jobs[name] = (cfg, *setup(cfg, comm))
    times = {name: [] for name in jobs}
    for step in range(args.steps):
        for name, (cfg, data, job) in jobs.items():
            t0 = time.perf_counter()
            train_step(job, data, step, cfg).loss  # the loss read: the whole step done
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
    return {"moe_step_s": medians["moe-small"], "dense_step_s": medians["llama-small"],
            "ratio": medians["moe-small"] / medians["llama-small"], "threads": torch.get_num_threads(),
            "n_params": {name: job.parallel.n_params for name, (_, _, job) in jobs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["balance", "time"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3, help="time: steps left out of the medians")
    ap.add_argument("--kinds", default="none,sequence,bias", help="balance: the --moe-balance kinds to run")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {"what": args.what, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
              "torch": torch.__version__, **(balance(args) if args.what == "balance" else step_times(args))}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
