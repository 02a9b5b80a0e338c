import pytest

from meshtrain.launch import detect, first_host, threads_per_rank


def test_plain_shell_is_not_a_launcher():
    assert detect({}) is None


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node7", "MASTER_PORT": "1234"}
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.local_world_size, r.master_addr, r.master_port) == \
        ("torchrun", 3, 4, 1, 2, "node7", 1234)


def test_srun_environment_derives_rendezvous():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.local_world_size, r.master_addr) == \
        ("srun", 5, 8, 1, 4, "gpu03")
    assert 20000 <= r.master_port < 40000


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
     "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
])
def test_mpirun_environment(env):
    r = detect(env)
    assert (r.launcher, r.rank, r.world_size, r.local_rank, r.master_addr) == ("mpirun", 2, 4, 2, "127.0.0.1")


@pytest.mark.parametrize("nodes, first", [("gpu[03-05,09],cpu1", "gpu03"), ("node12", "node12"),
                                          ("a[7]", "a7"), ("n[001-100]", "n001")])
def test_first_host(nodes, first):
    assert first_host(nodes) == first


def test_threads_per_rank_never_zero():
    assert threads_per_rank(10_000) == 1
    assert threads_per_rank(1) >= 1
