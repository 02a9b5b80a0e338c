"""Does `train --layout-search` choose well? (issue 52) World 2 (on two cores a larger world
measures the scheduler, not the layouts), gpt-small, the default batch (8 × 128):

1. `--runs` searches (`--candidates 3 --reprofile`, each a fresh profile), each recording its
   choice, the candidates it measured and its profile time against `--search-budget`;
2. a fixed set of 12 valid layouts (every axis: dp with ZeRO 0-3, micro-batches and
   recompute, tp with and without SP, pp under 1F1B and the zero-bubble schedule, cp by the
   ring and by all-to-all) plus every layout a search chose, each trained `--steps` steps,
   interleaved over `--rounds` rounds (layout by layout within a round), the median of each
   layout's per-run medians taken;
3. the planner's predicted step time of each (`plan --machine`), and its Spearman rank
   correlation with the measured medians over the set.

A search passes when its choice's measured median is within 10 % of the fastest measured.
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

MODEL = ["--model", "gpt-small"]
SET = [
    {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3},
    {"dp": 2, "microbatches": 2}, {"dp": 2, "recompute": "full"},
    {"dp": 1, "tp": 2}, {"dp": 1, "tp": 2, "sp": True},
    {"dp": 1, "pp": 2, "microbatches": 4}, {"dp": 1, "pp": 2, "microbatches": 4, "schedule": "zb"},
    {"dp": 1, "cp": 2}, {"dp": 1, "cp": 2, "cp_mode": "ulysses"},
]
DEFAULTS = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "cp_mode": "ring", "ep": 1, "zero": 0, "sp": False,
            "schedule": "1f1b", "chunks": 1, "microbatches": 1, "recompute": "none"}


def full(layout: dict) -> dict:
    return {**DEFAULTS, **{k: v for k, v in layout.items() if k in DEFAULTS}}


def key(layout: dict) -> str:
    return json.dumps(full(layout), sort_keys=True)


def flags(layout: dict) -> list[str]:
    out = []
    for k, v in full(layout).items():
        if k == "sp":
            out += ["--sp"] if v else []
        else:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def meshtrain(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "meshtrain", *args, "--json"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"meshtrain {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", help="a machine profile (default: calibrated here first, ~45 s)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--search-budget", type=float, default=120.0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-layout-search-"))
    machine = args.machine or str(tmp / "machine.json")
    if not args.machine:
        subprocess.run([sys.executable, "-m", "meshtrain", "plan", "--calibrate", "--machine", machine], check=True,
                       stdout=subprocess.DEVNULL)
    searches = []
    for run in range(args.runs):
        got = meshtrain("train", *MODEL, "--layout-search", "--reprofile", "--machine", machine, "--steps", "1",
                        "--search-budget", str(args.search_budget), "--out", str(tmp / f"search-{run}"))
        s = got["layout_search"]
        searches.append({"chosen": full(s["candidates"][s["chosen"]]["layout"]), "profile_s": s["profile_s"],
                         "candidates": s["candidates"]})
        print(f"search {run + 1}: chose {flags(searches[-1]['chosen'])} after {s['profile_s']:.1f} s", file=sys.stderr)
    layouts = {key(lay): full(lay) for lay in SET}
    for s in searches:
        layouts.setdefault(key(s["chosen"]), s["chosen"])
    times: dict[str, list[float]] = {k: [] for k in layouts}
    for r in range(args.rounds):
        for k, lay in layouts.items():
            got = meshtrain("train", *MODEL, *flags(lay), "--steps", str(args.steps), "--out", str(tmp / "run"))
            times[k].append(got["step_time_median_s"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    measured = {k: statistics.median(v) for k, v in times.items()}
    predicted = {k: meshtrain("plan", *MODEL, *flags(lay), "--machine", machine)["predicted_step_time_s"]
                 for k, lay in layouts.items()}
    fastest = min(measured.values())
    in_set = [key(lay) for lay in SET]
    rho = spearman([predicted[k] for k in in_set], [measured[k] for k in in_set])
    print(f"{'layout':<62} {'predicted s':>11} {'measured s':>10} {'/fastest':>8}")
    for k, lay in sorted(layouts.items(), key=lambda kv: measured[kv[0]]):
        print(f"{' '.join(flags({x: y for x, y in lay.items() if y != DEFAULTS[x] or x == 'dp'})):<62} "
              f"{predicted[k]:>11.4f} {measured[k]:>10.4f} {measured[k] / fastest:>8.3f}")
    verdicts = [measured[key(s["chosen"])] / fastest for s in searches]
    for i, (s, v) in enumerate(zip(searches, verdicts), 1):
        print(f"search {i}: chosen at {v:.3f}× the fastest measured ({'pass' if v <= 1.10 else 'FAIL'}); profile "
              f"{s['profile_s']:.1f} s of --search-budget {args.search_budget:g}")
    print(f"planner's rank correlation over the {len(SET)} layouts (Spearman): {rho:.3f}")
    result = {"model": "gpt-small", "world": 2, "steps": args.steps, "rounds": args.rounds,
              "search_budget_s": args.search_budget, "searches": searches, "chosen_over_fastest": verdicts,
              "passed": sum(v <= 1.10 for v in verdicts), "spearman": rho,
              "layouts": [{"layout": layouts[k], "predicted_step_s": predicted[k], "measured_step_s": measured[k],
                           "runs_s": times[k]} for k in layouts], "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
