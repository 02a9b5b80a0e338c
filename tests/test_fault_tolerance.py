"""`train --ft-replicas R` (torchft): R replica groups, each a whole layout (here dp 2 with
ZeRO-1 inside each), their gradients summed over the live groups each step, a step committed
only when torchft's vote says every all-reduce of it held. A group's rank is killed mid-step
(inside the gradient all-reduce) and between steps: the surviving group goes on, commits no
step that used a partial all-reduce (its final weights equal a one-process replay of the
steps it committed, with the rows of the groups that were live in each; a mutant that
commits anyway fails that replay), and the killed group restarts, heals from the survivor
and from then on holds the survivor's state bit for bit (a digest of each rank-0 state
logged per step). Without a failure, 2 groups train what one process trains on the same
global batch. Refusals need no torchft; the runs are skipped without it."""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import pytest

from helpers import cli_config, last_json, run_cli, run_main

needs_torchft = pytest.mark.skipif(not __import__("meshtrain.replicas", fromlist=["available"]).available(),
                                   reason="torchft is not installed (pip install 'meshtrain[ft]')")
RUN = ["--model", "gpt-test", "--batch-size", "8", "--seq-len", "32", "--zero", "1", "--dropout", "0.1"]
FT = ["--ft-replicas", "2", "--dp", "2", "--ft-bucket-mb", "0.2"]  # a few buckets: a kill can fall between them
STEPS = 24
DIGESTS = {"MESHTRAIN_FT_DIGESTS": "1"}


def log_of(out: Path, group: int = 0) -> list[dict]:
    name = "metrics.jsonl" if group == 0 else f"ft-group-{group}.jsonl"
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]


