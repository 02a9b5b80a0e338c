#!/usr/bin/env bash
# The pipeline after its transfers went into groups (one batch_isend_irecv each): ours
# against torch.distributed.pipelining, 1F1B, gpt-small, pp 2 m 4 over RUNS interleaved
# runs (each run interleaves the two step by step), and pp 4 m 8 once; then our own
# zero-bubble against our own 1F1B at pp 2 m 4, alternating train runs.
source "$(dirname "$0")/common.sh"
RUNS=${RUNS:-5}
for i in $(seq 1 "$RUNS"); do
  record "torch-pp-gpt-small-pp2-1f1b-run$i" bench --vs torch-pp --model gpt-small --dp 1 --pp 2 --microbatches 4 --steps 20
done
record torch-pp-gpt-small-pp4-1f1b bench --vs torch-pp --model gpt-small --dp 1 --pp 4 --microbatches 8 --steps 20
for i in $(seq 1 "$RUNS"); do
  for schedule in 1f1b zb; do
    record "train-gpt-small-pp2-m4-$schedule-run$i" train --model gpt-small --dp 1 --pp 2 --microbatches 4 \
      --schedule "$schedule" --steps 20 --out "runs/bench-$schedule"
  done
done
.venv/bin/python - <<'PY'
import json, statistics
from pathlib import Path
r = Path("benchmarks/results")
runs = sorted(r.glob("torch-pp-gpt-small-pp2-1f1b-run*.json"))
ratios = [json.loads(p.read_text())["ratio"] for p in runs]
print("pp2 1f1b vs torch-pp ratios:", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
pp4 = json.loads((r / "torch-pp-gpt-small-pp4-1f1b.json").read_text())
print("pp4 1f1b vs torch-pp ratio:", round(pp4["ratio"], 3))
times = {s: [json.loads(p.read_text())["step_time_median_s"] for p in sorted(r.glob(f"train-gpt-small-pp2-m4-{s}-run*.json"))]
         for s in ("1f1b", "zb")}
pairs = [z / o for z, o in zip(times["zb"], times["1f1b"])]
print("zb / 1f1b step time:", [round(x, 3) for x in pairs], "median", round(statistics.median(pairs), 3),
      "| 1f1b s", [round(x, 3) for x in times["1f1b"]], "zb s", [round(x, 3) for x in times["zb"]])
PY
