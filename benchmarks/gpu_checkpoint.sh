#!/usr/bin/env bash
# Checkpoints on a lent GPU machine (system python3, PYTHONPATH=., no venv), in a few minutes:
#   1. `train` of the GPT-2-shaped preset on one GPU saving every 10 steps, synchronously and
#      with --async-save (boxes staged to pinned host memory, written by a thread on a gloo
#      group): tokens/s of each and each save's blocking time;
#   2. the two step-30 checkpoints hold the same bytes (the async one the same moment as the
#      sync one), and both runs resumed from them to step 40 give the same losses (within 1e-5:
#      a GPU's reductions are not bitwise from one process to the next);
#   3. the checkpoint tests (CPU, gloo) on this machine's torch, the oldest torch meshtrain takes.
# summary.txt and the tests' output (tests.txt) land in $OUT (the device tool's output folder) or ./gpu-check.
# DEVICE=cpu MODEL=gpt-test SEQ_LEN=32 rehearses it on a machine without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=${DATA:-benchmarks/data/hamlet.txt}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-gpt2}
SEQ_LEN=${SEQ_LEN:-1024}
OUT_DIR=${OUT:-gpu-check}
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/gpu-checkpoint.XXXXXX")
export PYTHONPATH=. PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/meshtrain-cache}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
exec > >(tee "$SUMMARY") 2>&1
FAILED=0
train() {  # train NAME STEPS EXTRA...: one run into $RUNS/NAME, its JSON line into $RUNS/NAME-STEPS.json
  local name=$1 steps=$2; shift 2
  $PY -m meshtrain train --model "$MODEL" --data "$DATA" --device "$DEVICE" --dp 1 --steps "$steps" --warmup 5 \
    --batch-size 8 --seq-len "$SEQ_LEN" --save-every 10 --keep 2 --out "$RUNS/$name" --json "$@" \
    > "$RUNS/$name-$steps.json" 2> "$RUNS/$name-$steps.err" || { echo "FAILED $name $steps:"; tail -n 15 "$RUNS/$name-$steps.err"; FAILED=1; }
}
echo "== 1. $MODEL on one $DEVICE device, saving every 10 steps"
train sync 30
train async 30 --async-save
for name in sync async; do
  $PY -c "import json; j = json.load(open('$RUNS/$name-30.json')); print('$name', 'tokens/s', round(j['tokens_per_s']),
'| median step', round(j['step_time_median_s'], 4), 's | final loss', j['final_loss'])" || FAILED=1
  tr '\r' '\n' < "$RUNS/$name-30.err" | grep -oE "meshtrain: (saving|saved) .*" | sed "s|$RUNS/||"
done
echo "== 2. the step-30 checkpoints, entry by entry (the random states aside), then resumed to step 40"
$PY -c "import json, sys
from pathlib import Path
def entries(folder):
    index = json.loads((folder / 'index.json').read_text())
    return {fqn: (folder / path).read_bytes()[start:start + length]
            for fqn, _, path, start, length, _ in index['storage'] if not fqn.startswith('rng/')}
a, b = (entries(Path('$RUNS', n, 'step-30')) for n in ('sync', 'async'))
differ = [k for k in a if a[k] != b.get(k)]
print(len(a), 'entries,', sum(map(len, a.values())), 'bytes;', 'identical' if not differ and a.keys() == b.keys()
      else 'DIFFERENT: %s' % differ[:5])
sys.exit(1 if differ or a.keys() != b.keys() else 0)" || FAILED=1
train sync 40 --resume
train async 40 --resume
$PY -c "import json
a, b = (json.load(open('$RUNS/%s-40.json' % n)) for n in ('sync', 'async'))
worst = max(abs(x - y) / abs(x) for x, y in zip(a['losses'], b['losses']))
print('sync losses ', a['losses']); print('async losses', b['losses'])
print('largest relative difference %.1e' % worst, '(bitwise)' if worst == 0 else '(a GPU\'s kernels are not bitwise across processes)')
raise SystemExit(0 if worst < 1e-5 else 'the resumed losses differ')" || FAILED=1
cat "$RUNS"/*-40.err | tr '\r' '\n' | grep -E "^meshtrain: resumed" | sed "s|$RUNS/||"
echo "== 3. checkpoint tests on $($PY -c 'import torch; print("torch", torch.__version__)')"
# tests/test_mesh.py starts ranks without checkpoints: it tells torch's checkpoint API from rank start-up
$PY -m pytest -q -rf -p no:cacheprovider tests/test_mesh.py tests/test_checkpoint_reads.py tests/test_async_save.py \
  tests/test_checkpoint_scaling.py > "$RUNS/tests.txt" 2>&1 || FAILED=1
tail -n 8 "$RUNS/tests.txt"
cp "$RUNS/tests.txt" "$OUT_DIR/"
rm -rf "$RUNS"
exit $FAILED
