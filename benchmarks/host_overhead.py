"""A step's host work against a plain PyTorch loop (issue 51): a model whose compute is tiny
(GPT-shaped, 12 blocks, d 64, 2 × 32 tokens), one process, so that the step is the host's
dispatching. meshtrain's `job.step` against a plain loop on the same model and batches
(AdamW where matrices decay, clipping at 1.0 by the foreach norm, `zero_grad`), in fp32 and
in bf16 (meshtrain's bf16 weights with fp32 masters against the loop's autocast), each:

- the torch operations one step dispatches (aten ops, counted by a TorchDispatchMode), and
  which of meshtrain's are beyond the loop's (`--list`);
- the step time, interleaved (the two alternate step by step), median of `--steps` per run.

Prints one JSON line per precision: {"precision", "ops": {"meshtrain", "plain", "ratio"},
"step_s": {"meshtrain", "plain", "ratio"}}. The bounds the issue sets: ops ≤ 1.05×, time
≤ 1.08× (medians of 3 runs)."""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import meshtrain
from meshtrain.models.gpt import GPT
from meshtrain.models.specs import GPTSpec

SPEC = GPTSpec(n_layers=12, n_heads=4, d_model=64, max_seq_len=32)
VOCAB, ROWS, SEQ, LR = 256, 2, 32, 1e-3


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(SPEC, VOCAB)


def _batch(step: int):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


class Plain:
    """The plain loop's step."""

    def __init__(self, precision: str):
        self.model, self.bf16 = _model(), precision == "bf16"
        decayed = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=LR, betas=(0.9, 0.95), eps=1e-8)

    def step(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad()
        return loss


class Meshtrain:
    def __init__(self, precision: str):
        self.job = meshtrain.parallelize(_model(), meshtrain.init(device="cpu"), precision=precision,
                                         optimizer=meshtrain.adamw(LR, weight_decay=0.1), clip_grad_norm=1.0)

    def step(self, x, y):
        return self.job.step(x, y).loss_tensor


def ops_of(runner, step: int) -> collections.Counter:
    with Ops() as ops:
        runner.step(*_batch(step))
    return ops.seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    ap.add_argument("--list", action="store_true", help="print the operations meshtrain dispatches beyond the loop's")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for precision in (["fp32", "bf16"] if args.precision == "both" else [args.precision]):
        ours, plain = Meshtrain(precision), Plain(precision)
        for s in range(3):  # warm: the first steps settle the loss's weighting and the optimizer's state
            ours.step(*_batch(s))
            plain.step(*_batch(s))
        mine, theirs = ops_of(ours, 3), ops_of(plain, 3)
        times = {"meshtrain": [], "plain": []}
        for s in range(4, 4 + args.steps):
            for name, runner in (("meshtrain", ours), ("plain", plain)):
                t0 = time.perf_counter()
                runner.step(*_batch(s)).item()
                times[name].append(time.perf_counter() - t0)
        m, p = sum(mine.values()), sum(theirs.values())
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"precision": precision, "ops": {"meshtrain": m, "plain": p, "ratio": m / p},
                          "step_s": {**med, "ratio": med["meshtrain"] / med["plain"]}}))
        if args.list:
            extra = {k: mine[k] - theirs.get(k, 0) for k in mine if mine[k] > theirs.get(k, 0)}
            fewer = {k: theirs[k] - mine.get(k, 0) for k in theirs if theirs[k] > mine.get(k, 0)}
            print(json.dumps({"beyond_the_loop": dict(sorted(extra.items(), key=lambda kv: -kv[1])),
                              "fewer_than_the_loop": dict(sorted(fewer.items(), key=lambda kv: -kv[1]))}))


if __name__ == "__main__":
    main()
