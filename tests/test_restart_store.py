"""torchrun keeps one store for its workers across restarts (`TORCHELASTIC_USE_AGENT_STORE`),
so the addresses a failed attempt's ranks wrote to join the group are still there when the
restarted ranks join: emulated here with a store this test holds, as torchrun's agent does,
and two attempts of two real gloo ranks, the restarted rank 1 slower to join than rank 0
(as it is when rank 0 alone re-claims the run folder). `launch.init_distributed` keeps each
attempt's keys apart; without that, rank 0 reads the dead rank 1's address and gloo's connect
is refused (pytorch/pytorch#135712), which is what `test_a_torchrun_restart_resumes_its_own_jobs_head`
(slow: a real torchrun) met."""

import os
import time

import pytest
import torch
from distributed import _context, free_port

from meshtrain import launch


def _rank(rank: int, port: int, attempt: int, delay: float, nodes: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(attempt), GROUP_WORLD_SIZE=str(nodes))
    import torch.distributed as dist
    time.sleep(delay)
    code = 0
    try:
        launch.init_distributed(launch.detect(), torch.device("cpu"), timeout_s=30)
        t = torch.ones(1)
        dist.all_reduce(t)
        code = 0 if t.item() == 2 else 4
    except Exception as e:  # noqa: BLE001 - the exit code says it to the parent
        print(f"rank {rank}, attempt {attempt}: {e}"[:400], flush=True)
        code = 5
    launch.finish(code)


def _attempt(port: int, attempt: int, delays: tuple[float, float], nodes: int = 1) -> list[int]:
    ctx = _context()
    procs = [ctx.Process(target=_rank, args=(r, port, attempt, delays[r], nodes)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def test_a_restarted_attempt_never_reads_the_previous_attempts_addresses():
    port = free_port()
    agent_store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    assert _attempt(port, 0, (0.0, 0.0)) == [0, 0]
    assert _attempt(port, 1, (0.0, 3.0)) == [0, 0]  # rank 1 joins late: its old address is in the store
    del agent_store


@pytest.mark.parametrize("env, prefix", [
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}, "meshtrain/attempt-2"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}, None),  # the first attempt
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "2"}, None),  # a store per attempt
    # several nodes: the agents count restarts apart, so a prefix could split one attempt's ranks
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1", "GROUP_WORLD_SIZE": "2"}, None),
])
def test_the_store_prefix_names_the_attempt_only_where_every_rank_counts_alike(env, prefix):
    renv = launch.RankEnv("torchrun", 0, 2, 0, 2, "127.0.0.1", 29500)
    assert launch.restart_store_prefix(renv, env) == prefix


def test_restarts_across_nodes_through_torchruns_shared_store_are_warned_about():
    renv = launch.RankEnv("torchrun", 0, 4, 0, 2, "10.0.0.1", 29500)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in launch.cross_node_restart_warning(renv, env)
    assert launch.cross_node_restart_warning(renv, {**env, "GROUP_WORLD_SIZE": "1"}) is None
    assert launch.cross_node_restart_warning(renv, {**env, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert launch.cross_node_restart_warning(None, env) is None
