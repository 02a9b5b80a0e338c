"""The optimizer step of meshtrain at dp 1 (`job.update`: the global norm, clipping, the
user's optimizer, zeroing) against the same user optimizer driven by hand with torch's
`clip_grad_norm_(foreach=True)`, on the same model and gradients, interleaved rep by rep.
Prints the medians and the ratio (ours / torch) as one JSON line.

    python benchmarks/optimizer_step.py [--layers 100] [--width 256] [--reps 30] [--foreach]
"""

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn as nn

import meshtrain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) on both sides")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    theirs = copy.deepcopy(model)

    def factory(named):
        return torch.optim.AdamW((p for _, p in named), lr=1e-3, foreach=args.foreach or None)

    job = meshtrain.parallelize(model, meshtrain.init(device="cpu"), optimizer=factory, clip_grad_norm=1.0,
                                precision=args.precision)
    optimizer = factory(list(theirs.named_parameters()))
    grads = [torch.randn_like(p) for p in theirs.parameters()]
    loss = torch.zeros(())
    ours_s, torch_s = [], []
    for _ in range(args.reps):
        for p, g in zip(job.parallel.trained, grads):
            p.grad = g.to(p.dtype).clone()
        t0 = time.perf_counter()
        job.update(loss)
        ours_s.append(time.perf_counter() - t0)
        for p, g in zip(theirs.parameters(), grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
        torch_s.append(time.perf_counter() - t0)
    ours, peer = statistics.median(ours_s[3:]), statistics.median(torch_s[3:])
    print(json.dumps({"tensors": 2 * args.layers, "params": sum(p.numel() for p in theirs.parameters()),
                      "precision": args.precision, "foreach": args.foreach, "ours_step_s": ours,
                      "torch_step_s": peer, "ratio": ours / peer}))


if __name__ == "__main__":
    main()
