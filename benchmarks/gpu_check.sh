#!/usr/bin/env bash
# What a lent GPU machine can check in a few minutes. That machine has torch (2.11), no
# network and no venv, so this runs on the system python3 with PYTHONPATH=. and no pip, on a
# text file in the repository (the bundled corpus is a pip package it does not have):
#   1. one-GPU `train` of the GPT-2-shaped preset, fp32 and bf16 (fp32 masters): tokens/s, MFU;
#   2. `verify` of a CUDA run against the one-process CPU reference;
#   3. with two or more GPUs, `verify --dp N` over NCCL;
#   4. tests/test_block_kernels.py: the ring's fused CUDA block kernels (flash bf16/fp16,
#      efficient fp32, cuDNN bf16) against sdpa (needs pytest; if missing, the outcome says so);
#   5. a one-GPU bf16 Llama `train` with torch.cuda.set_sync_debug_mode("warn"): every
#      synchronizing CUDA call warns, and the warnings are counted by where they were made.
#   6. benchmarks/compile.py: llama-small bf16 with each block compiled (inductor) against
#      eager, interleaved in one process: the compiled ÷ eager step ratio on this GPU.
#   7. a one-GPU bf16 MoE `train` (moe-small: grouped_mm's kernels), tokens/s and its balancing loss;
#   8. benchmarks/moe_replay.py: a recomputed MoE block replays its routing on this device (the
#      recomputation's ranking perturbed: the gradients those without recomputation), and its mutant;
#   9. benchmarks/dropout_keys.py: GPT-2-small's keyed dropout masks of a micro-batch (8 × 1,024)
#      hashed on the device, against the per-row CPU generators they replaced.
#  10. benchmarks/one_gpu_peers.py: a ~1.1B Llama in bf16, meshtrain against a plain PyTorch loop
#      (autocast, fused AdamW, SDPA) in the same run, eager and compiled: tokens/s, MFU, the ratio.
#  11. benchmarks/fp8_gpu.py: that Llama compiled in bf16 against --fp8 rowwise and tensorwise
#      (torchao): tokens/s, the ratio, the loss gap after 23 steps. Needs torchao importable (the
#      machine has no network: unpack its wheel onto PYTHONPATH); without it the outcome says so.
# outcomes.txt, summary.txt and results.tgz (each step's JSON line and log) land in $OUT (the
# device tool's output folder) or ./gpu-check.
# DEVICE=cpu MODEL=gpt-test SEQ_LEN=32 rehearses the script on a machine without a GPU.
# Every step runs whatever the others did; the end lists each step's outcome, and the script
# exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=${DATA:-benchmarks/data/hamlet.txt}
# The steps write into a folder of their own; $OUT (or ./gpu-check) gets three files at the end —
# outcomes.txt, summary.txt and results.tgz (every JSON line and log, not the run folders) —
# since the device tool brings back at most 8 files.
OUT_DIR=${OUT:-gpu-check}
RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$OUT_DIR"
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-gpt2}
SEQ_LEN=${SEQ_LEN:-1024}
STEPS=${STEPS:-30}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/meshtrain-cache}
mkdir -p "$RESULTS"

$PY -c "import torch; print('torch', torch.__version__, '| CUDA', torch.cuda.is_available(), '| GPUs',
torch.cuda.device_count(), '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" \
  | tee "$RESULTS/machine.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")

OUTCOMES=()
step() {  # step NAME JSON-FILE COMMAND...: run it, keep its JSON line, note how it ended
  local name=$1 json=$2; shift 2
  echo "== $name" >&2
  if "$@" | tail -n 1 > "$json" && [ -s "$json" ]; then OUTCOMES+=("ok      $name"); else OUTCOMES+=("FAILED  $name"); fi
}

step "1a. train $MODEL fp32 on one $DEVICE device" "$RESULTS/train.json" \
  $PY -m meshtrain train --model "$MODEL" --data "$DATA" --device "$DEVICE" --dp 1 --steps "$STEPS" --warmup 5 \
  --batch-size 8 --seq-len "$SEQ_LEN" --out "$RESULTS/run" --json
