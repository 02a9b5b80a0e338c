#!/usr/bin/env bash
# Data parallelism for linear layers: all-reduce vs all-gather vs auto (and torch DDP), the
# digits MLP with hidden widths 1024,1024, dp = 2 and 4, global batch 16 to 2048. Each dp is
# one process tree (torchrun) in which the four set-ups' steps are interleaved; then the plot.
source "$(dirname "$0")/common.sh"

for dp in 2 4; do
  echo "== linear-sync-mlp1024-dp$dp" >&2
  "$(dirname "$MESHTRAIN")/torchrun" --nproc-per-node "$dp" benchmarks/linear_sync.py \
    --out "benchmarks/results/linear-sync-mlp1024-dp$dp.json" "$@"
done
"$(dirname "$MESHTRAIN")/python" benchmarks/plot_linear_sync.py benchmarks/results/linear-sync-mlp1024-dp{2,4}.json \
  --png docs/img/linear-sync.png
