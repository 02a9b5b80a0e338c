import json
import os
import subprocess
import sys

# Small, fast settings shared by the end-to-end tests: the strategies' test preset on bytes of
# Shakespeare, on the CPU (so the suite runs unchanged on a machine with GPUs).
TINY = ["--model", "gpt-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8", "--device", "cpu"]


def run_cli(*args, timeout=300, env=None, launcher=("-m", "meshtrain")):
    """`python -m meshtrain ARGS` in a subprocess, as a user would run it."""
    return subprocess.run([sys.executable, *launcher, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])
