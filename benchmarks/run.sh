#!/usr/bin/env bash
# Side-by-side benchmarks against PyTorch's native peers. Each run interleaves ours and the
# peer step by step in one process tree and reports medians and the ratio (ours / peer).
# Results land in benchmarks/results/ as the JSON line of `meshtrain bench --json`.
source "$(dirname "$0")/common.sh"

run() { local name=$1; shift; record "$name" bench "$@"; }  # name, then bench flags

# Data parallelism vs torch DDP (same model, data, world size, 25 MB buckets).
run ddp-gpt-small-dp2 --vs ddp --model gpt-small --dp 2 --steps 40
run ddp-mlp-dp4 --vs ddp --model mlp --data digits --dp 4 --batch-size 256 --steps 40
# Tensor (and sequence) parallelism vs DTensor's parallelize_module (same GPT, tp group, data).
run dtensor-tp-gpt-small-tp2 --vs dtensor-tp --model gpt-small --dp 1 --tp 2 --steps 20
run dtensor-tp-gpt-small-tp2-sp --vs dtensor-tp --model gpt-small --dp 1 --tp 2 --sp --steps 20
# Pipeline parallelism vs torch.distributed.pipelining (same stages, schedule, micro-batches).
run torch-pp-gpt-small-pp2-1f1b --vs torch-pp --model gpt-small --dp 1 --pp 2 --microbatches 4 --steps 20
run torch-pp-gpt-small-pp4-1f1b --vs torch-pp --model gpt-small --dp 1 --pp 4 --microbatches 8 --steps 20
# ZeRO-1 vs ZeroRedundancyOptimizer + DDP, ZeRO-3 vs FSDP2's fully_shard per block.
run zero1-gpt-small-dp2 --vs zero1 --zero 1 --model gpt-small --dp 2 --steps 20
run fsdp2-gpt-small-dp2 --vs fsdp2 --zero 3 --model gpt-small --dp 2 --steps 20
