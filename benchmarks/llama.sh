#!/usr/bin/env bash
# llama-small (Llama-shaped: RMSNorm, SwiGLU, RoPE, 8 query heads over 4 key/value heads)
# against PyTorch's native peers, each run interleaving ours and the peer step by step.
source "$(dirname "$0")/common.sh"

run() { local name=$1; shift; record "$name" bench --model llama-small "$@"; }

run llama-ddp-dp2 --vs ddp --dp 2 --steps 20
run llama-fsdp2-dp2 --vs fsdp2 --zero 3 --dp 2 --steps 20
run llama-dtensor-tp-tp2 --vs dtensor-tp --dp 1 --tp 2 --steps 20
run llama-torch-pp-pp2 --vs torch-pp --dp 1 --pp 2 --microbatches 4 --steps 20
