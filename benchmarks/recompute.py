"""Activation checkpointing on one process: each `--recompute` mode against none, the same
model, data and seed, steps interleaved (the order rotating every step).

    python benchmarks/recompute.py --model gpt-small --attention math --steps 10 --out FILE.json

Recorded per mode: the activation bytes of the first step as the live-storage meter measures
them (it sees inside checkpoints and the recompute peak in backward), the median step time,
and both as ratios to none."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from meshtrain.cli import config as C
from meshtrain.cli.validate import validate
from meshtrain.bench import interleaved
from meshtrain.comm import Comm
from meshtrain.mesh import Mesh
from meshtrain.metrics import ActivationMeter
from meshtrain.train import setup, train_step

MODES = ("none", "full", "selective", "segments")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--attention", default="math")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = Comm(Mesh.single(torch.device("cpu")))
    runs, activations = {}, {}
    for mode in args.modes.split(","):
        cfg = C.Config()
        cfg.model.name, cfg.model.attention, cfg.layout.dp, cfg.layout.recompute = args.model, args.attention, 1, mode
        cfg.train.batch_size, cfg.train.seq_len, cfg.train.steps, cfg.train.device = (args.batch_size, args.seq_len,
                                                                                       args.steps, "cpu")
        validate(cfg)
        data, runs[mode] = setup(cfg, comm)
        meter = ActivationMeter()
        train_step(runs[mode], data, 0, cfg, meter=meter)  # measured apart: the meter slows a step
        activations[mode] = meter.peak
    measured = interleaved(runs, data, lambda job, data, i: train_step(job, data, i, cfg), args.steps, comm,
                           "recompute")
    times = {mode: statistics.median(t) for mode, t in measured.times.items()}
    result = {"model": args.model, "attention": args.attention, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "steps": args.steps, "activation_bytes": activations,
              "step_time_median_s": times,
              "activation_ratio": {m: activations[m] / activations["none"] for m in activations},
              "time_ratio": {m: times[m] / times["none"] for m in times}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for mode in runs:
        print(f"{mode:>10}: activations {activations[mode] / 2**20:8.1f} MiB ({result['activation_ratio'][mode]:.3f}"
              f" of none), median step {times[mode] * 1e3:7.1f} ms ({result['time_ratio'][mode]:.3f} of none)")


if __name__ == "__main__":
    main()
