#!/usr/bin/env bash
# verify on gpt-small for the ZeRO layouts of the README: every stage at dp = 2 and 4, with
# two micro-batches, inside dp × tp × pp; then bf16 loss curves against the fp32 one-process
# run over 50 steps.
source "$(dirname "$0")/common.sh"

for dp in 2 4; do
  for zero in 1 2 3; do
    record "verify-zero$zero-dp$dp" verify --model gpt-small --dp "$dp" --zero "$zero" --steps 6
  done
done
for zero in 1 2 3; do
  record "verify-zero$zero-dp2-mb2" verify --model gpt-small --dp 2 --zero "$zero" --microbatches 2 --steps 6
done
for zero in 1 3; do
  record "verify-zero$zero-dp2-tp2-pp2" verify --model gpt-small --dp 2 --tp 2 --pp 2 --zero "$zero" \
    --microbatches 2 --steps 6
done
# bf16 matmuls run ~15-30x slower than fp32 on a CPU without bf16 units (this one: AVX2
# only), about 8 s a step of gpt-small: the two ends, plain DP and stage 3 (the test suite
# runs stages 0 and 3 in bf16 on gpt-test, `make test-all` also 1, 2 and dp2·tp2·pp2 with 1 and 3).
for zero in 0 3; do
  record "verify-bf16-zero$zero-dp2" verify --model gpt-small --dp 2 --zero "$zero" --precision bf16 --steps 50
done
