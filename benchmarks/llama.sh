#!/usr/bin/env bash
# llama-small (Llama-shaped: RMSNorm, SwiGLU, RoPE, 8 query heads over 4 key/value heads)
# against PyTorch's native peers, each run interleaving ours and the peer step by step;
# ROUNDS rounds (default 3) of all four, for medians over runs.
source "$(dirname "$0")/common.sh"

run() { local name=$1; shift; record "$name" bench --model llama-small "$@"; }

for round in $(seq 1 "${ROUNDS:-3}"); do
  run "llama-ddp-dp2-r$round" --vs ddp --dp 2 --steps 20
  run "llama-fsdp2-dp2-r$round" --vs fsdp2 --zero 3 --dp 2 --steps 20
  run "llama-dtensor-tp-tp2-r$round" --vs dtensor-tp --dp 1 --tp 2 --steps 20
  run "llama-torch-pp-pp2-r$round" --vs torch-pp --dp 1 --pp 2 --microbatches 4 --steps 20
done
