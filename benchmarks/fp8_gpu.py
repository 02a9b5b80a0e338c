"""FP8 on one GPU (issue 54, `gpu_check.sh` step 11): a ~1.1B Llama (one_gpu_peers.py's `1b`
shape) in bf16 against `fp8="rowwise"` and `fp8="tensorwise"`, each block compiled (float8
gains only compiled: its casts fuse), through `meshtrain.parallelize` on one device.

Each mode trains from the same seed on the same random batches for `--steps` steps after
`--warmup`; the median step time gives tokens/s and the ratio to bf16, and the losses of the
last steps the gap to bf16. The modes run one after another (each holds a whole model's
state: three at once would not fit a 80 GB GPU at 1.1B). On a CPU (`--device cpu --shape tiny
--emulate --backend aot_eager`) it checks that the script runs; its times mean nothing.

    python benchmarks/fp8_gpu.py --device cuda --shape 1b    # one JSON line"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from one_gpu_peers import SHAPES, _adamw, _model  # noqa: E402  (the same model and optimizer as step 10)

import meshtrain  # noqa: E402


def run(args, fp8: str | None) -> dict:
    spec, vocab = SHAPES[args.shape]
    options = None if fp8 is None else meshtrain.Fp8Options(fp8, emulate=args.emulate, min_features=args.min_features)
    torch.manual_seed(0)
    job = meshtrain.parallelize(_model(spec, vocab, args.device), meshtrain.init(device=args.device), precision="bf16",
                                optimizer=lambda named: _adamw([p for _, p in named], args.device),
                                clip_grad_norm=1.0, compile=True, compile_backend=args.backend, fp8=options)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(args.device)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(job.step(ids[:, :-1], ids[:, 1:]).loss_tensor.item())
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    del job
    if args.device == "cuda":
        torch.cuda.empty_cache()
    median = statistics.median(times)
    return {"step_s": median, "tokens_per_s": args.batch_size * args.seq_len / median, "losses": losses,
            "final_loss": statistics.mean(losses[-min(5, len(losses)):])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--emulate", action="store_true", help="torchao's emulation (a device without fp8)")
    ap.add_argument("--min-features", type=int, default=1024)
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "shape": args.shape,
           "batch": [args.batch_size, args.seq_len], "steps": args.steps}
    for name, fp8 in (("bf16", None), ("fp8 rowwise", "rowwise"), ("fp8 tensorwise", "tensorwise")):
        out[name] = run(args, fp8)
        print(f"  {name}: {out[name]['tokens_per_s']:.0f} tokens/s, loss {out[name]['final_loss']:.4f}",
              file=sys.stderr, flush=True)
    for name in ("fp8 rowwise", "fp8 tensorwise"):
        out[name]["speedup_over_bf16"] = out["bf16"]["step_s"] / out[name]["step_s"]
        out[name]["loss_gap_to_bf16"] = out[name]["final_loss"] - out["bf16"]["final_loss"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
