#!/usr/bin/env bash
# Context parallelism against one process at the same sequence length (torch's
# `context_parallel` patches only CUDA kernels): llama-small, one sequence of SEQ tokens
# (default 2048), cp 1, 2 and 4 by the ring and cp 2 and 4 by all-to-all — activation bytes
# per rank, the cp bytes, step time. ROUNDS rounds (default 3), the layouts one after the
# other in each, for medians over runs. At cp 4 the 4 ranks share 2 cores here: its memory
# is the figure, not its time.
source "$(dirname "$0")/common.sh"

seq=${SEQ:-2048}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for layout in "1 ring" "2 ring" "4 ring" "2 ulysses" "4 ulysses"; do
    read -r cp mode <<< "$layout"
    record "context-llama-small-s$seq-cp$cp-$mode-r$round" train --model llama-small --dp 1 --cp "$cp" \
      --cp-mode "$mode" --seq-len "$seq" --batch-size 1 --steps 4 --warmup 0 --device cpu --out "runs/context-cp$cp"
  done
done
