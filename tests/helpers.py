import json
import os
import subprocess
import sys

# Small, fast settings shared by the end-to-end tests: the strategies' test preset on bytes of
# Shakespeare, on the CPU (so the suite runs unchanged on a machine with GPUs).
TINY = ["--model", "gpt-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8", "--device", "cpu"]


def small_config(model: str, steps: int, batch: int, **layout):
    """A `Config` for a run inside spawned ranks: `model` on its small data (digits for the
    MLP, bytes of Shakespeare cut to 32 tokens for a GPT), on the CPU, with small buckets."""
    from meshtrain.cli.config import Config
    c = Config()
    c.model.name = model
    c.layout.bucket_mb = 0.02
    for key, value in layout.items():
        setattr(c.layout, key, value)
    c.train.steps, c.train.batch_size, c.train.device = steps, batch, "cpu"
    if model == "mlp":
        c.train.data = "digits"
    else:
        c.train.seq_len, c.train.vocab_size = 32, 256
    return c


def run_cli(*args, timeout=300, env=None, launcher=("-m", "meshtrain")):
    """`python -m meshtrain ARGS` in a subprocess, as a user would run it."""
    return subprocess.run([sys.executable, *launcher, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])
