#!/usr/bin/env bash
# Side-by-side benchmarks against PyTorch's native peers. Each run interleaves ours and the
# peer step by step in one process tree and reports medians and the ratio (ours / peer).
# Results land in benchmarks/results/ as the JSON line of `meshtrain bench --json`.
set -euo pipefail
cd "$(dirname "$0")/.."
MESHTRAIN=${MESHTRAIN:-.venv/bin/meshtrain}
mkdir -p benchmarks/results

run() {  # name, then bench flags
  local name=$1; shift
  echo "== $name: meshtrain bench $*" >&2
  "$MESHTRAIN" bench "$@" --json | tail -n 1 > "benchmarks/results/$name.json"
  cat "benchmarks/results/$name.json"
}

# Data parallelism vs torch DDP (same model, data, world size, 25 MB buckets).
run ddp-gpt-small-dp2 --vs ddp --model gpt-small --dp 2 --steps 40
run ddp-mlp-dp4 --vs ddp --model mlp --data digits --dp 4 --batch-size 256 --steps 40
# Tensor (and sequence) parallelism vs DTensor's parallelize_module (same GPT, tp group, data).
run dtensor-tp-gpt-small-tp2 --vs dtensor-tp --model gpt-small --dp 1 --tp 2 --steps 20
run dtensor-tp-gpt-small-tp2-sp --vs dtensor-tp --model gpt-small --dp 1 --tp 2 --sp --steps 20
