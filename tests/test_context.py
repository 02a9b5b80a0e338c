"""Context parallelism: the head-tail split, ring attention against whole-sequence attention
(outputs and gradients, GQA), its block areas (balance), its bytes, and `verify` of cp
layouts against one process. The mutants that must fail verify are in the central table,
tests/test_verify_mutants.py (layouts "cp" and "cp-dropout")."""

import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from presets import GPT_TEST_4
from test_llama import ROWS, T, V, adamw, batches
from test_llama import make_model as make_llama

import meshtrain
from meshtrain.recipes.build import build_model
from meshtrain.parallel import block_kernels, context
from meshtrain.parallel.context import sequence_positions, shard_sequence



def test_head_tail_positions():
    """Rank r holds chunks r and 2·cp−1−r of the 2·cp; together the ranks hold each position once."""
    assert sequence_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert sequence_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    for cp in (2, 4):
        held = torch.cat([sequence_positions(32, r, cp) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(32))
    x = torch.arange(16).view(2, 8)
    assert shard_sequence(x, 0, 2).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    with pytest.raises(ValueError, match="does not split into 2·cp = 4"):
        sequence_positions(10, 0, 2)


def _whole(q, k, v):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          is_causal=True)


def _ring_against_sdpa(_mesh, cp, heads, kv_heads, contiguous, mode="ring", kernel="fused"):
    """Ring (or all-to-all) attention on this rank's tokens against sdpa on the whole
    sequence: outputs and the gradients of q, k, v; and the block areas this rank computed.
    `kernel`: the blocks in CPU's fused flash kernel, or forced (`Ring`'s kernel) into the
    math one, whole or in score tiles of 3 query rows (of 8 or 4: uneven)."""
    assert block_kernels.choose_kernel("cpu", torch.float32).name == "cpu-flash"  # this torch has the CPU kernel
    b, s, d = 2, 32, 8
    forced = {"fused": None, "math": "math",
              "math-tiled": block_kernels.math_kernel(3 * b * heads * (s // (2 * cp)) * 4)}[kernel]
    if contiguous:  # the split without balancing: rank r holds chunks 2r and 2r + 1
        context.chunk_ids = lambda rank, cp: (2 * rank, 2 * rank + 1)
    comm = meshtrain.init(cp=cp).comm
    ring = context.Ring(comm, forced)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, heads, s, d, generator=g, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, heads, s, d, generator=g)
    whole = _whole(q, k, v)
    whole.backward(dout)
    positions = context.sequence_positions(s, ring.rank, ring.cp)
    mine = [t.detach()[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    if mode == "ring":
        out = context.RingAttention.apply(*mine, ring, 1.0 / math.sqrt(d))
    else:
        out = context.ulysses_core(comm, _whole)(None, *mine)
    out.backward(dout[:, :, positions])
    torch.testing.assert_close(out, whole.detach()[:, :, positions], rtol=1e-5, atol=1e-6)
    for local, full in zip(mine, (q, k, v)):
        torch.testing.assert_close(local.grad, full.grad[:, :, positions], rtol=1e-5, atol=1e-5)
    return ring.area


@pytest.mark.parametrize("kernel", ["fused", "math", "math-tiled"])
@pytest.mark.parametrize("cp, heads, kv_heads", [(2, 4, 4), (4, 4, 2)])
def test_ring_attention_equals_whole_sequence_attention_and_is_balanced(cp, heads, kv_heads, kernel):
    """Outputs and gradients equal sdpa's on the whole sequence (MHA at cp 2, GQA at cp 4),
    with either block kernel. Balance, counted from the kernel calls (query × key positions
    per block, forward and backward): head-tail gives every rank the same area to within a
    diagonal block's triangle (≤ 5 %); the contiguous split about (2·cp − 1)× more on the
    last rank than the first."""
    areas = run_ranks(_ring_against_sdpa, cp, cp, heads, kv_heads, False, "ring", kernel)
    assert max(areas) <= 1.05 * min(areas), areas
    contiguous = run_ranks(_ring_against_sdpa, cp, cp, heads, kv_heads, True, "ring", kernel)
    assert 0.8 * (2 * cp - 1) <= contiguous[-1] / contiguous[0] <= 1.0 * (2 * cp - 1), contiguous


@pytest.mark.parametrize("cp, heads, kv_heads", [(2, 4, 4), (4, 8, 4)])
def test_all_to_all_attention_equals_whole_sequence_attention(cp, heads, kv_heads):
    """Ulysses: sequence-sharded to head-sharded (whole query/key-value groups per rank),
    whole-sequence attention, and back: outputs and gradients equal sdpa's."""
    run_ranks(_ring_against_sdpa, cp, cp, heads, kv_heads, False, "ulysses")


def _gpt():
    return build_model(GPT_TEST_4, 0, vocab_size=V)


def _llama():
    return make_llama()


def _gpt_dropout():
    return build_model(GPT_TEST_4, 0, vocab_size=V, dropout=0.1)


LAYOUTS = {  # name: (model, mesh axes, options)
    "gpt-cp2": (_gpt, {"cp": 2}, {}),
    "llama-cp2": (_llama, {"cp": 2}, {}),
    "gpt-cp2-full": (_gpt, {"cp": 2}, {"recompute": "full"}),
    "llama-cp2-selective-zero3": (_llama, {"cp": 2}, {"recompute": "selective", "zero": 3}),
    "gpt-cp2-ulysses": (_gpt, {"cp": 2}, {"cp_mode": "ulysses"}),
    "gpt-cp2-dropout-full": (_gpt_dropout, {"cp": 2}, {"recompute": "full"}),
    "llama-cp2-ulysses-full": (_llama, {"cp": 2}, {"cp_mode": "ulysses", "recompute": "full"}),
}


def _verify(_mesh, names):
    reports = {}
    for name in names:
        make, axes, options = LAYOUTS[name]
        reports[name] = meshtrain.verify(make, batches(), optimizer=adamw, mesh=meshtrain.init(**axes), **options)
    return reports


def test_context_parallel_layouts_pass_verify():
    """cp 2 on the GPT (learned positions) and the Llama (RoPE, grouped-query attention),
    with full recompute (the ring runs again in backward), selective recompute with ZeRO-3
    sharded over the flattened dp × cp, all-to-all attention, and dropout 0.1 with full
    recompute (each rank keeps the one-process masks of its tokens)."""
    for name, report in run_ranks(_verify, 2, list(LAYOUTS), timeout=600)[0].items():
        assert report.passed, (name, report)


def _verify_four(_mesh, axes, options):
    return meshtrain.verify(_gpt, batches(), optimizer=adamw, mesh=meshtrain.init(**axes), **options)


@pytest.mark.parametrize("axes, options", [({"cp": 4}, {}), ({"dp": 2, "cp": 2}, {"zero": 3}),
                                           ({"cp": 4}, {"cp_mode": "ulysses"})],
                         ids=["cp4", "dp2-cp2-zero3", "cp4-ulysses"])
def test_four_rank_context_layouts_pass_verify(axes, options):
    report = run_ranks(_verify_four, 4, axes, options, timeout=600)[0]
    assert report.passed, report


def _verify_composed(_mesh, name):
    from meshtrain.recipes.gpt import TP_PLAN as GPT_PLAN
    from meshtrain.recipes.llama import pipeline_plan as llama_plan

    if name == "cp2-tp2-sp":
        return meshtrain.verify(_gpt, batches(), optimizer=adamw, mesh=meshtrain.init(cp=2, tp=2), tp_plan=GPT_PLAN,
                                sp=True)
    if name == "cp2-tp2-sp-dropout":
        return meshtrain.verify(_gpt_dropout, batches(), optimizer=adamw, mesh=meshtrain.init(cp=2, tp=2),
                                tp_plan=GPT_PLAN, sp=True)
    if name == "cp2-tp2-ulysses":
        return meshtrain.verify(_gpt, batches(), optimizer=adamw, mesh=meshtrain.init(cp=2, tp=2), tp_plan=GPT_PLAN,
                                cp_mode="ulysses")
    return meshtrain.verify(_llama, batches(), optimizer=adamw, mesh=meshtrain.init(cp=2, pp=2),
                            pipeline=llama_plan(32), microbatches=2)


@pytest.mark.parametrize("name", ["cp2-tp2-sp", "cp2-tp2-sp-dropout", "cp2-tp2-ulysses", "cp2-pp2-1f1b"])
def test_context_parallelism_composes_with_tensor_and_pipeline_parallelism(name):
    """The ring under tp 2 with SP (heads split over tp, the ring over cp; SP's regions over
    a rank's s/cp tokens), all-to-all under tp 2 (n_heads/tp over cp), and the ring on the
    Llama in a 1F1B pipeline of 2 stages (the stages send s/cp tokens)."""
    report = run_ranks(_verify_composed, 4, name, timeout=600)[0]
    assert report.passed, report


def _ring_bytes(_mesh, recompute, mode="ring"):
    from meshtrain.comm import Comm
    from meshtrain.train import train
    from helpers import small_config

    cfg = small_config("gpt-test", 1, ROWS, dp=1, cp=2, recompute=recompute, cp_mode=mode)
    return train(cfg, Comm(meshtrain.init(cp=2))).comm_per_step


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_ring_bytes_are_the_formula(recompute):
    """Per rank and step, each of L layers: forward 2·b·s·d_kv·(cp−1)/cp elements (fp32
    here), backward as much again plus the gradients' cp hops, 2·b·s·d_kv fp32; full
    recompute runs the forward ring once more."""
    from meshtrain.plan.traffic import ring_attention_bytes

    b, s, d_kv, layers, cp = ROWS, T, 32, 8, 2
    forward = 2 * b * s * d_kv * (cp - 1) // cp * 4
    per_layer = forward * (2 if recompute == "full" else 1) + forward + 2 * b * s * d_kv * 4
    for sent in run_ranks(_ring_bytes, 2, recompute):
        assert sent["cp"] == layers * per_layer, sent
        assert sent["cp"] == ring_attention_bytes(layers, b, s, d_kv, cp, element_bytes=4,
                                                  recomputed=recompute == "full")


def _local_and_global_rows(_mesh):
    losses = []
    for rows in ("global", "local"):
        mesh = meshtrain.init(dp=2, cp=2)
        job = meshtrain.parallelize(_gpt(), mesh, optimizer=adamw)
        x, y = batches(1)[0]
        if rows == "local":
            x, y = x[mesh.rows(ROWS)], y[mesh.rows(ROWS)]
        losses.append(job.step(x, y, rows=rows).loss)
    return losses


def test_local_rows_under_context_parallelism():
    """The ranks of a cp group pass the same rows (`mesh.rows` splits over the batch's dp
    alone): rows='local' trains as rows='global' does."""
    for global_loss, local_loss in run_ranks(_local_and_global_rows, 4, timeout=300):
        assert local_loss == pytest.approx(global_loss, rel=1e-6)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_all_to_all_bytes_are_the_formula(recompute):
    """Per rank and step, each of L layers, each way (forward, backward; and the recomputed
    forward): b·(s/cp)·(2·h + 2·d_kv)·(cp−1)/cp elements, fp32 here."""
    from meshtrain.plan.traffic import all_to_all_attention_bytes

    b, s, h, d_kv, layers, cp = ROWS, T, 32, 32, 8, 2
    way = b * (s // cp) * (2 * h + 2 * d_kv) * (cp - 1) // cp * 4
    for sent in run_ranks(_ring_bytes, 2, recompute, "ulysses"):
        assert sent["cp"] == layers * way * (3 if recompute == "full" else 2), sent
        assert sent["cp"] == all_to_all_attention_bytes(layers, b, s, h, d_kv, cp, element_bytes=4,
                                                        recomputed=recompute == "full")


def _ulysses_refused(_mesh):
    with pytest.raises(ValueError, match="the 2 kv heads do not split over cp=4"):
        meshtrain.parallelize(make_llama(), meshtrain.init(cp=4), optimizer=adamw, cp_mode="ulysses")
    return True


def test_all_to_all_refuses_heads_that_do_not_split():
    assert run_ranks(_ulysses_refused, 4, timeout=300) == [True] * 4


def _probability_dropout_refused(_mesh):
    with pytest.raises(ValueError, match="attention-probability dropout"):
        model = build_model("gpt-test", 0, vocab_size=V, dropout=0.1, attention="math")
        meshtrain.parallelize(model, meshtrain.init(cp=2), optimizer=adamw)
    return True


def test_attention_probability_dropout_is_refused_under_cp():
    assert run_ranks(_probability_dropout_refused, 2, timeout=300) == [True] * 2
