"""Pipeline parallelism on real gloo processes: stages cut under the full names, every
schedule and the 3D layouts through verify, memory in flight, and the p2p traffic."""

import json
import os

import pytest
import torch
from distributed import run_ranks
from helpers import verdict
from presets import GPT_TEST_4

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.recipes.build import build_model
from meshtrain.parallel.pipeline.engine import _saved_by_own_grad_fn
from meshtrain.parallel.pipeline.stages import Stage, split_layers
from meshtrain.recipes.gpt import pipeline_plan
from meshtrain.train import train


def test_blocks_split_as_evenly_as_possible_or_as_told():
    assert [len(r) for r in split_layers(8, 3)] == [3, 3, 2]
    assert [list(r) for r in split_layers(8, 2, [6, 2])] == [list(range(6)), [6, 7]]
    with pytest.raises(ValueError):
        split_layers(8, 2, [6, 1])


@pytest.mark.parametrize("stage, chunks, blocks, has_embed, has_head", [
    (0, 1, [0, 1, 2], True, False), (2, 1, [6, 7], False, True),
    (0, 2, [0, 3], True, False), (2, 2, [2, 5, 6, 7], False, True),  # chunk c of stage s: virtual stage c·3 + s
])
def test_a_stage_keeps_its_parts_under_the_full_names(stage, chunks, blocks, has_embed, has_head):
    model = build_model("gpt-test", 0, vocab_size=256)
    full = dict(model.named_parameters())
    cut = Stage(model, pipeline_plan(32), stage, 3, chunks, [3, 3, 2] if chunks == 1 else [1, 1, 1, 1, 1, 3])
    names = {n for n, _ in model.named_parameters()}
    assert {int(n.split(".")[1]) for n in names if n.startswith("blocks.")} == set(blocks)
    assert any(n.startswith("embed.") for n in names) == has_embed
    assert ("head.weight" in names) == has_head
    assert all(full[n] is p for n, p in model.named_parameters())  # the same tensors, the same names
    assert sum(len(ids) for ids in cut.block_ids) == len(blocks)


def test_an_output_is_freed_after_its_send_only_if_backward_does_not_read_it():
    x = torch.randn(3, requires_grad=True)
    assert not _saved_by_own_grad_fn(x * 2 + x)  # an add keeps nothing of its result
    assert _saved_by_own_grad_fn(torch.relu(x * 2))  # ReLU's backward reads its result


def pp_config(pp, schedule="1f1b", microbatches=4, chunks=1, dp=1, tp=1, sp=False, steps=3, batch=8) -> Config:
    c = Config()
    c.model.name = "gpt-test"
    lay = c.layout
    lay.dp, lay.tp, lay.pp, lay.sp, lay.schedule, lay.chunks, lay.microbatches, lay.bucket_mb = (
        dp, tp, pp, sp, schedule, chunks, microbatches, 0.02)
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = steps, batch, 32, 256, "cpu"
    return c


def _records(mesh, cfgs, strict=False):
    """verify's records of each layout; `strict`: under the strict p2p mode (NCCL's rules
    checked on gloo, `transport.py`)."""
    os.environ["MESHTRAIN_STRICT_P2P"] = "1" if strict else "0"
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]


@pytest.mark.parametrize("world, sizes, cfgs, strict", [
    (2, {"pp": 2}, [pp_config(2, s, 4, c) for s, c in SCHEDULES], True),
    (4, {"pp": 4}, [pp_config(4, s, 8, c) for s, c in SCHEDULES], True),
    (4, {"pp": 2}, [pp_config(2, "1f1b", 2, dp=2), pp_config(2, "interleaved", 2, 2, dp=2)], False),
    (4, {"pp": 2, "tp": 2}, [pp_config(2, "1f1b", 2, tp=2), pp_config(2, "interleaved", 2, 2, tp=2, sp=True)], False),
    (8, {"pp": 2, "tp": 2}, [pp_config(2, "1f1b", 2, dp=2, tp=2), pp_config(2, "interleaved", 2, 2, dp=2, tp=2)],
     False),
], ids=["pp2-every-schedule-strict", "pp4-every-schedule-strict", "dp2-pp2", "tp2-pp2", "dp2-tp2-pp2"])
def test_pipeline_layouts_pass_verify(world, sizes, cfgs, strict):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, strict, **sizes)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.layout.short(), result["failures"])


