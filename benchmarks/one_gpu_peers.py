"""One device, meshtrain against a plain PyTorch loop in the same run (issue 51, item 3): a
Llama in bf16 — meshtrain's bf16 weights with fp32 masters against the loop's autocast over
fp32 weights, both with AdamW (fused where the device has it) and clipping at 1.0, SDPA —
eager and with each block compiled (torch.compile per block, as `--compile` does), the two
stepped alternately on the same synthetic batches. Prints one JSON line per mode: tokens/s
and MFU of each, and meshtrain's step time over the loop's (medians after the warm-up).

    python benchmarks/one_gpu_peers.py --device cuda --shape 1b    # ~1.1B: gpu_check.sh step 10
    python benchmarks/one_gpu_peers.py --device cpu --shape tiny   # the rehearsal

torchtitan, the issue's second peer, is not installed on this machine nor on the lent
GPU's image (no network there): where `import torchtitan` fails the line says so."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import meshtrain
from meshtrain.models.llama import Llama
from meshtrain.models.specs import LlamaSpec
from meshtrain.plan.cost import peak_flops
from meshtrain.recipes import PRESETS, family_of
from meshtrain.report import device_name

SHAPES = {"tiny": (PRESETS["llama-test"], 256),
          "1b": (LlamaSpec(n_layers=16, n_heads=16, n_kv_heads=8, d_model=2048, ffn_dim=5632, max_seq_len=2048),
                 32000)}
LR = 3e-4


def _model(spec: LlamaSpec, vocab: int, device: str) -> Llama:
    torch.manual_seed(0)
    with torch.device(device):
        return Llama(spec, vocab)


def _adamw(params, device: str) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")


class Plain:
    def __init__(self, spec, vocab, device, compiled: bool):
        self.model, self.device = _model(spec, vocab, device), device
        if compiled:
            for block in self.model.layers:
                block.compile()
        self.opt = _adamw(self.model.parameters(), device)

    def step(self, x, y) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class Meshtrain:
    def __init__(self, spec, vocab, device, compiled: bool, backend: str):
        self.job = meshtrain.parallelize(_model(spec, vocab, device), meshtrain.init(device=device), precision="bf16",
                                         optimizer=lambda named: _adamw([p for _, p in named], device),
                                         clip_grad_norm=1.0, compile=compiled, compile_backend=backend)

    def step(self, x, y) -> torch.Tensor:
        return self.job.step(x, y).loss_tensor


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(args, compiled: bool) -> dict:
    spec, vocab = SHAPES[args.shape]
    peers = {"meshtrain": Meshtrain(spec, vocab, args.device, compiled, args.backend),
             "plain": Plain(spec, vocab, args.device, compiled)}
    times: dict[str, list[float]] = {name: [] for name in peers}
    g = torch.Generator().manual_seed(1)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(args.device)
        for name, peer in peers.items():
            _sync(args.device)
            t0 = time.perf_counter()
            peer.step(ids[:, :-1], ids[:, 1:]).item()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    flops = family_of(spec).flops_per_step(spec, args.batch_size, args.seq_len, vocab_size=vocab)
    peak = peak_flops(device_name(torch.device(args.device)), "bf16")
    tokens = args.batch_size * args.seq_len
    out = {"mode": "compiled" if compiled else "eager", "device": device_name(torch.device(args.device)),
           "shape": args.shape, "batch": [args.batch_size, args.seq_len]}
    for name, ts in times.items():
        median = statistics.median(ts)
        out[name] = {"step_s": median, "tokens_per_s": tokens / median, "mfu": flops / median / peak if peak else None}
    out["meshtrain_over_plain"] = out["meshtrain"]["step_s"] / out["plain"]["step_s"]
    try:
        import torchtitan  # noqa: F401
        out["torchtitan"] = "installed, not yet driven by this script"
    except ImportError:
        out["torchtitan"] = "not installed: no peer"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--modes", default="eager,compiled")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        print(json.dumps(run(args, compiled=mode == "compiled")), flush=True)


if __name__ == "__main__":
    main()
