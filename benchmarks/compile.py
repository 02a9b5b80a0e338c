"""`--compile` against eager on this machine: one process holds two jobs of the same model,
data and layout (dp 1), one with every block compiled, and steps them alternately, so both
see the same load. Prints one JSON line: each side's median step (after the warm-up steps,
which include the compilation), the ratio compiled / eager, the first step's time (the
compilation's cost) and what dynamo made of the blocks (graphs, graph breaks).

    python benchmarks/compile.py [--model gpt-small] [--backend inductor] [--steps 20]
        [--batch-size 8] [--seq-len 256] [--precision fp32] [--recompute none] [--device cpu]
        [--data PATH]  (the bundled corpus when not given)
"""

import argparse
import json
import statistics
import time

import torch

from meshtrain.cli.config import Config
from meshtrain.mesh import Mesh
from meshtrain.parallel.compile import compile_stats
from meshtrain.train import setup, train_step


def config(args, compiled: bool) -> Config:
    cfg = Config()
    cfg.model.name = args.model
    cfg.layout.dp, cfg.layout.precision, cfg.layout.recompute = 1, args.precision, args.recompute
    cfg.layout.compile, cfg.layout.compile_backend = compiled, args.backend
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = args.steps, args.batch_size, args.seq_len
    cfg.train.device = args.device
    if args.data:
        cfg.train.data = args.data
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians on each side")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--data", help="a text file, a folder of them or a prepared folder (default: the bundled corpus)")
    args = ap.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    comm = Mesh.single(device).comm
    configs = {"eager": config(args, False), "compiled": config(args, True)}
    jobs = {name: (cfg, *setup(cfg, comm)) for name, cfg in configs.items()}
    times = {name: [] for name in jobs}
    for step in range(args.steps):
        for name, (cfg, data, job) in jobs.items():
            t0 = time.perf_counter()
            train_step(job, data, step, cfg).loss  # the loss read: the whole step done
            times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t[args.warmup:]) for name, t in times.items()}
    print(json.dumps({"model": args.model, "backend": args.backend, "precision": args.precision,
                      "recompute": args.recompute, "batch_size": args.batch_size, "seq_len": args.seq_len,
                      "eager_step_s": medians["eager"], "compiled_step_s": medians["compiled"],
                      "ratio": medians["compiled"] / medians["eager"], "first_compiled_step_s": times["compiled"][0],
                      "first_eager_step_s": times["eager"][0], "dynamo": compile_stats(),
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
