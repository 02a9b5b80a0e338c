#!/usr/bin/env bash
# Our zero-bubble schedule against our 1F1B: gpt-small, pp 2, m 4, RUNS alternating train
# runs (which goes first alternates), the median of the per-run ratios of median step
# times; then one traced zb run, whose median F, B (input pass) and W (weight pass) per
# stage calibrate the planner's zero-bubble split (`plan/planner.py`, ZB_INPUT_SHARE).
source "$(dirname "$0")/common.sh"
RUNS=${RUNS:-5}
FIRST=${FIRST:-1}  # to add runs to those already in benchmarks/results
PYTHON=${PYTHON:-.venv/bin/python}
for i in $(seq "$FIRST" $((FIRST + RUNS - 1))); do
  order="1f1b zb"; [ $((i % 2)) -eq 0 ] && order="zb 1f1b"
  for schedule in $order; do
    record "zb-vs-1f1b-gpt-small-pp2-m4-$schedule-run$i" train --model gpt-small --dp 1 --pp 2 --microbatches 4 \
      --schedule "$schedule" --steps 20 --out "/tmp/meshtrain-bench-$schedule"
  done
done
"$MESHTRAIN" train --model gpt-small --dp 1 --pp 2 --microbatches 4 --schedule zb --steps 8 \
  --out /tmp/meshtrain-trace-zb --trace benchmarks/results/trace-pp2-zb.json > /dev/null
record trace-pp2-zb-compare schedule --trace benchmarks/results/trace-pp2-zb.json --png docs/img/trace-pp2-zb.png
"$PYTHON" - <<'PY'
import json, statistics
from pathlib import Path
r = Path("benchmarks/results")
times = {s: [json.loads(p.read_text())["step_time_median_s"]
             for p in sorted(r.glob(f"zb-vs-1f1b-gpt-small-pp2-m4-{s}-run*.json"),
                             key=lambda p: int(p.stem.rsplit("run", 1)[1]))] for s in ("1f1b", "zb")}
pairs = [z / o for z, o in zip(times["zb"], times["1f1b"])]
print("zb / 1f1b step time:", [round(x, 3) for x in pairs], "median", round(statistics.median(pairs), 3),
      "| 1f1b s", [round(x, 3) for x in times["1f1b"]], "zb s", [round(x, 3) for x in times["zb"]])
compared = json.loads((r / "trace-pp2-zb-compare.json").read_text())
for stage, ops in enumerate(compared["op_median_s_per_stage"]):
    print(f"stage {stage}, median ms:", {op: round(t * 1e3, 1) for op, t in ops.items()})
last = compared["op_median_s_per_stage"][-1]
print("input share of the last stage's backward:", round(last["I"] / (last["I"] + last["W"]), 3))
PY
