"""How checkpoint save and load grow with the number of tensors: one process, a stack of N
small linear layers (2N parameters, AdamW: 6N state tensors beside them) after one step,
`job.save`/`job.load` against `torch.save`/`torch.load` of the same state (the model's and
the optimizer's state dicts) in the same folder, alternated rep by rep. One JSON line per N.

    python benchmarks/checkpoint_scaling.py [--layers 1000 4000] [--width 8] [--reps 3]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import meshtrain


def measure(layers: int, width: int, reps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    job = meshtrain.parallelize(model, meshtrain.init(device="cpu"), loss_fn=nn.functional.mse_loss,
                                optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-3))
    x = torch.randn(4, width)
    job.step(x, torch.zeros(4, width))
    times = {k: [] for k in ("save", "load", "torch_save", "torch_load")}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            t0 = time.perf_counter()
            job.save(Path(tmp) / f"ours-{rep}")
            times["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            job.load(Path(tmp) / f"ours-{rep}")
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.save({"model": job.module.state_dict(), "optim": job.optimizer.state_dict()}, Path(tmp) / "t.pt")
            times["torch_save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state = torch.load(Path(tmp) / "t.pt", weights_only=True)
            job.module.load_state_dict(state["model"])
            job.optimizer.load_state_dict(state["optim"])
            times["torch_load"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"layers": layers, "tensors": 2 * layers, **{f"{k}_s": v for k, v in med.items()},
            "save_ratio": med["save"] / med["torch_save"], "load_ratio": med["load"] / med["torch_load"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    for n in args.layers:
        print(json.dumps(measure(n, args.width, args.reps)), flush=True)


if __name__ == "__main__":
    main()