step "1b. train $MODEL bf16 on one $DEVICE device" "$RESULTS/train-bf16.json" \
  $PY -m meshtrain train --model "$MODEL" --data "$DATA" --device "$DEVICE" --dp 1 --steps "$STEPS" --warmup 5 \
  --batch-size 8 --seq-len "$SEQ_LEN" --precision bf16 --out "$RESULTS/run-bf16" --json
for f in "$RESULTS"/train*.json; do
  $PY -c "import json; j = json.load(open('$f')); print('$f', 'tokens/s', round(j['tokens_per_s']),
'| median step', round(j['step_time_median_s'], 4), 's | MFU', j['mfu'], '|', j['device'],
'| peak device MiB', j.get('peak_device_mib_per_rank'))" || true
done

step "2a. verify a $DEVICE run against the CPU reference" "$RESULTS/verify.json" \
  $PY -m meshtrain verify --model gpt-small --data "$DATA" --device "$DEVICE" --dp 1 --steps 6 --json
step "2b. verify with dropout 0.1 (keyed masks hashed on the device)" "$RESULTS/verify-dropout.json" \
  $PY -m meshtrain verify --model gpt-small --data "$DATA" --device "$DEVICE" --dp 1 --steps 6 --dropout 0.1 --json

if [ "$NGPU" -ge 2 ] && [ "$DEVICE" = cuda ]; then
  step "3. verify --dp $NGPU over NCCL" "$RESULTS/verify-nccl.json" \
    $PY -m meshtrain verify --model gpt-small --data "$DATA" --device cuda --dp "$NGPU" --batch-size $((4 * NGPU)) \
    --steps 6 --json
fi
for f in "$RESULTS"/verify*.json; do
  $PY -c "import json; j = json.load(open('$f')); print('$f', 'PASS' if j['passed'] else 'FAIL', 'grad',
'%.1e' % j['max_grad_rel_diff'], 'update', '%.1e' % j['max_update_rel_diff'], j['first_failure'] or '')" || true
done

echo "== 4. the ring's block kernels: tests/test_block_kernels.py" >&2
if ! $PY -c "import pytest" 2>/dev/null; then
  OUTCOMES+=("MISSING 4. block kernels: $PY has no pytest, so tests/test_block_kernels.py did not run")
elif $PY -m pytest -q -rs -p no:cacheprovider tests/test_block_kernels.py > "$RESULTS/block-kernels.txt" 2>&1; then
  OUTCOMES+=("ok      4. block kernels: $(tail -n 1 "$RESULTS/block-kernels.txt")")
else
  OUTCOMES+=("FAILED  4. block kernels: $(tail -n 1 "$RESULTS/block-kernels.txt")")
fi

# The CLI run in this process (world size 1 runs in-process), with every synchronizing CUDA call
# warning, each occurrence printed (warnings' default shows a line once).
SYNC_DEBUG="import runpy, sys, warnings, torch
warnings.simplefilter('always')
if torch.cuda.is_available(): torch.cuda.set_sync_debug_mode('warn')
sys.argv = ['meshtrain'] + sys.argv[1:]
runpy.run_module('meshtrain', run_name='__main__')"
SYNC_OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-sync.XXXXXX")
step "5. train llama-small bf16 on one $DEVICE device, sync debug on" "$RESULTS/train-llama-bf16-sync.json" \
  $PY -c "$SYNC_DEBUG" train --model llama-small --data "$DATA" --device "$DEVICE" --dp 1 --steps 10 --warmup 2 \
  --batch-size 8 --seq-len "$SEQ_LEN" --precision bf16 --out "$SYNC_OUT/run" --json 2> "$SYNC_OUT/stderr.txt"
{ echo "synchronizing CUDA calls warned: $(grep -c 'synchronizing CUDA operation' "$SYNC_OUT/stderr.txt")"
  echo "by where (count, file:line):"
  grep 'synchronizing CUDA operation' "$SYNC_OUT/stderr.txt" | sed 's/: UserWarning.*//' | sort | uniq -c | sort -rn
  if [[ ${OUTCOMES[-1]} == FAILED* ]]; then  # why: the run's last other stderr lines
    echo "the run failed; its last other stderr lines:"
    awk '/synchronizing CUDA operation/ {skip = 1; next} skip {skip = 0; next} {print}' "$SYNC_OUT/stderr.txt" | tail -n 20
  fi
} | tee "$RESULTS/sync-warnings.txt"
rm -rf "$SYNC_OUT"

