"""What `train --ft-replicas R` costs and how it recovers (issue 53), on this machine's CPU:

1. **Cost per step without a failure**: 2 replica groups of 1 rank (`--ft-replicas 2 --dp 1`)
   against plain data parallelism over the same 2 ranks (`--dp 2`), same model, batch and
   steps, interleaved over `--rounds` rounds; the ratio of the runs' median step times (the
   median of the per-round ratios). Also 2 groups of dp 2 ZeRO-1 against dp 4 ZeRO-1.
2. **The survivor's stall per failure**: group 1 killed (SIGKILL) at the end of step 10, and
   inside step 10's gradient all-reduce, with the lighthouse's heartbeat timeout at 5 s
   (torchft's default) and 1 s; the survivor's stall is the extra time its next committed
   step took (`ft_stall_s` in its log: the failed tries plus the wait for the quorum).
3. **The heal time against the state size**: group 1 killed at step 4 (batch 4 × 64), for
   models from 0.2 M to 124 M parameters (gpt-test, gpt-small, gpt2); the restarted group's
   `ft_healed_s` (from asking for the quorum to holding the live group's weights, AdamW
   moments and step) against its state's bytes.

Prints a table and one JSON line; `--out FILE` keeps the JSON (benchmarks/results/)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH = ["--batch-size", "8", "--seq-len", "128"]


def run(args: list[str], env: dict | None = None) -> tuple[dict, Path]:
    """`meshtrain train ARGS --json` in a fresh folder: its JSON and the folder."""
    import os
    out = Path(tempfile.mkdtemp(prefix="meshtrain-ft-bench-"))
    cmd = [sys.executable, "-m", "meshtrain", "train", *args, "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1800)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]), out


def log(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]


def cost(model: str, steps: int, rounds: int) -> list[dict]:
    pairs = [("2 groups × dp 1", ["--ft-replicas", "2", "--dp", "1"], "dp 2", ["--dp", "2"]),
             ("2 groups × dp 2 ZeRO-1", ["--ft-replicas", "2", "--dp", "2", "--zero", "1"], "dp 4 ZeRO-1",
              ["--dp", "4", "--zero", "1"])]
    rows = []
    for name, ft_flags, peer, peer_flags in pairs:
        ratios, ours, theirs = [], [], []
        for _ in range(rounds):
            a, _ = run(["--model", model, *BATCH, "--steps", str(steps), *ft_flags])
            b, _ = run(["--model", model, *BATCH, "--steps", str(steps), *peer_flags])
            ours.append(a["step_time_median_s"])
            theirs.append(b["step_time_median_s"])
            ratios.append(ours[-1] / theirs[-1])
            print(f"  {name}: {ours[-1]:.3f} s vs {peer}: {theirs[-1]:.3f} s", file=sys.stderr)
        rows.append({"ft": name, "peer": peer, "model": model, "ft_step_s": statistics.median(ours),
                     "peer_step_s": statistics.median(theirs), "ratio": statistics.median(ratios),
                     "ratios": ratios})
    return rows


def failure(model: str, steps: int, kind: str, heartbeat_s: float, at: int = 10, batch=BATCH) -> dict:
    """Group 1 killed at step `at` (`kind`: kill at its end, or kill-in-allreduce inside it)."""
    got, out = run(["--model", model, *batch, "--steps", str(steps), "--ft-replicas", "2", "--dp", "1",
                    "--max-restarts", "1", "--ft-heartbeat-timeout", str(heartbeat_s), "--ft-bucket-mb", "1"],
                   env={"MESHTRAIN_FAULT": f"{kind}:0:{at}:1"})
    survivor, joined = log(out), log(out, "ft-group-1.jsonl")
    failed_at = at if kind == "kill-in-allreduce" else at + 1
    stall = survivor[failed_at - 1]["ft_stall_s"]
    alone = sum(1 for d in survivor if d["ft_live"] == 1)
    heals = [d for d in joined if "ft_healed_s" in d]
    steady = statistics.median(d["step_time_s"] for d in survivor)
    return {"model": model, "n_params": got["n_params"], "kind": kind, "heartbeat_timeout_s": heartbeat_s,
            "stall_s": stall, "steady_step_s": steady, "steps_alone": alone,
            "heal_s": heals[-1]["ft_healed_s"] if heals else None, "healed_at_step": heals[-1]["step"] if heals else None,
            "state_bytes": 12 * got["n_params"],  # fp32 weights + AdamW's two moments
            "ft": got["ft"], "final_loss": got["final_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--heals-only", action="store_true", help="only part 3, merged into --out's JSON")
    args = ap.parse_args()
    t0 = time.time()
    result = {"cost": [], "failures": [], "heals": []}
    if args.heals_only and args.out and Path(args.out).is_file():
        result = {**json.loads(Path(args.out).read_text()), "heals": []}
    elif not args.heals_only:
        result["cost"] = cost("gpt-small", args.steps, args.rounds)
    for kind in ("kill", "kill-in-allreduce") if not args.heals_only else ():
        for heartbeat in (5.0, 1.0):
            result["failures"].append(failure("gpt-small", args.steps, kind, heartbeat))
            print(f"  {kind}, heartbeat {heartbeat:g} s: stall {result['failures'][-1]['stall_s']:.2f} s",
                  file=sys.stderr)
    for model, steps in (("gpt-test", 400), ("gpt-small", 30), ("gpt2", 40)):  # the state size varies; enough steps to outlast a restart
        result["heals"].append(failure(model, steps, "kill", 1.0, at=4, batch=["--batch-size", "4", "--seq-len", "64"]))
        print(f"  {model}: heal {result['heals'][-1]['heal_s']}", file=sys.stderr)
    result["wall_s"] = time.time() - t0
    print("cost per step without a failure (ratio: ft / peer, median of rounds)")
    for r in result["cost"]:
        print(f"  {r['ft']:>24} vs {r['peer']:<12} {r['ft_step_s']:.3f} s / {r['peer_step_s']:.3f} s = {r['ratio']:.2f}")
    print("the survivor's stall per failure (gpt-small, 2 groups of 1 rank)")
    for f in result["failures"]:
        print(f"  {f['kind']:>18}, heartbeat {f['heartbeat_timeout_s']:g} s: stall {f['stall_s']:.2f} s "
              f"(steady step {f['steady_step_s']:.3f} s), alone {f['steps_alone']} steps, heal {f['heal_s']}")
    print("heal time against the state size")
    for h in result["heals"]:
        print(f"  {h['model']:>14} {h['n_params'] / 1e6:6.2f} M params, {h['state_bytes'] / 2**20:7.1f} MiB: "
              f"heal {h['heal_s']} s (at step {h['healed_at_step']})")
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
