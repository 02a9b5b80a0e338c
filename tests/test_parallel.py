"""The seams the sharded strategies build on: what `parallelize` returns, collective-safe
clipping, a data-parallel synchroniser that misuse cannot corrupt, byte-counting collectives
and point-to-point neighbours on the mesh. Multi-rank cases run on real gloo processes."""

import math

import pytest
import torch
from distributed import run_ranks

from meshtrain.comm import METRICS, Comm
from meshtrain.cli.config import Config, LayoutConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.recipes.build import build_model
from meshtrain.optim import SHARDED_OVER, clip_grad_norm_
from meshtrain.train import parallelize_config as parallelize
from meshtrain.train import setup, train_step

CPU = torch.device("cpu")


def _cfg(steps=3, microbatches=1, dp=1) -> Config:
    c = Config()
    c.model.name = "gpt-test"
    c.layout.dp, c.layout.microbatches, c.layout.bucket_mb = dp, microbatches, 0.02
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = steps, 8, 32, 256, "cpu"
    return c


def test_parallelize_keeps_the_full_names_and_decides_decay_on_full_shapes():
    model = build_model("gpt-test", 0, vocab_size=256)
    names = [n for n, _ in model.named_parameters()]
    p = parallelize(model, Comm(Mesh.single(CPU)), LayoutConfig(dp=1), TrainConfig())
    assert [n for n, _ in p.named_parameters()] == names  # no wrapper prefix
    decayed = {id(q) for g in p.optimizer.param_groups if g["weight_decay"] > 0 for q in g["params"]}
    assert {n for n, q in p.named_parameters() if id(q) in decayed} == {n for n, q in model.named_parameters()
                                                                       if q.dim() >= 2}
    assert all(q.grad is not None for q in p.trained)  # gradients live in buckets from the start


def test_full_state_round_trip_continues_training_identically():
    """Weights and Adam's moments at full shape, by name: a fresh setup that loads them takes
    the next step exactly as the original does."""
    cfg = _cfg()
    comm = Comm(Mesh.single(CPU))
    data, job_a = setup(cfg, comm)
    a = job_a.parallel
    for step in range(2):
        train_step(job_a, data, step, cfg)
    state = a.full_state_dict()
    assert set(state["optim"]) == {n for n, _ in a.named_parameters()}
    assert {"step", "exp_avg", "exp_avg_sq"} <= state["optim"]["blocks.0.attn.q.weight"].keys()
    _, job_b = setup(cfg, comm)
    b = job_b.parallel
    b.load_full_state_dict(state)
    assert train_step(job_a, data, 2, cfg) == train_step(job_b, data, 2, cfg)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), n


def _second_backward_then_a_clean_step(mesh):
    cfg = _cfg(dp=2)
    comm = Comm(mesh)
    data, job = setup(cfg, comm)
    p = job.parallel
    x, y = data.batch(0, 8, slice(mesh.rank * 4, mesh.rank * 4 + 4))
    p.loss_fn(p.module(x), y).backward()
    message = None
    try:
        p.loss_fn(p.module(x), y).backward()  # a second backward without no_sync
    except RuntimeError as e:
        message = str(e)
    grads_after_error = max(q.grad.abs().max().item() for q in p.trained)
    loss = train_step(job, data, 0, cfg).loss
    return {"message": message, "grads_after_error": grads_after_error, "loss": loss,
            "params": torch.cat([q.detach().flatten() for q in p.trained])}


def test_a_second_backward_before_sync_raises_and_leaves_clean_state():
    results = run_ranks(_second_backward_then_a_clean_step, 2)
    for r in results:
        assert "second backward before finish_grad_sync" in r["message"]
        assert r["grads_after_error"] == 0.0
    # the next step is the step a fresh run takes
    cfg = _cfg()
    data, ref = setup(cfg, Comm(Mesh.single(CPU)))
    loss = train_step(ref, data, 0, cfg).loss
    assert results[0]["loss"] == pytest.approx(loss, rel=1e-6)
    assert torch.equal(results[0]["params"], results[1]["params"])


def _failure_mid_step_then_a_clean_step(mesh):
    cfg = _cfg(dp=2, microbatches=2)
    comm = Comm(mesh)
    data, job = setup(cfg, comm)
    p = job.parallel

    def failing(i):
        if i == 1:
            raise KeyError("data went missing")
        return data.batch(0, 8, slice(mesh.rank * 4 + i * 2, mesh.rank * 4 + i * 2 + 2))
    try:
        p.runner.run(p, failing, 2, 256.0)
    except KeyError:
        pass
    loss = train_step(job, data, 0, cfg).loss
    return loss


def test_a_failure_half_way_through_a_step_resets_the_synchroniser():
    losses = run_ranks(_failure_mid_step_then_a_clean_step, 2)
    cfg = _cfg()
    data, ref = setup(cfg, Comm(Mesh.single(CPU)))
    assert losses[0] == losses[1] == pytest.approx(train_step(ref, data, 0, cfg).loss, rel=1e-6)


def _build_with(mesh, seeds, bucket_mbs):
    model = build_model("gpt-test", seeds[mesh.rank], vocab_size=256)
    try:
        parallelize(model, Comm(mesh), LayoutConfig(dp=2, bucket_mb=bucket_mbs[mesh.rank]), TrainConfig())
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("seeds, bucket_mbs, complaint", [
    ((0, 1), (0.02, 0.02), "initial weights"),
    ((0, 0), (0.02, 25.0), "bucket layouts"),
    ((0, 0), (0.02, 0.02), None),
])
def test_data_parallel_ranks_must_start_alike(seeds, bucket_mbs, complaint):
    for message in run_ranks(_build_with, 2, seeds, bucket_mbs):
        assert (message is None) if complaint is None else (complaint in message)


