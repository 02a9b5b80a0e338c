"""Expert parallelism on this machine: `moe-small` (8 experts, top-2, balanced routing, so
every layout moves the same rows) trained N steps by the command line in each layout, the
layouts alternated R rounds so they see the same load:

  one process      dp 1
  ep 1             dp 2, every rank holding all 8 experts
  ep 2             dp 2, each rank holding 4 (the experts' rows travel by all-to-all)
  ep 2 ZeRO-1      as ep 2, the optimizer states sharded (the experts' over their edp)

Reported per layout: the median of the runs' median step times and its ratio to ep 1 and
to one process, each rank's model-state bytes (parameters, gradients, optimizer states), the
bytes per step on every axis (`comm_bytes_per_step`: ep is the all-to-all), and the peak RSS.
On 2 cores the 2-rank layouts share the cores: time here says what the exchange costs
beside compute on one machine, not what a cluster would see.

    python benchmarks/expert_parallel.py --steps 20 --rounds 3 --out benchmarks/results/expert_parallel.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = {"one process": ["--dp", "1"], "ep 1": ["--dp", "2"], "ep 2": ["--dp", "2", "--ep", "2"],
           "ep 2 ZeRO-1": ["--dp", "2", "--ep", "2", "--zero", "1"]}


def run(args, layout: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "meshtrain", "train", "--model", "moe-small", "--moe-routing", "balanced",
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
               "--device", "cpu", "--out", out, "--json", *layout]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for r in range(args.rounds):
        for name, layout in LAYOUTS.items():
            runs[name].append(run(args, layout))
            print(f"round {r + 1}: {name}: {runs[name][-1]['step_time_median_s']:.3f} s/step", file=sys.stderr)
    out = {"model": "moe-small", "steps": args.steps, "rounds": args.rounds, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "layouts": {}}
    medians = {name: statistics.median(r["step_time_median_s"] for r in rs) for name, rs in runs.items()}
    for name, rs in runs.items():
        last = rs[-1]
        out["layouts"][name] = {
            "step_time_median_s": medians[name], "step_times_s": [r["step_time_median_s"] for r in rs],
            "vs_ep1": medians[name] / medians["ep 1"], "vs_one_process": medians[name] / medians["one process"],
            "model_state_bytes_per_rank": [s["total"] for s in last["model_state_bytes_per_rank"]],
            "comm_bytes_per_step": last["comm_bytes_per_step"], "peak_rss_mib_per_rank": last["peak_rss_mib_per_rank"],
            "final_loss": last["final_loss"]}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
