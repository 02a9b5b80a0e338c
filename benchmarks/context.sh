#!/usr/bin/env bash
# Context parallelism against one process at the same sequence length (torch's
# `context_parallel` patches only CUDA kernels): llama-small, one sequence of SEQ tokens
# (default 2048), cp 1, 2 and 4 — activation bytes per rank, the ring's bytes, step time.
# At cp 4 the 4 ranks share 2 cores here: its memory is the figure, not its time.
source "$(dirname "$0")/common.sh"

seq=${SEQ:-2048}
for cp in 1 2 4; do
  record "context-llama-small-s$seq-cp$cp" train --model llama-small --dp 1 --cp "$cp" --seq-len "$seq" \
    --batch-size 1 --steps 4 --warmup 0 --device cpu --out "runs/context-cp$cp"
done
