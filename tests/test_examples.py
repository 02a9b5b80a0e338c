"""The examples as a user runs them from a fresh clone: as scripts on ranks that torchrun
started (each trains and then checks itself with `meshtrain.verify`), and through
`meshtrain verify --model examples.<name>:factory`. Two ranks here, one example under torchrun
itself and the others on ranks given torchrun's environment; all three under torchrun on
four ranks are marked slow."""

import os
import sys
from pathlib import Path

import pytest
from helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]


def _env() -> dict[str, str]:
    """A user's shell in a fresh clone: the repository on the import path, a thread per rank."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _torchrun(example: str, ranks: int, steps: int):
    import subprocess
    return subprocess.run([*TORCHRUN, str(ranks), "--master-port", str(_port()), f"examples/{example}.py",
                           f"--steps={steps}"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())


def _as_torchrun_ranks(example: str, ranks: int, steps: int):
    """The script on `ranks` processes forked from the tests' preloaded server, each with the
    environment torchrun gives its ranks: what `_torchrun` runs, without its fresh
    interpreters (torchrun's own, then one per rank: ~4 s each here)."""
    from distributed import run_script_ranks
    return run_script_ranks(str(ROOT / "examples" / f"{example}.py"), [f"--steps={steps}"], ranks, _env(),
                            timeout=600)


def _port() -> int:
    from distributed import free_port
    return free_port()


@pytest.mark.parametrize("example, steps, says, run", [
    ("cnn_digits", 40, "verify (dp=2, ZeRO-3): PASS", _as_torchrun_ranks),
    ("transformer", 5, "{'pp': 2}: loss after 5 steps", _as_torchrun_ranks),
    ("hf_style", 10, "bf16 + full recompute, against fp32 one process): PASS", _torchrun),
], ids=["cnn_digits", "transformer", "hf_style-under-torchrun"])
def test_examples_run_on_two_ranks_and_pass_their_verify(example, steps, says, run):
    ran = run(example, 2, steps)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert says in ran.stdout, ran.stdout
    assert "FAIL" not in ran.stdout


@pytest.mark.slow
@pytest.mark.parametrize("example", ["cnn_digits", "transformer", "hf_style"])
def test_examples_on_four_ranks(example):
    run = _torchrun(example, 4, 10)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "PASS" in run.stdout and "FAIL" not in run.stdout


@pytest.mark.parametrize("example, flags", [
    ("cnn_digits", ["--dp", "2", "--zero", "3", "--batch-size", "32"]),
    pytest.param("transformer", ["--tp", "2", "--seq-len", "32"], marks=pytest.mark.slow),
    pytest.param("hf_style", ["--dp", "2", "--precision", "bf16", "--recompute", "full"], marks=pytest.mark.slow),
])
def test_meshtrain_verify_takes_a_users_model(example, flags):
    run = run_cli("verify", "--model", f"examples.{example}:factory", "--steps", "3", "--device", "cpu", *flags,
                  env={"PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"PASS: examples.{example}:factory" in run.stdout