def ft_run(out: Path, *extra, env=None, steps: int = STEPS):
    r = run_cli("train", *RUN, *FT, "--steps", steps, "--out", out, "--json", *extra, env={**DIGESTS, **(env or {})},
                timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest ‖a − b‖ / ‖b‖ over the tensors of two state dicts, and its name."""
    worst = (0.0, "")
    for name, want in b.items():
        got, want = a[name].detach().double(), want.detach()
        d = float((got - want.double()).norm() / max(float(want.double().norm()), 1e-30))
        worst = max(worst, (d, name))
    return worst


def replay(out: Path, log: list[dict], steps: int) -> dict:
    """One process trains each step `log` committed with the rows of the groups live in it
    (the first live·B/R of the step's global batch), through the same loop; its weights."""
    import torch

    import meshtrain.train as train_module
    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh

    lives = {d["step"]: d["ft_live"] for d in log}
    assert sorted(lives) == list(range(1, steps + 1))

    class Replay:  # the one process stands for every live group: its share is the whole batch
        def __init__(self):
            self._step = 0

        def begin_step(self):
            return Whole(lives[self._step + 1])

        @property
        def step(self):
            return self._step

        def sum_(self, tensors, step):
            pass

        def commit(self):
            self._step += 1
            return True

        def report(self):
            return None

        def shutdown(self):
            pass

        def set_step(self, step):
            assert step == 0

        options = SimpleNamespace(replicas=2)

    def replica_groups(cfg, job, start):
        job.replicas = Replay()
        return job.replicas

    cfg = cli_config("train", *RUN, "--dp", "1", "--ft-replicas", "2", "--steps", steps, "--out", out / "replay")
    saved = train_module.replica_groups
    train_module.replica_groups = replica_groups
    try:
        result = train_module.train(cfg, Comm(Mesh.single(torch.device("cpu"))))
    finally:
        train_module.replica_groups = saved
    return {k: v.detach().clone() for k, v in result.parallel.module.state_dict().items()}


@dataclass
class Whole:
    """A quorum of `live` groups whose rows one process trains alone (`StepQuorum`'s fields)."""
    live: int
    index: int = 0
    wait_s: float = 0.0
    healed_s: float | None = None
    share: tuple[int, int] = (0, 1)


def saved_weights(out: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(out / "model.safetensors"))


def check_survivor_committed_only_whole_steps(out: Path) -> None:
    """The survivor's final weights are a one-process replay's of the steps it logged."""
    log = log_of(out)
    steps = [d["step"] for d in log]
    assert steps == list(range(1, STEPS + 1)), f"the survivor logged steps {steps}: one committed twice or skipped"
    want = replay(out, log, STEPS)
    got = saved_weights(out)
    from meshtrain.verifier import DRIFT_TOLERANCE
    d, name = max_rel_diff(got, {k: v for k, v in want.items() if k in got})
    assert d < DRIFT_TOLERANCE, f"{name}: the survivor's weights differ from the replay of its steps by {d:.2e}"


def check_healed_in_lockstep(out: Path) -> int:
    """Group 1's rank-0 state digest equals group 0's at every step both logged after its
    heal; returns the step it healed at."""
    g0 = {d["step"]: d for d in log_of(out)}
    g1 = log_of(out, 1)
    healed = [d["step"] for d in g1 if "ft_healed_s" in d]
    assert healed, "the restarted group logged no heal"
    after = [d for d in g1 if d["step"] >= healed[-1]]
    assert after and after[-1]["step"] == STEPS
    assert all(d["ft_digest"] == g0[d["step"]]["ft_digest"] for d in after)
    return healed[-1]


@pytest.fixture(scope="module")
def unfailed(tmp_path_factory):
    out = tmp_path_factory.mktemp("unfailed")
    return out, last_json(ft_run(out).stdout)


@needs_torchft
def test_two_groups_without_a_failure_train_what_one_process_trains(unfailed, tmp_path):
    out, got = unfailed
    assert got["ft"] == {"replicas": 2, "failures": 0, "heals": 0, "uncommitted_steps": 0}
    r = run_cli("train", *RUN, "--dp", "1", "--steps", STEPS, "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    one = last_json(r.stdout)
    from meshtrain.verifier import DRIFT_TOLERANCE, STEP_LOSS_TOLERANCE
    assert all(abs(a - b) / abs(b) < STEP_LOSS_TOLERANCE for a, b in zip(got["losses"], one["losses"])), \
        (got["losses"], one["losses"])
    d, name = max_rel_diff(saved_weights(out), saved_weights(tmp_path))
    assert d < DRIFT_TOLERANCE, f"{name}: {d:.2e}"
    log = log_of(out)
    assert [d["ft_live"] for d in log] == [2] * STEPS and all(d["ft_tries"] == 1 for d in log)
    assert [d["ft_digest"] for d in log] == [d["ft_digest"] for d in log_of(out, 1)]  # the groups in lockstep


@needs_torchft
def test_a_group_killed_inside_the_all_reduce_costs_one_uncommitted_step_and_heals(unfailed, tmp_path):
    r = ft_run(tmp_path, "--max-restarts", "1", env={"MESHTRAIN_FAULT": "kill-in-allreduce:1:5:1"})
    got = last_json(r.stdout)
    assert got["ft"]["uncommitted_steps"] >= 1 and got["ft"]["failures"] >= 1 and got["ft"]["heals"] >= 1, got["ft"]
    assert "step 5 not committed" in r.stderr
    log = log_of(tmp_path)
    assert log[4]["ft_tries"] >= 2 and all(d["ft_tries"] == 1 for d in log[5:])
    assert log[4]["ft_stall_s"] < 30  # the retry waited for the quorum, not a collective timeout
    check_survivor_committed_only_whole_steps(tmp_path)
    check_healed_in_lockstep(tmp_path)
    within_noise(got, unfailed[1])
    if all(d["ft_live"] == 2 for d in log):  # the restart rejoined within the retry's quorum: nothing trained alone
        from meshtrain.verifier import STEP_LOSS_TOLERANCE
        assert all(abs(a - b) <= STEP_LOSS_TOLERANCE * abs(b) for a, b in zip(got["losses"], unfailed[1]["losses"]))


@needs_torchft
def test_a_group_killed_between_steps_restarts_and_heals(unfailed, tmp_path):
    r = ft_run(tmp_path, "--max-restarts", "1", "--ft-heartbeat-timeout", "0.5", env={"MESHTRAIN_FAULT": "kill:1:5:1"})
    got = last_json(r.stdout)
    assert got["ft"]["failures"] >= 1 and got["ft"]["heals"] >= 1 and got["ft"]["uncommitted_steps"] == 0, got["ft"]
    log = log_of(tmp_path)
    assert log[5]["ft_stall_s"] < 10, log[5]
    healed = check_healed_in_lockstep(tmp_path)
    alone = [d["step"] for d in log if d["ft_live"] == 1]
    # The restart (~1-3 s here) may come back before the lighthouse drops the lost group (0.5 s
    # without a heartbeat): then the survivor waited for it and trained nothing alone.
    assert not alone or (alone[0] == 6 and healed > alone[-1]), [d["ft_live"] for d in log]
    check_survivor_committed_only_whole_steps(tmp_path)
    within_noise(got, unfailed[1])


@needs_torchft
def test_a_group_lost_for_good_leaves_the_survivor_training_alone(tmp_path):
    r = ft_run(tmp_path, "--ft-heartbeat-timeout", "0.5", env={"MESHTRAIN_FAULT": "kill:1:5:1"})
    got = last_json(r.stdout)
    assert got["ft"]["failures"] >= 1 and got["ft"]["heals"] == 0, got["ft"]
    assert "replica group 1 ended with an error; group 0 finished the run" in r.stderr
    log = log_of(tmp_path)
    assert [d["ft_live"] for d in log] == [2] * 5 + [1] * (STEPS - 5)  # on alone, from the next step
    assert log[5]["ft_stall_s"] < 10, log[5]
    check_survivor_committed_only_whole_steps(tmp_path)


@needs_torchft
def test_a_mixture_of_experts_in_two_groups_moves_its_routers_from_every_groups_load(tmp_path):
    """moe-test, 2 groups of dp 2 · ep 2: the routers' biases move from the load summed over
    the groups (else the groups part at step 1), so the run equals one process; a group
    killed at step 3 heals (the biases are persistent buffers) and is then in lockstep."""
    moe = ["--model", "moe-test", "--batch-size", "8", "--seq-len", "32", "--steps", "8"]
    groups = ["--ft-replicas", "2", "--dp", "2", "--ep", "2"]
    runs = {}
    for name, flags, env in (("groups", groups, {}), ("one", ["--dp", "1"], {}),
                             ("killed", [*groups, "--max-restarts", "1"], {"MESHTRAIN_FAULT": "kill:1:3:1"})):
        out = tmp_path / name
        r = run_cli("train", *moe, *flags, "--out", out, "--json", env={**DIGESTS, **env}, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (out, last_json(r.stdout))
    from meshtrain.verifier import DRIFT_TOLERANCE, STEP_LOSS_TOLERANCE
    got, one = runs["groups"][1], runs["one"][1]
    assert all(abs(a - b) <= STEP_LOSS_TOLERANCE * abs(b) for a, b in zip(got["losses"], one["losses"]))
    d, name = max_rel_diff(saved_weights(runs["groups"][0]), saved_weights(runs["one"][0]))
    assert d < DRIFT_TOLERANCE, f"{name}: {d:.2e}"
    out = runs["groups"][0]
    assert [d["ft_digest"] for d in log_of(out)] == [d["ft_digest"] for d in log_of(out, 1)]
    killed = runs["killed"][0]
    g0 = {d["step"]: d["ft_digest"] for d in log_of(killed)}
    g1 = log_of(killed, 1)
    healed = [d["step"] for d in g1 if "ft_healed_s" in d]
    assert healed and all(d["ft_digest"] == g0[d["step"]] for d in g1 if d["step"] >= healed[-1])
    assert g1[-1]["step"] == 8


def within_noise(got: dict, unfailed: dict) -> None:
    """A failed run's final loss against the unfailed run's: the steps trained alone saw
    half the rows (and a retried step its batch again), so the trajectories part; the gap
    must stay within the step-to-step noise of the unfailed run's last steps."""
    tail = unfailed["losses"][-8:]
    noise = max(tail) - min(tail)
    assert abs(got["final_loss"] - unfailed["final_loss"]) <= max(noise, 0.02), (got["final_loss"], unfailed["final_loss"])


MUTANT = textwrap.dedent('''
    import os
    if os.environ.get("MESHTRAIN_TEST_MUTANT") == "commit-after-a-failed-all-reduce":
        import meshtrain.replicas as replicas
        def commit(self):
            self.manager.should_commit()  # the vote is taken and ignored
            return True
        replicas.ReplicaGroups.commit = commit
''')


@needs_torchft
def test_a_mutant_that_commits_after_a_failed_all_reduce_fails_the_replay(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(MUTANT)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "out"
    ft_run(out, "--max-restarts", "1", env={"MESHTRAIN_FAULT": "kill-in-allreduce:1:5:1", "PYTHONPATH": path,
                                            "MESHTRAIN_TEST_MUTANT": "commit-after-a-failed-all-reduce"})
    with pytest.raises(AssertionError, match="differ from the replay|committed twice"):
        check_survivor_committed_only_whole_steps(out)


# ---- refusals: one line, exit 2, before any rank starts ------------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--ft-timeout", "5"], "--ft-timeout applies with --ft-replicas"),
    (["--ft-replicas", "-1"], "must be a positive number"),
    (["--ft-replicas", "3", "--dp", "2"], "does not split over --ft-replicas 3"),
    (["--ft-replicas", "2", "--ft-replica-id", "0"], "from a shell meshtrain starts"),
    (["--ft-replicas", "2", "--layout-search"], "not composed yet"),
])
def test_bad_input_is_refused_in_one_line(args, says):
    r = run_main("train", "--model", "gpt-test", "--batch-size", "8", "--seq-len", "32", "--steps", "1", *args)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_without_torchft_the_flag_is_refused(monkeypatch):
    import meshtrain.replicas as replicas
    monkeypatch.setattr(replicas, "available", lambda: False)
    r = run_main("train", "--model", "gpt-test", "--batch-size", "8", "--seq-len", "32", "--ft-replicas", "2")
    assert r.returncode == 2 and "pip install 'meshtrain[ft]'" in r.stderr, r.stderr


@needs_torchft
def test_a_lighthouse_that_does_not_answer_is_refused(tmp_path):
    r = run_main("train", "--model", "gpt-test", "--batch-size", "8", "--seq-len", "32", "--ft-replicas", "2",
                 "--ft-lighthouse", "http://127.0.0.1:9", "--out", tmp_path)
    assert r.returncode == 2 and "no lighthouse answers there" in r.stderr, r.stderr


@pytest.mark.parametrize("env, args, says", [
    ({}, [], "give this one's --ft-replica-id"),
    ({}, ["--ft-replica-id", "2"], "use 0 to 1"),
    ({"TORCHFT_LIGHTHOUSE": ""}, ["--ft-replica-id", "1"], "needs torchft's lighthouse"),
])
def test_under_a_launcher_each_group_names_itself_and_its_lighthouse(env, args, says):
    pytest.importorskip("torchft")
    ranks = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29999"}
    r = run_cli("train", "--model", "gpt-test", "--batch-size", "8", "--seq-len", "32", "--ft-replicas", "2", "--dp", "2", *args,
                env={**ranks, **env})
    assert r.returncode == 2 and says in r.stderr, r.stderr


def test_groups_started_from_a_shell_share_the_hosts_threads(monkeypatch):
    """R launches of W ranks on one host: each rank's torch threads count all R·W ranks."""
    from meshtrain import launch
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    monkeypatch.delenv(launch.HOST_RANKS_ENV, raising=False)
    assert launch.threads_per_rank(1) == 8
    monkeypatch.setenv(launch.HOST_RANKS_ENV, "4")  # 2 groups of 2 ranks
    assert launch.threads_per_rank(2) == 2 and launch.threads_per_rank(1) == 2


API_LOOP = textwrap.dedent('''
    import json, torch, meshtrain
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = meshtrain.init(ft=meshtrain.FaultTolerance(replicas=2))  # the group id and lighthouse from the environment
    job = meshtrain.parallelize(model, mesh, optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-2))
    def batch(k):
        g = torch.Generator().manual_seed(k)
        return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    losses = {}
    while (k := job.begin_step()) < 6:
        out = job.step(*batch(k))
        if out.committed:
            losses[k] = out.loss
    print(json.dumps({"losses": [losses[k] for k in range(6)],
                      "weights": {n: p.detach().tolist() for n, p in job.module.named_parameters()}}))
''')


@needs_torchft
def test_the_api_two_groups_of_a_users_loop_train_what_a_plain_loop_trains(tmp_path):
    """`meshtrain.init(ft=FaultTolerance(2))` in two processes (one group each) against a
    plain PyTorch loop on the same global batches."""
    import subprocess
    import sys

    import torch

    from meshtrain.replicas import quiet
    quiet()
    from torchft._torchft import LighthouseServer
    script = tmp_path / "loop.py"
    script.write_text(API_LOOP)
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=50)
    try:
        procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "MESHTRAIN_FT_REPLICA": str(i),
                                                  "TORCHFT_LIGHTHOUSE": server.address(), "OMP_NUM_THREADS": "1"})
                 for i in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        server.shutdown()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[0] == got[1]  # the groups in lockstep, bit for bit
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for k in range(6):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got[0]["losses"], losses)), (got[0]["losses"], losses)
    weights = {n: torch.tensor(v) for n, v in got[0]["weights"].items()}
    d, name = max_rel_diff(weights, dict(model.named_parameters()))
    assert d < 1e-4, f"{name}: {d:.2e}"


@pytest.mark.parametrize("options, says", [
    ({"replicas": 0}, "use the number of replica groups"),
    ({"replicas": 2}, "replica_id is None"),
    ({"replicas": 2, "replica_id": 2}, "give 0 to 1"),
    ({"replicas": 2, "replica_id": 0}, "no lighthouse"),
])
def test_the_api_refuses_what_it_cannot_run(monkeypatch, options, says):
    import meshtrain
    monkeypatch.delenv("MESHTRAIN_FT_REPLICA", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=says):
        meshtrain.init(ft=meshtrain.FaultTolerance(**options))