def _figures(mesh, cfgs):
    out = []
    for cfg in cfgs:
        r = train(cfg, Comm(mesh))
        out.append({"activation": r.activation_bytes, "comm": r.comm_per_step, "losses": r.losses})
    return out


def test_gpipe_holds_every_microbatch_1f1b_only_p_of_them_and_both_send_the_same():
    """Stage 0 of p = 2 with m = 4: GPipe keeps all 4 micro-batches' activations at once,
    1F1B at most 2; each stage sends every micro-batch's activation or gradient once."""
    cfgs = [pp_config(2, "gpipe", 4, steps=1), pp_config(2, "1f1b", 4, steps=1)]
    stage0, stage1 = run_ranks(_figures, 2, cfgs, pp=2)
    gpipe, one_f_one_b = stage0[0]["activation"], stage0[1]["activation"]
    assert 1.6 < gpipe / one_f_one_b < 2.2
    boundary = 2 * 32 * 32 * 4  # a micro-batch of 2 sequences × 32 tokens × 32 features, fp32
    for stage in (stage0, stage1):
        for run in stage:
            assert run["comm"]["pp"] == 4 * boundary
    assert stage0[0]["losses"] == stage1[0]["losses"]  # the logged loss reaches every stage


def test_a_traced_run_and_its_simulation_agree_on_the_order_of_operations(tmp_path):
    """`train --trace` writes every stage's timeline; `schedule --trace` simulates it from the
    measured costs: the same operations in the same order on every stage. (How close the
    makespans come is measured on gpt-small in the README, not asserted on a noisy machine.)
    The run is the command itself (its rank 0 writes the trace); `schedule` runs through the
    command line's `main` in this process."""
    from helpers import TINY, last_json, run_cli, run_main
    trace = tmp_path / "trace.json"
    r = run_cli("train", *TINY, "--dp", "1", "--pp", "2", "--microbatches", "4", "--schedule", "zb", "--steps", "3",
                "--out", tmp_path, "--trace", trace)
    assert r.returncode == 0, r.stderr
    t = json.loads(trace.read_text())
    assert len(t["steps"]) == 3 and len(t["steps"][0]) == 2 and t["p2p_s"] > 0
    kinds = [sp["op"] for sp in t["steps"][1][1]]
    assert kinds.count("F") == kinds.count("I") == kinds.count("W") == 4  # zero-bubble: F, input and weight grads
    r = run_main("schedule", "--trace", trace, "--png", tmp_path / "both.png", "--json")
    assert r.returncode == 0, r.stderr
    j = last_json(r.stdout)
    assert j["same_order"] and j["predicted_makespan_s"] > 0 and j["measured_makespan_s"] > 0
    first, last = j["op_median_s_per_stage"]  # F, I and W per stage: the first stage's backward is all W
    assert set(first) == set(last) == {"F", "I", "W"} and first["I"] < 1e-3 < first["W"] and last["I"] > 0 < last["W"]
    assert (tmp_path / "both.png").stat().st_size > 0


