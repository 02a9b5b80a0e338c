"""The planner's predicted step time against measurement on this machine: take a machine
profile (`meshtrain plan --calibrate`), then for each layout run `meshtrain plan --machine
PROFILE --measure` — the prediction, and a real run of the same flags beside it.

    python benchmarks/plan_accuracy.py --out benchmarks/results/plan-accuracy-1.json

Each layout's error is predicted ÷ measured − 1 on the median step time of its run (steps
after the first; the first step also carries the activation meter). The profile is taken
in the same session, as the acceptance asks; pass --machine FILE to reuse one."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--model", "gpt-small", "--batch-size", "8", "--seq-len", "128"]
LAYOUTS = {
    "dp2": ["--dp", "2"],
    "tp2": ["--dp", "1", "--tp", "2"],
    "tp2+sp": ["--dp", "1", "--tp", "2", "--sp"],
    "pp2 1f1b m4": ["--dp", "1", "--pp", "2", "--microbatches", "4"],
    "dp2 zero3": ["--dp", "2", "--zero", "3"],
    "dp2·pp2": ["--dp", "2", "--pp", "2", "--microbatches", "2"],
}


def _run(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "meshtrain", *args], stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"meshtrain {' '.join(args)} failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help="a profile to reuse (default: calibrate now)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of " + ", ".join(LAYOUTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        machine = args.machine or str(Path(tmp, "machine.json"))
        if not args.machine:
            subprocess.run([sys.executable, "-m", "meshtrain", "plan", "--calibrate", "--machine", machine], check=True)
        rows = []
        for name in args.layouts.split(","):
            got = _run(["plan", *COMMON, *LAYOUTS[name], "--machine", machine, "--measure", "--json"])
            predicted, measured = got["predicted_step_time_s"], got["measured"]["step_time_median_s"]
            rows.append({"layout": name, "predicted_s": predicted, "measured_s": measured,
                         "error": predicted / measured - 1, "time_s": got["time_s"],
                         "bubble_predicted": got["bubble_fraction"], "bubble_measured": got["measured"]["bubble_fraction"]})
            print(f"{name:<14} predicted {predicted:.4f} s  measured {measured:.4f} s  {rows[-1]['error']:+.1%}",
                  flush=True)
        profile = json.loads(Path(machine).read_text())
    errors = [abs(r["error"]) for r in rows]
    summary = {"rows": rows, "mean_abs_error": statistics.mean(errors), "max_abs_error": max(errors),
               "within_15_percent": sum(e <= 0.15 for e in errors), "profile": profile}
    print(f"mean |error| {summary['mean_abs_error']:.1%}, max {summary['max_abs_error']:.1%}, "
          f"{summary['within_15_percent']} of {len(rows)} within 15 %")
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
