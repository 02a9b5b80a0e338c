# Sourced by the benchmark scripts: run from the repository root, results in one folder, and
# `record NAME COMMAND FLAGS...` keeps the JSON line of `meshtrain COMMAND FLAGS --json`.
set -euo pipefail
cd "$(dirname "$0")/.."
MESHTRAIN=${MESHTRAIN:-.venv/bin/meshtrain}
mkdir -p benchmarks/results

record() {
  local name=$1 command=$2; shift 2
  echo "== $name: meshtrain $command $*" >&2
  "$MESHTRAIN" "$command" "$@" --json | tail -n 1 > "benchmarks/results/$name.json"
  cat "benchmarks/results/$name.json"
}