def _bucket_launches(mesh, cfg):
    """When each data-parallel bucket went out: the number of backward instructions this
    stage had started by then, and how many the step has."""
    from unittest import mock

    from meshtrain.parallel.data import DataParallel
    from meshtrain.parallel.pipeline import schedules as S
    from meshtrain.parallel.pipeline.engine import PipelineRunner
    started, launched = [0], []
    real_launch, real_backward = DataParallel._launch, PipelineRunner._Backward

    def launch(self, bucket):
        launched.append(started[0])
        return real_launch(self, bucket)

    def backward(self, op):
        started[0] += 1
        return real_backward(self, op)
    with mock.patch.object(DataParallel, "_launch", launch), mock.patch.object(PipelineRunner, "_Backward", backward):
        r = train(cfg, Comm(mesh))
        backwards = sum(isinstance(op, S.Backward) for op in r.parallel.runner.instructions)
    return {"launched": launched, "backwards": backwards}


def test_interleaved_chunks_launch_their_buckets_when_they_are_done():
    """dp 2 × pp 2, two chunks a stage: the later chunk's buckets go out in its own last
    backward, while the stage still has backwards of the other chunk to run."""
    cfg = pp_config(2, "interleaved", 4, chunks=2, dp=2, steps=1)
    for stage_rank in run_ranks(_bucket_launches, 4, cfg, pp=2):
        early = [n for n in stage_rank["launched"] if n < stage_rank["backwards"]]
        assert early and len(early) < len(stage_rank["launched"]), stage_rank


def zb_config(dp=1, tp=1, microbatches=4, **layout) -> Config:
    from helpers import small_config
    return small_config(GPT_TEST_4, 3, 8, dp=dp, tp=tp, pp=2, schedule="zb", microbatches=microbatches, **layout)


@pytest.mark.parametrize("world, sizes, cfgs", [
    (2, {"pp": 2}, [zb_config(precision="bf16", grad_dtype="compute"), zb_config(precision="bf16"),
                    zb_config(recompute="full"), zb_config(recompute="selective"), zb_config(recompute="segments:2")]),
    (4, {"pp": 2}, [zb_config(dp=2, microbatches=2), zb_config(dp=2, microbatches=2, zero=2),
                    zb_config(dp=2, microbatches=2, precision="bf16", grad_dtype="fp32"),
                    zb_config(dp=2, microbatches=2, zero=3, recompute="full")]),
    (4, {"pp": 2, "tp": 2}, [zb_config(tp=2, sp=True), zb_config(tp=2, sp=True, recompute="full")]),
], ids=["pp2-bf16-and-recompute", "dp2-pp2-zero-and-bf16", "tp2-sp-pp2"])
def test_zero_bubble_layouts_pass_verify(world, sizes, cfgs):
    """The split backward (linear layers' weight gradients kept for the weight pass) under
    data parallelism, ZeRO 2 and 3 (1 and 3 also in test_zero), bf16 with either gradient
    dtype, every recompute policy and TP with SP. ZeRO 1-3 with zb and dp 2 are in test_zero."""
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, **sizes)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.layout.short(), result["failures"])


def _input_gradients_by_pass(mesh, cfg):
    """How many linear input gradients (δ·W) and autograd backwards each kind of backward
    instruction of this stage ran, over one step."""
    from unittest import mock

    from meshtrain.parallel import deferred_linear
    from meshtrain.parallel.pipeline.engine import PipelineRunner
    counts, current = {}, [None]
    real_input_grad, real_backward = deferred_linear.input_grad, torch.autograd.backward

    def count(what):
        key = (current[0], what)
        counts[key] = counts.get(key, 0) + 1

    def input_grad(grad, weight):
        count("input_grad")
        return real_input_grad(grad, weight)

    def backward(*args, **kwargs):
        count("autograd")
        return real_backward(*args, **kwargs)

    def during(kind, real):
        def run(self, op):
            current[0] = kind
            try:
                return real(self, op)
            finally:
                current[0] = None
        return run
    with mock.patch.object(deferred_linear, "input_grad", input_grad), mock.patch.object(torch.autograd, "backward", backward), \
            mock.patch.object(PipelineRunner, "_BackwardInput", during("I", PipelineRunner._BackwardInput)), \
            mock.patch.object(PipelineRunner, "_BackwardWeight", during("W", PipelineRunner._BackwardWeight)):
        train(cfg, Comm(mesh))
    return counts


