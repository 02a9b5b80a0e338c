"""The command line as users and outside scripts call it (contract in DESIGN.md)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from distributed import free_port
from helpers import (TINY, cli_config, last_json, on_the_layout, parent_of, process_name, ranks_of, run_cli, run_main,
                     start_cli, verify_in_ranks)

from meshtrain.cli import forked_ranks

TRAIN_KEYS = {"steps", "losses", "final_loss", "step_time_median_s", "tokens_per_s", "n_params", "layout",
              "model_state_bytes_per_rank", "activation_bytes_per_rank", "peak_rss_mib_per_rank",
              "comm_bytes_per_step"}
LAYOUT_KEYS = {"dp", "tp", "pp", "zero", "sp", "schedule", "microbatches", "recompute", "precision"}


def test_train_json_outputs_and_generate(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "--dp", "2", "--steps", "4", "--out", out, "--json", fresh=True)  # as typed in a shell
    assert r.returncode == 0, r.stderr
    j = last_json(r.stdout)
    assert TRAIN_KEYS <= j.keys() and LAYOUT_KEYS <= j["layout"].keys()
    assert j["steps"] == 4 and len(j["losses"]) == 4 and j["final_loss"] == j["losses"][-1]
    assert j["layout"]["dp"] == 2
    for key in ("model_state_bytes_per_rank", "activation_bytes_per_rank", "peak_rss_mib_per_rank"):
        assert len(j[key]) == 2
    assert j["model_state_bytes_per_rank"][0]["total"] == 16 * j["n_params"]
    assert all(a > 0 for a in j["activation_bytes_per_rank"])
    assert j["comm_bytes_per_step"]["dp"] == round(2 * (2 - 1) / 2 * 4 * j["n_params"])
    assert j["comm_bytes_per_step"].keys() >= {"dp", "tp", "pp", "cp", "ep", "edp"}  # every axis, 0 when unused
    assert j["comm_bytes_per_step"]["edp"] == 0
    assert j["device"] == "cpu" and j["mfu"] is None and j["model_flops_per_step"] > 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert (out / "loss.png").stat().st_size > 1000
    g = run_main("generate", "--ckpt", out, "--prompt", "ROMEO.", "--tokens", "20")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("ROMEO.") and len(g.stdout) > len("ROMEO.")


@pytest.mark.parametrize("layout", [
    ["--dp", "2"], ["--dp", "2", "--microbatches", "4"],
    # 4-rank runs through the command line; test_dp checks both layouts in-process in `make test`
    pytest.param(["--dp", "4"], marks=pytest.mark.slow),
    pytest.param(["--model", "mlp", "--data", "digits", "--dp", "4", "--batch-size", "32"], marks=pytest.mark.slow)])
def test_verify_layouts(layout):
    """`verify --json` as a user runs it; with micro-batches, the same report from the same
    calls in forked ranks (the shell's own output is checked once)."""
    base = TINY if "mlp" not in layout else ["--device", "cpu"]
    args = ("verify", *base, *layout, "--steps", "5")
    if "--microbatches" in layout:
        j = verify_in_ranks(cli_config(*args))
    else:
        r = run_cli(*args, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "PASS" in r.stderr  # the side-by-side table goes to stderr when --json owns stdout
        j = last_json(r.stdout)
    assert j["passed"] and j["first_failure"] is None and j["lockstep_steps"] == [1, 3, 5]
    tol = j["tolerances"]
    assert j["max_grad_rel_diff"] <= tol["grad"] and j["max_update_rel_diff"] <= tol["update"]
    assert {"max_loss_rel_diff", "max_param_rel_diff"} <= j.keys()  # trajectories, for information
    assert len(j["losses"]["layout"]) == len(j["losses"]["reference"]) == 5


def test_verify_under_torchrun_joins_its_processes():
    r = run_cli("--nproc-per-node", "2", "-m", "meshtrain", "verify", *TINY, "--dp", "2", "--steps", "3",
                launcher=("-m", "torch.distributed.run"))
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout and "starting" not in r.stderr


@pytest.mark.parametrize("launcher_env", [
    lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    lambda r: {"SLURM_PROCID": str(r), "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": str(r),
               "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "1"},
], ids=["mpirun", "srun"])
def test_joins_ranks_started_by_mpirun_or_srun(tmp_path, launcher_env):
    """Two processes with the variables mpirun/srun set, as those launchers would start them
    (forked from the tests' preloaded server, as `start_cli` starts a `train`)."""
    port = str(free_port())
    out = [(tmp_path / f"out{r}", tmp_path / f"err{r}") for r in range(2)]
    procs = [start_cli("train", *TINY, "--dp", "2", "--steps", "2", "--out", tmp_path / "run", "--json",
                       stdout=out[r][0], stderr=out[r][1], env={**launcher_env(r), "MASTER_PORT": port})
             for r in range(2)]
    codes = [p.wait(300) for p in procs]
    stdout, stderr = [o.read_text() for o, _ in out], [e.read_text() for _, e in out]
    assert codes == [0, 0], stderr[0] + stderr[1]
    j = last_json(stdout[0])
    assert j["layout"]["dp"] == 2 and len(j["model_state_bytes_per_rank"]) == 2
    assert stdout[1].strip() == ""  # only rank 0 reports


def test_bench_vs_ddp_smoke():
    """Only that the command runs and reports; timing claims live in benchmarks/."""
    r = run_cli("bench", "--vs", "ddp", *TINY, "--dp", "2", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    j = last_json(r.stdout)
    assert {"peer", "ours_step_time_median_s", "peer_step_time_median_s", "ratio", "ours_model_state_bytes",
            "peer_model_state_bytes"} <= j.keys()
    assert j["peer"] == "ddp" and j["ratio"] > 0
    assert j["ours_model_state_bytes"]["total"] == j["peer_model_state_bytes"]["total"]


def _bench(mesh, cfg, peer):
    from meshtrain.bench import run_bench
    from meshtrain.cli.bench import bench_options
    from meshtrain.comm import Comm
    return run_bench(bench_options(cfg, peer), Comm(mesh), peer)


def bench_in_ranks(peer: str, *flags) -> dict:
    """What `meshtrain bench --vs PEER FLAGS --json` prints, from the same calls in ranks forked
    from the preloaded server (the command itself runs in `test_bench_vs_ddp_smoke`)."""
    return on_the_layout(_bench, cli_config("bench", "--vs", peer, *TINY, *flags), peer)[0]


@pytest.mark.parametrize("peer, flags, bound", [
    ("ddp", ["--grad-dtype", "compute"], 0.0),  # the same bf16 arithmetic, step for step
    ("fsdp2", ["--zero", "3"], 1e-3),  # fp32 reduce-scatters; its masters are the unrounded fp32 init
])
def test_bench_peers_run_in_our_precision(peer, flags, bound):
    """Under bf16 the peers run and train the same model. DDP with bf16 gradients repeats our
    arithmetic exactly, which an fp32 peer could not; FSDP2's bound is a sanity check only
    (two steps from the same init are too few to tell its precision from the losses)."""
    j = bench_in_ranks(peer, "--dp", "2", *flags, "--precision", "bf16", "--steps", "2")
    assert j["max_loss_rel_diff"] <= bound


@pytest.mark.parametrize("sp", ["--no-sp", "--sp"])
def test_bench_vs_dtensor_tp_smoke(sp):
    j = bench_in_ranks("dtensor-tp", "--dp", "1", "--tp", "2", sp, "--steps", "2")
    assert j["peer"] == "dtensor-tp" and j["ratio"] > 0 and j["layout"]["sp"] == (sp == "--sp")
    assert j["max_loss_rel_diff"] < 1e-5  # the peer trains the same model
    assert j["ours_model_state_bytes"]["params"] == j["peer_model_state_bytes"]["params"]


@pytest.mark.parametrize("schedule", [["--schedule", "1f1b"], ["--schedule", "interleaved", "--chunks", "2"]])
def test_bench_vs_torch_pp_smoke(schedule):
    j = bench_in_ranks("torch-pp", "--dp", "1", "--pp", "2", "--microbatches", "4", *schedule, "--steps", "2")
    assert j["peer"] == "torch-pp" and j["ratio"] > 0 and j["layout"]["schedule"] == schedule[1]
    assert j["max_loss_rel_diff"] < 1e-6  # the same stages, data and loss scaling: the same losses
    assert j["ours_model_state_bytes"]["total"] == j["peer_model_state_bytes"]["total"]


@pytest.mark.slow
@pytest.mark.parametrize("runs", [pytest.param(10, id="10-runs")])
def test_two_rank_runs_exit_cleanly_every_time(tmp_path, runs):
    """The gloo exit-time crash of this torch build must never surface: every run exits
    cleanly, ten in a row under `make test-all` (`make test`'s two-rank commands each check
    their exit code: docs/tests.md)."""
    for attempt in range(runs):
        r = run_cli("train", *TINY, "--dp", "2", "--steps", "1", "--out", tmp_path, "--json")
        assert r.returncode == 0, f"run {attempt}: exit {r.returncode}\n{r.stderr}"
        assert last_json(r.stdout)["steps"] == 1


def test_a_killed_rank_ends_the_job_naming_that_rank_and_signal(tmp_path):
    """kill -9 of rank 1 mid-training: the job ends within 30 s, the message names rank 1 and
    SIGKILL (not the survivor the engine stopped), and no survivor's traceback is shown."""
    err_file = tmp_path / "stderr.txt"
    proc = start_cli("train", *TINY, "--dp", "2", "--steps", "100000", "--out", tmp_path / "run",
                     stdout=tmp_path / "stdout.txt", stderr=err_file)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    try:
        victim = ranks_of(proc.pid).get(1)
        assert victim, "rank 1 never started training"
        # forked from the launcher's fork server (cli/forked_ranks.py), itself the launcher's fork
        server = parent_of(victim)
        assert process_name(server) == forked_ranks.SERVER_NAME and parent_of(server) == proc.pid
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        proc.wait(timeout=60)
        elapsed = time.time() - killed_at
    finally:
        proc.kill()  # a job the test failed to end must not train on
    text = err_file.read_text()
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end"
    assert "rank 1 failed (signal 9, SIGKILL)" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]


def test_warmup_longer_than_the_run_and_zero_with_one_dp_rank_are_warnings_not_errors(tmp_path):
    r = run_cli("train", *TINY, "--dp", "1", "--zero", "2", "--steps", "2", "--warmup", "5", "--out", tmp_path,
                "--json")
    assert r.returncode == 0, r.stderr
    assert "meshtrain: warning: --warmup 5 >= --steps 2" in r.stderr
    assert "meshtrain: warning: --zero 2 with dp=1: there is no data-parallel group to shard over" in r.stderr
    j = last_json(r.stdout)
    assert j["steps"] == 2
    assert j["model_state_bytes_per_rank"][0]["total"] == 16 * j["n_params"]  # nothing sharded: plain DP


@pytest.mark.slow
@pytest.mark.timeout(1500)  # its command may take 1200 s
def test_long_gpt_small_verify_passes():
    """The acceptance run: gpt-small, dp=2, warm-up 1, 100 steps (about 2 minutes here)."""
    r = run_cli("verify", "--dp", "2", "--warmup", "1", "--steps", "100", "--device", "cpu", "--json", timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    j = last_json(r.stdout)
    assert j["passed"] and j["lockstep_steps"] == [1, 50, 100]


def test_plan_schedule_and_refused_input_do_not_load_torch():
    """`plan` and `schedule` are arithmetic, and bad input is refused before any work: none
    of them loads torch (~2 s here), so they answer at once."""
    code = ("import sys\n"
            "from meshtrain.cli import main\n"
            "codes = [main(['plan', '--model', 'gpt-small', '--tp', '2', '--pp', '2', '--microbatches', '4']),\n"
            "         main(['schedule', '--pp', '4', '--microbatches', '8', '--schedule', 'zb']),\n"
            "         main(['train', '--tp', '0'])]\n"
            "assert codes == [0, 0, 2], codes\n"
            "assert 'torch' not in sys.modules, 'torch was loaded'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "predicted step time" in r.stdout and "meshtrain: error: --tp 0" in r.stderr


@pytest.mark.parametrize("argv, line", [
    (["train", "--ep", "two"], "meshtrain: error: argument --ep: invalid int value: 'two' (see meshtrain train --help)"),
    (["plan", "--mem-headroom", "abc"], "meshtrain: error: argument --mem-headroom: invalid float value: 'abc' (see "
     "meshtrain plan --help)"),
    (["export", "--ckpt", "x"], "meshtrain: error: the following arguments are required: --out (see meshtrain "
     "export --help)"),
    (["trian"], "meshtrain: error: argument COMMAND: invalid choice: 'trian'"),
])
def test_argparse_errors_are_one_line_without_the_usage(argv, line, capsys):
    from meshtrain.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err


@pytest.mark.parametrize("ours", [False, True], ids=["outside-launcher", "meshtrain-s-launcher"])
def test_max_restarts_is_said_to_be_ignored_only_under_an_outside_launcher(ours, tmp_path):
    """Under torchrun, srun or mpirun restarts are the launcher's; meshtrain's own ranks, which
    it restarts itself, say nothing of it. (--out is held here, so that the rank stops at its
    claim, after the warnings.)"""
    from meshtrain.checkpoint.lock import OutLock
    from meshtrain.launch import LAUNCHER_PID_ENV
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           **({LAUNCHER_PID_ENV: str(os.getpid())} if ours else {})}
    lock = OutLock(tmp_path, log=print).acquire()
    try:
        r = run_cli("train", *TINY, "--dp", "1", "--max-restarts", "1", "--out", tmp_path, env=env, timeout=120,
                    fresh=ours)  # a rank of the launcher named in its environment: its child
    finally:
        lock.release()
    assert r.returncode == 2 and "is in use by another meshtrain job" in r.stderr, r.stderr
    assert ("--max-restarts is ignored" in r.stderr) is not ours, r.stderr
