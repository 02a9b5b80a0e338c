"""A MoE block's recomputation replays its forward's routing, on any device (issue 50):
`tests/test_routing_replay.py`'s check in one process, for a GPU (`gpu_check.sh`), where
the combine's order and the kernels' are the device's own.

The recomputation's router ranking is perturbed (large noise where autograd's engine runs
the router): with the replay the gradients equal the run without recomputation's; without
it (the mutant) they do not. Prints one JSON line:
{"device", "model", "recompute": {mode: worst relative gradient difference}, "mutant": {...},
"passed"}."""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

import meshtrain
from meshtrain.models import moe
from meshtrain.parallel import recompute
from meshtrain.recipes.build import build_model


def gradients(model_name: str, device: str, mode: str, noisy: bool, replay: bool) -> dict:
    real, noise = moe.TopKRouter.choose, torch.Generator(device=device).manual_seed(7)

    def choose(self, ranked):
        if noisy and moe._in_backward():
            ranked = ranked + 10 * torch.rand(ranked.shape, generator=noise, device=ranked.device)
        return real(self, ranked)
    torch.manual_seed(0)
    with mock.patch.object(moe.TopKRouter, "choose", choose), \
            mock.patch.object(recompute, "_replayed", recompute._replayed if replay else (lambda c: c)):
        model = build_model(model_name, 0, vocab_size=256)
        job = meshtrain.parallelize(model, meshtrain.init(device=device), recompute=mode,
                                    optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
        ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(3))
        job.backward(ids[:, :-1], ids[:, 1:])
        return {n: p.grad.detach().cpu().clone() for n, p in job.module.named_parameters() if p.grad is not None}


def worst(got: dict, want: dict) -> float:
    return max(float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in want.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="moe-test")
    args = ap.parse_args()
    plain = gradients(args.model, args.device, "none", False, True)
    replayed, mutant = {}, {}
    for mode in ("full", "segments:2"):
        replayed[mode] = worst(gradients(args.model, args.device, mode, True, True), plain)
        mutant[mode] = worst(gradients(args.model, args.device, mode, True, False), plain)
    passed = all(v <= 1e-6 for v in replayed.values()) and all(v > 1e-2 for v in mutant.values())
    print(json.dumps({"device": args.device, "model": args.model, "recompute": replayed, "mutant": mutant,
                      "passed": passed}))


if __name__ == "__main__":
    main()