def test_the_weight_pass_computes_no_input_gradient():
    """Stage 1 of p = 2, m = 4: each input pass runs one backward, computing every linear
    layer's δ·W once; the weight passes run no autograd and no δ·W at all. (Stage 0 has no
    input gradient to send: it runs each backward whole in its weight pass.)"""
    cfg = pp_config(2, "zb", 4, steps=1)
    stage0, stage1 = run_ranks(_input_gradients_by_pass, 2, cfg, pp=2)
    linears = 4 * 6 + 1  # four blocks of q, k, v, proj, fc, proj; the head
    assert stage1 == {("I", "autograd"): 4, ("I", "input_grad"): 4 * linears}, stage1
    assert stage0 == {("W", "autograd"): 4}, stage0


def test_the_weight_gradient_store_gives_autograds_gradients():
    """A split model's input pass gives the input's, norms' and biases' gradients and keeps
    the linear layers' pairs; the weight pass gives their ∇W: together, autograd's gradients
    (also through a checkpoint, and for a layer called twice, whose pairs are summed)."""
    from torch.utils.checkpoint import checkpoint

    from meshtrain.parallel.pipeline.split import WeightGradStore, split_linears

    def build():
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8, bias=False)])

    def run(m, x):
        h = checkpoint(lambda t: m[1](torch.nn.functional.gelu(m[0](t))), x, use_reentrant=False)
        return (m[2](m[2](h)) ** 2).sum()
    x = torch.randn(2, 5, 4)
    plain, split = build(), build()
    x_plain, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    run(plain, x_plain).backward()
    store = WeightGradStore()
    assert split_linears(split, store) == ["0", "2"]
    loss = run(split, x_split)
    with store.input_pass("mb"):
        loss.backward()
    assert split[0].weight.grad is None and split[2].weight.grad is None and split[0].bias.grad is not None
    for weight, grad in store.weight_grads("mb"):
        weight.grad = grad
    assert store.held_bytes() == 0
    torch.testing.assert_close(x_split.grad, x_plain.grad)
    for a, b in zip(split.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def _gathered_after_input_passes(mesh, cfgs):
    """Under ZeRO-3, per layout: the units still gathered after each input pass of this
    stage, and the gathered bytes' peak of the step."""
    from unittest import mock

    from meshtrain.parallel.pipeline.engine import PipelineRunner
    out, real = [], PipelineRunner._BackwardInput
    for cfg in cfgs:
        left = []

        def input_pass(self, op):
            real(self, op)
            if not self.stage.is_first(op.chunk):
                left.append([g.label for g in self._p.grad_sync.groups if g.full is not None])
        with mock.patch.object(PipelineRunner, "_BackwardInput", input_pass):
            r = train(cfg, Comm(mesh))
        out.append({"left": left, "peak": r.parallel.grad_sync.peak_gathered})
    return out


def test_zero_3_frees_after_the_input_pass_not_at_the_weight_passs_reduce_scatter():
    """dp 2 × pp 2, zb, ZeRO-3: the weight pass needs the layers' inputs and output gradients,
    not their weights, so every unit gathered for an input pass is freed when it ends, before
    the reduce-scatter of the weight pass; the gathered peak stays 1F1B's."""
    from helpers import small_config
    cfgs = [small_config("gpt-test", 1, 8, dp=2, pp=2, zero=3, microbatches=4, schedule=s) for s in ("zb", "1f1b")]
    for rank, (zb, one_f_one_b) in enumerate(run_ranks(_gathered_after_input_passes, 4, cfgs, pp=2)):
        stage = rank // 2  # pp outermost
        assert zb["left"] == ([[]] * 4 if stage == 1 else []), zb["left"]  # the first stage runs no input pass
        assert zb["peak"] <= one_f_one_b["peak"], (rank, zb["peak"], one_f_one_b["peak"])
