#!/usr/bin/env bash
# Simulated against measured at pp=2 (4 ranks on 2 cores would measure the machine, not the
# schedule): gpt-small trained with --trace under each schedule, then the simulator fed with
# that run's measured costs. Traces and comparisons land in benchmarks/results/, the
# pictures (measured over simulated) in docs/img/.
source "$(dirname "$0")/common.sh"
STEPS=${STEPS:-8}
mkdir -p docs/img

for schedule in gpipe 1f1b zb "interleaved --chunks 2"; do
  name=$(echo "$schedule" | cut -d' ' -f1)
  echo "== $name" >&2
  # shellcheck disable=SC2086
  "$MESHTRAIN" train --model gpt-small --dp 1 --pp 2 --microbatches 4 --schedule $schedule --steps "$STEPS" \
    --out "/tmp/meshtrain-trace-$name" --trace "benchmarks/results/trace-pp2-$name.json" > /dev/null
  record "trace-pp2-$name-compare" schedule --trace "benchmarks/results/trace-pp2-$name.json" \
    --png "docs/img/trace-pp2-$name.png"
done
