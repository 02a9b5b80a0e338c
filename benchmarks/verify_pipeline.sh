#!/usr/bin/env bash
# The README's verify table for pipeline layouts on gpt-small (10 steps, batch 8×128): every
# schedule at pp=2 (m=4) and pp=4 (m=8), and the 3D layouts with 1f1b and interleaved. Each
# JSON line lands in benchmarks/results/verify-<name>.json.
source "$(dirname "$0")/common.sh"

run() { local name=$1; shift; record "verify-$name" verify --model gpt-small "$@"; }  # name, then verify flags

for pp_m in "2 4" "4 8"; do
  set -- $pp_m
  run "pp$1-gpipe" --dp 1 --pp "$1" --microbatches "$2" --schedule gpipe
  run "pp$1-1f1b" --dp 1 --pp "$1" --microbatches "$2" --schedule 1f1b
  run "pp$1-interleaved" --dp 1 --pp "$1" --microbatches "$2" --schedule interleaved --chunks 2
  run "pp$1-zb" --dp 1 --pp "$1" --microbatches "$2" --schedule zb
done
run dp2-pp2-1f1b --dp 2 --pp 2 --microbatches 4
run dp2-pp2-interleaved --dp 2 --pp 2 --microbatches 4 --schedule interleaved --chunks 2
run tp2-pp2-1f1b --dp 1 --tp 2 --pp 2 --microbatches 4
run tp2-pp2-interleaved --dp 1 --tp 2 --pp 2 --microbatches 4 --schedule interleaved --chunks 2
run tp2-sp-pp2-1f1b --dp 1 --tp 2 --sp --pp 2 --microbatches 4
run dp2-tp2-pp2-1f1b --dp 2 --tp 2 --pp 2 --microbatches 4
run dp2-tp2-pp2-interleaved --dp 2 --tp 2 --pp 2 --microbatches 4 --schedule interleaved --chunks 2
