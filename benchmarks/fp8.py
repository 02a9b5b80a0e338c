"""FP8 matmuls and low-bit optimizer states against bf16 AdamW (issue 54), on this machine.

Each configuration trains gpt-small from the same seed on the same batches (the bundled
text; `--steps` steps, 300 by default, one process) and reports its final loss (the mean of
the last 10 steps' losses, against a single batch's noise), its optimizer-state bytes
(`model_state_bytes.optimizer`, as measured by the trainer) and its median step time:

- bf16 AdamW (the baseline), bf16 with `--fp8 tensorwise` and `--fp8 rowwise` (emulated on a
  CPU: the numerics of fp8, not its speed; `--fp8-min-features 256` so that every block
  linear of gpt-small is converted);
- bf16 with `--optimizer adamw8bit`, `adamw4bit`, `adamwfp8`.

On a CPU the fp8 step times say what emulation costs, nothing of a GPU's fp8 (that is
`gpu_check.sh`'s). Prints a table and one JSON line; `--out FILE` keeps the JSON
(benchmarks/results/)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = [("bf16 AdamW", []),
           ("fp8 tensorwise", ["--fp8", "tensorwise", "--fp8-emulate", "--fp8-min-features", "256"]),
           ("fp8 rowwise", ["--fp8", "rowwise", "--fp8-emulate", "--fp8-min-features", "256"]),
           ("AdamW8bit", ["--optimizer", "adamw8bit"]),
           ("AdamW4bit", ["--optimizer", "adamw4bit"]),
           ("AdamWFp8", ["--optimizer", "adamwfp8"])]


def run(args: list[str]) -> dict:
    """`meshtrain train ARGS --json` in a fresh folder: its JSON."""
    out = Path(tempfile.mkdtemp(prefix="meshtrain-fp8-bench-"))
    cmd = [sys.executable, "-m", "meshtrain", "train", *args, "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    common = ["--model", args.model, "--steps", str(args.steps), "--dp", "1", "--precision", "bf16",
              "--batch-size", "8", "--seq-len", "128"]
    rows = []
    for name, flags in CONFIGS:
        result = run(common + flags)
        losses = result["losses"]
        rows.append({"config": name, "flags": " ".join(flags), "final_loss": statistics.mean(losses[-10:]),
                     "first_loss": losses[0], "optimizer_bytes": result["model_state_bytes_per_rank"][0]["optimizer"],
                     "step_time_median_s": result["step_time_median_s"]})
        print(f"  {name}: loss {rows[-1]['final_loss']:.4f}, optimizer {rows[-1]['optimizer_bytes'] / 2**20:.2f} MiB, "
              f"{rows[-1]['step_time_median_s'] * 1e3:.0f} ms/step", file=sys.stderr)
    base = rows[0]
    print(f"{'config':<16} {'final loss':>10} {'vs bf16':>8} {'opt MiB':>8} {'ms/step':>8}")
    for r in rows:
        r["loss_vs_bf16"] = r["final_loss"] / base["final_loss"] - 1
        print(f"{r['config']:<16} {r['final_loss']:>10.4f} {r['loss_vs_bf16']:>+8.2%} "
              f"{r['optimizer_bytes'] / 2**20:>8.2f} {r['step_time_median_s'] * 1e3:>8.0f}")
    record = {"benchmark": "fp8", "model": args.model, "steps": args.steps, "rows": rows}
    print(json.dumps(record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
