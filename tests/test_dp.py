"""Data parallelism on real gloo processes, against one-process training."""

from contextlib import nullcontext

import pytest
import torch
from distributed import run_ranks
from helpers import verdict

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.recipes.build import build_model
from meshtrain.parallel.data import DataParallel
from meshtrain.train import train


def tiny_config(dp=1, microbatches=1, steps=3, batch_size=8, model="gpt-test", bucket_mb=25.0) -> Config:
    c = Config()
    c.model.name = model
    c.layout.dp, c.layout.microbatches, c.layout.bucket_mb = dp, microbatches, bucket_mb
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size = steps, batch_size, 32, 256
    c.train.device = "cpu"
    if model == "mlp":
        c.train.data = "digits"
    return c


def _verify_records(mesh, cfgs):
    """verify's layout record of each config, run one after another in the same ranks."""
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


@pytest.mark.parametrize("world, cfgs", [
    (2, [tiny_config(dp=2, microbatches=4, batch_size=16, bucket_mb=0.02)]),
    (4, [tiny_config(dp=4, batch_size=16, bucket_mb=0.02),
         tiny_config(dp=4, microbatches=2, batch_size=32, model="mlp", bucket_mb=0.02)]),
], ids=["dp2-mb4", "dp4-and-mlp-dp4-mb2"])
def test_dp_with_microbatches_equals_one_process_with_the_full_batch(world, cfgs):
    records = run_ranks(_verify_records, world, cfgs)[0]
    for cfg, rec in zip(cfgs, records):
        result = verdict(cfg, rec)
        assert result["passed"], result["failures"]
        assert not rec["problems"]  # every rank's replica bit-identical to rank 0's
        # fp32 with only the order of sums changed: differences at the level of rounding
        assert result["max_grad_rel_diff"] < 1e-6 and result["max_step_loss_rel_diff"] < 1e-6, result
        assert set(rec["steps"]) == {1, 2, 3}  # first, middle and last of 3 steps


def _train_and_measure(mesh, cfg):
    result = train(cfg, Comm(mesh))
    return {"comm": result.comm_per_step, "n_params": result.n_params, "model_state": result.model_state}


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_traffic_is_the_ring_all_reduce_volume(dp):
    cfg = tiny_config(dp=dp, steps=2, bucket_mb=0.05)
    for rank in run_ranks(_train_and_measure, dp, cfg):
        grad_bytes = rank["n_params"] * 4
        assert rank["comm"]["dp"] == round(2 * (dp - 1) / dp * grad_bytes)
        assert rank["comm"]["tp"] == rank["comm"]["pp"] == 0
        # apart from the model's traffic: the logged loss (fp32, 4 bytes) and the squared gradient norm (fp64, 8)
        assert rank["comm"]["metrics"] == round(2 * (dp - 1) / dp * (4 + 8))
        # parameters, gradients and Adam's two moments, fp32: 16 bytes per parameter
        assert rank["model_state"]["total"] == 16 * rank["n_params"]


def _record_event_order(mesh, bucket_mb):
    model = build_model("gpt-tiny", 0, vocab_size=256)
    events = []
    dp = DataParallel(model, Comm(mesh), bucket_mb=bucket_mb, on_launch=lambda i: events.append(f"launch {i}"))
    model.blocks[0].register_full_backward_pre_hook(lambda *_: events.append("backward of blocks.0"))
    model.embed.tok.register_full_backward_pre_hook(lambda *_: events.append("backward of embed"))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(mesh.rank))
    model(x).square().mean().backward()
    dp.finish_grad_sync()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"events": events, "n_buckets": len(dp.buckets), "grads": grads}


def test_first_bucket_is_launched_before_the_first_layer_runs_backward():
    ranks = run_ranks(_record_event_order, 2, 0.05)
    for r in ranks:
        ev = r["events"]
        assert r["n_buckets"] >= 3
        assert ev.index("launch 0") < ev.index("backward of blocks.0") < ev.index("backward of embed")
        assert [e for e in ev if e.startswith("launch")] == [f"launch {i}" for i in range(r["n_buckets"])]
    # after the sync the summed gradients are identical on both ranks
    assert torch.equal(ranks[0]["grads"], ranks[1]["grads"])


def _no_sync_then_sync(mesh):
    model = build_model("mlp", 0, n_inputs=4, n_classes=3)
    comm = Comm(mesh)
    dp = DataParallel(model, comm, bucket_mb=0.001)
    sent = comm.totals()  # after the construction-time check of replicas
    xs = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(mesh.rank))
    for i, x in enumerate(xs):
        with dp.no_sync() if i < 2 else nullcontext():
            model(x).sum().backward()
        if i < 2:
            assert comm.totals() == sent, "no communication while accumulating"
    dp.finish_grad_sync()
    return [p.grad.clone() for p in model.parameters()]


def test_no_sync_accumulates_then_one_sync():
    a, b = run_ranks(_no_sync_then_sync, 2)
    full = build_model("mlp", 0, n_inputs=4, n_classes=3)
    for rank in range(2):
        for x in torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(rank)):
            full(x).sum().backward()
    for ga, gb, p in zip(a, b, full.parameters()):
        assert torch.equal(ga, gb)
        torch.testing.assert_close(ga, p.grad, rtol=1e-5, atol=1e-6)