step "6. --compile against eager: llama-small bf16 on one $DEVICE device" "$RESULTS/compile.json" \
  $PY benchmarks/compile.py --model llama-small --device "$DEVICE" --precision bf16 --batch-size 8 \
  --seq-len "$SEQ_LEN" --steps 20 --data "$DATA"
cat "$RESULTS/compile.json" >> "$RESULTS/sync-warnings.txt"

MOE_MODEL=${MOE_MODEL:-moe-small}
step "7. train $MOE_MODEL bf16 on one $DEVICE device" "$RESULTS/train-moe-bf16.json" \
  $PY -m meshtrain train --model "$MOE_MODEL" --data "$DATA" --device "$DEVICE" --dp 1 --steps 10 --warmup 2 \
  --batch-size 8 --seq-len "$SEQ_LEN" --precision bf16 --out "$RESULTS/run-moe" --json
$PY -c "import json; j = json.load(open('$RESULTS/train-moe-bf16.json')); print('moe tokens/s',
round(j['tokens_per_s']), '| balance loss', j.get('balance_loss'), '| load max/mean',
j.get('expert_load_max_over_mean'))" >> "$RESULTS/sync-warnings.txt" || true
step "8. a recomputed MoE block replays its routing on $DEVICE" "$RESULTS/moe-replay.json" \
  $PY benchmarks/moe_replay.py --device "$DEVICE"
cat "$RESULTS/moe-replay.json" >> "$RESULTS/sync-warnings.txt"
if ! grep -q '"passed": true' "$RESULTS/moe-replay.json"; then OUTCOMES+=("FAILED  8. the replay check's verdict"); fi

step "9. keyed dropout masks on $DEVICE against per-row CPU generators" "$RESULTS/dropout-keys.json" \
  $PY benchmarks/dropout_keys.py --device "$DEVICE" --rows 8 --repeats 3
cat "$RESULTS/dropout-keys.json" >> "$RESULTS/sync-warnings.txt"

PEER_SHAPE=${PEER_SHAPE:-1b}
for mode in eager compiled; do
  step "10. meshtrain against a plain loop, $PEER_SHAPE Llama bf16, $mode" "$RESULTS/peers-$mode.json" \
    $PY benchmarks/one_gpu_peers.py --device "$DEVICE" --shape "$PEER_SHAPE" --batch-size 2 --seq-len "$SEQ_LEN" \
    --steps 10 --warmup 3 --modes "$mode"
  cat "$RESULTS/peers-$mode.json" >> "$RESULTS/sync-warnings.txt"
done

if ! $PY -c "import torchao" 2>/dev/null; then
  OUTCOMES+=("SKIPPED 11. fp8: torchao is not importable here (pip install 'meshtrain[fp8]', or its wheel on PYTHONPATH)")
else
step "11. fp8 on one $DEVICE device: the $PEER_SHAPE Llama compiled, bf16 against --fp8 rowwise and tensorwise" \
  "$RESULTS/fp8.json" \
  $PY benchmarks/fp8_gpu.py --device "$DEVICE" --shape "$PEER_SHAPE" --batch-size 2 --seq-len "$SEQ_LEN" --steps 20 \
  --warmup 3
cat "$RESULTS/fp8.json" >> "$RESULTS/sync-warnings.txt"
fi

echo "== outcomes" >&2
printf '%s\n' "${OUTCOMES[@]}" | tee "$RESULTS/outcomes.txt"
cp "$RESULTS/outcomes.txt" "$OUT_DIR/"
cat "$RESULTS"/machine.txt "$RESULTS"/sync-warnings.txt > "$OUT_DIR/summary.txt" 2>/dev/null
tail -n 3 "$RESULTS"/block-kernels.txt >> "$OUT_DIR/summary.txt" 2>/dev/null
tar czf "$OUT_DIR/results.tgz" --exclude='./run' --exclude='./run-*' -C "$RESULTS" .
! printf '%s\n' "${OUTCOMES[@]}" | grep -q '^FAILED'