def _clip_with_uneven_holdings(mesh):
    """Rank 0 holds one gradient sharded over dp; rank 1 holds none at all (an empty shard)."""
    comm = Comm(mesh)
    params = []
    if mesh.rank == 0:
        a = torch.nn.Parameter(torch.zeros(2))
        a.grad = torch.tensor([3.0, 4.0])
        setattr(a, SHARDED_OVER, ("dp",))
        params = [a]
    norm = clip_grad_norm_(params, 1.0, comm)
    return norm, comm.totals()


def test_clipping_issues_the_same_collectives_whatever_a_rank_holds():
    for norm, sent in run_ranks(_clip_with_uneven_holdings, 2):
        assert norm == pytest.approx(5.0)
        assert sent == {METRICS: 8.0}  # one all-reduce of one fp64 number over dp, counted apart


def test_a_non_finite_norm_is_reported_and_nothing_is_scaled():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    assert math.isinf(clip_grad_norm_([p], 1.0, Comm(Mesh.single(CPU))))
    assert p.grad[1] == 1.0


def test_a_step_with_a_non_finite_gradient_is_skipped():
    cfg = _cfg()
    data, job = setup(cfg, Comm(Mesh.single(CPU)))
    p = job.parallel
    with torch.no_grad():
        p.module.head.weight[0, 0] = float("nan")  # poisons every gradient
    before = {n: q.detach().clone() for n, q in p.named_parameters()}
    stepped = train_step(job, data, 0, cfg).stepped
    assert not stepped
    assert all(torch.allclose(before[n], q, rtol=0, atol=0, equal_nan=True) for n, q in p.named_parameters())


def _collectives(mesh):
    comm = Comm(mesh)
    r = mesh.rank
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.tensor([r, r + 0.5]), "dp")
    scattered = torch.empty(2)
    comm.reduce_scatter(scattered, torch.arange(4.0) + r, "dp")
    b = torch.tensor([float(r)] * 3)
    comm.broadcast(b, "dp", src_coord=1)
    got = torch.empty(5)
    for work in comm.exchange([(True, torch.arange(5.0), +1, 0)] if r == 0 else [(False, got, -1, 0)], "dp"):
        work.wait()
    return {"gathered": gathered, "scattered": scattered, "broadcast": b, "got": got, "sent": comm.totals(),
            "neighbours": (mesh.neighbour("dp", -1), mesh.neighbour("dp", +1), mesh.neighbour("dp", 1, wrap=True))}


def test_collectives_move_data_and_count_their_bytes():
    a, b = run_ranks(_collectives, 2)
    for r in (a, b):
        assert r["gathered"].tolist() == [0, 0.5, 1, 1.5]
        assert r["broadcast"].tolist() == [1.0, 1.0, 1.0]
    assert a["scattered"].tolist() == [1.0, 3.0] and b["scattered"].tolist() == [5.0, 7.0]
    assert b["got"].tolist() == [0, 1, 2, 3, 4]
    # (n-1)/n of 16 bytes gathered, of 16 bytes scattered, of 12 broadcast; a send counts its 20 bytes
    assert a["sent"] == {"dp": 8 + 8 + 6 + 20}
    assert b["sent"] == {"dp": 8 + 8 + 6}
    assert a["neighbours"] == (None, 1, 1) and b["neighbours"] == (0, None, 0)


def _full_state_peaks(mesh, cfg):
    """The bytes this rank allocates at most while the full state is taken (the meter sees
    every storage an operator makes), the largest tensor's, and what rank 0 got."""
    from meshtrain.metrics import ActivationMeter
    data, job = setup(cfg, Comm(mesh))
    train_step(job, data, 0, cfg)  # Adam's moments exist
    p = job.parallel
    meter = ActivationMeter()
    with meter:
        state = p.full_state_dict()
    tensors = [*state["model"].values(), *(t for entry in state["optim"].values() for t in entry.values())]
    return {"peak": meter.peak, "state": sum(t.numel() * t.element_size() for t in tensors),
            "largest": max((t.numel() * t.element_size() for t in tensors), default=0), "names": sorted(state["model"])}


@pytest.mark.parametrize("sizes, layout", [
    ({"pp": 2}, {"dp": 2, "pp": 2, "zero": 3}),
    ({"pp": 2, "tp": 2}, {"dp": 1, "pp": 2, "tp": 2}),
], ids=["dp2-pp2-zero3", "tp2-pp2"])
def test_the_full_state_moves_one_tensor_at_a_time_to_rank_0_only(sizes, layout):
    """Rank 0 holds the full state (its share: all of it) and about one tensor more; every
    other rank at most twice the largest tensor (a tensor-parallel gather along a dim other
    than the first reorders it once) plus 64 KiB, whatever the model's size — where each
    rank used to hold the whole state, and pipelines pickled it to every stage."""
    cfg = _cfg(dp=layout["dp"])
    cfg.layout.pp, cfg.layout.tp, cfg.layout.zero = layout["pp"], layout.get("tp", 1), layout.get("zero", 0)
    results = run_ranks(_full_state_peaks, 4, cfg, **sizes)
    main = results[0]
    full_names = {n for n, _ in build_model("gpt-test", 0, vocab_size=256).named_parameters()}
    assert full_names <= set(main["names"])
    largest = main["largest"]
    assert main["peak"] <= main["state"] + 2 * largest + 64 * 1024, (main["peak"], main["state"])
    for rank, r in enumerate(results[1:], start=1):
        assert r["state"] == 0 and r["names"] == []
        assert r["peak"] <= 2 * largest + 64 * 1024, (rank, r["peak"], largest, main["state"])
