"""The planner's predicted step time against measurement on this machine: take a machine
profile (`meshtrain plan --calibrate`), then for each layout run `meshtrain plan --machine
PROFILE --measure` — the prediction, and a real run of the same flags beside it.

    python benchmarks/plan_accuracy.py --out benchmarks/results/plan-accuracy-1.json

This 2-core VM drifts: one layout's median step moves ±10 % from one run to the next, and
so does a calibration (two taken a minute apart predict dp2 8-16 % apart). So the benchmark
runs `--rounds` rounds (default 3); each takes a fresh profile, then runs every layout
once. A layout's predicted time is the median of its rounds' predictions, its measured time
the median of its rounds' median steps (steps after the first; the first also carries the
activation meter), and its error predicted ÷ measured − 1; each round's own error is kept
too. Every profile is taken in the same session, as the acceptance asks; pass --machine
FILE to use one profile for every round instead.

Two statistics are reported. The headline compares the median prediction with the median
measurement; each may come from a different round, so a drift of the machine between rounds
falls on one and not the other. The paired one takes each round's error (its prediction
from the profile taken just before, against its own measurement) and reports their
median: the drift between rounds cancels in it, the drift within a round does not."""

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
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout, interleaved (default 3)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        names = args.layouts.split(",")
        runs = {name: [] for name in names}
        profiles = []
        for round_ in range(args.rounds):  # every layout once a round: the machine's drift falls on all alike
            machine = args.machine or str(Path(tmp, f"machine-{round_}.json"))
            if not args.machine:  # a profile a round, taken just before its runs
                subprocess.run([sys.executable, "-m", "meshtrain", "plan", "--calibrate", "--machine", machine],
                               check=True)
            profiles.append(json.loads(Path(machine).read_text()))
            for name in names:
                got = _run(["plan", *COMMON, *LAYOUTS[name], "--machine", machine, "--measure", "--json"])
                runs[name].append(got)
                print(f"round {round_ + 1}: {name:<14} predicted {got['predicted_step_time_s']:.4f} s  measured "
                      f"{got['measured']['step_time_median_s']:.4f} s", flush=True)
    rows = []
    for name in names:
        predictions = [r["predicted_step_time_s"] for r in runs[name]]
        medians = [r["measured"]["step_time_median_s"] for r in runs[name]]
        predicted, measured = statistics.median(predictions), statistics.median(medians)
        rows.append({"layout": name, "predicted_s": predicted, "measured_s": measured,
                     "predicted_per_round_s": predictions, "measured_per_round_s": medians,
                     "error": predicted / measured - 1,
                     "error_per_round": [p / m - 1 for p, m in zip(predictions, medians)],
                     "paired_error": statistics.median(p / m - 1 for p, m in zip(predictions, medians)),
                     "time_s_per_round": [r["time_s"] for r in runs[name]],
                     "bubble_predicted": runs[name][0]["bubble_fraction"],
                     "bubble_measured": statistics.median(r["measured"]["bubble_fraction"] for r in runs[name])})
        print(f"{name:<14} predicted {predicted:.4f} s  measured {measured:.4f} s  {rows[-1]['error']:+.1%}  "
              f"(rounds: {', '.join(f'{e:+.0%}' for e in rows[-1]['error_per_round'])}; "
              f"paired {rows[-1]['paired_error']:+.1%})", flush=True)
    errors = [abs(r["error"]) for r in rows]
    paired = [abs(r["paired_error"]) for r in rows]
    summary = {"rows": rows, "mean_abs_error": statistics.mean(errors), "max_abs_error": max(errors),
               "within_15_percent": sum(e <= 0.15 for e in errors),
               "paired_mean_abs_error": statistics.mean(paired), "paired_max_abs_error": max(paired),
               "paired_within_15_percent": sum(e <= 0.15 for e in paired), "profiles": profiles}
    print(f"mean |error| {summary['mean_abs_error']:.1%}, max {summary['max_abs_error']:.1%}, "
          f"{summary['within_15_percent']} of {len(rows)} within 15 %; paired by round: mean "
          f"{summary['paired_mean_abs_error']:.1%}, max {summary['paired_max_abs_error']:.1%}, "
          f"{summary['paired_within_15_percent']} of {len(rows)} within 15 %")
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
