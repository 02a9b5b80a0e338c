#!/usr/bin/env bash
# ZeRO: our stages 1 and 3 against PyTorch's peers on gpt-small (interleaved, ratio ours /
# peer), then the model-state bytes per rank of stages 0-3 at dp = 4 in bf16 for the README table.
source "$(dirname "$0")/common.sh"

for dp in 2 4; do
  record "zero1-gpt-small-dp$dp" bench --vs zero1 --zero 1 --model gpt-small --dp "$dp" --steps 20
  record "fsdp2-gpt-small-dp$dp" bench --vs fsdp2 --zero 3 --model gpt-small --dp "$dp" --steps 20
done
for zero in 0 1 2 3; do
  record "state-gpt-small-dp4-zero$zero" train --model gpt-small --dp 4 --zero "$zero" --precision bf16 --steps 2 \
    --out "runs/state-zero$zero"
done
