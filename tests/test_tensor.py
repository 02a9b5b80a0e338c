"""Tensor and sequence parallelism on real gloo processes: every parallel layer against its
unsharded twin (forward and every gradient), the vocabulary-parallel cross-entropy, the
traffic formula, the memory split, and whole layouts through verify."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks
from helpers import verdict
from presets import GPT_TEST_4
from torch.utils._python_dispatch import TorchDispatchMode

from meshtrain import verifier as verify
from meshtrain.recipes import PRESETS
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.optim import clip_grad_norm_
from meshtrain.parallel.dropout import DropoutKeys, SeededDropout
from meshtrain.parallel.state import gather_full
from meshtrain.parallel.tensor import (COLUMN, REGION, ROW, SEQUENCE, VOCAB, TensorPlan, apply_plan,
                                       vocab_parallel_cross_entropy_sum)
from meshtrain.train import train


def _seeded(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Twin(nn.Module):
    """A small region — embedding, a column/row pair, a head — to shard by a plan."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(16, 8)
        self.pos = nn.Embedding(6, 8)
        self.norm = nn.LayerNorm(8)
        self.region = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        x = x + self.region(self.norm(x))
        return self.head(x)


TWIN_PLAN = TensorPlan({"tok": VOCAB, "pos": SEQUENCE, "region": REGION, "region.0": COLUMN, "region.2": ROW,
                        "head": (REGION, COLUMN)}, vocab_parallel_loss=True)


def _twin_step(mesh, sp):
    """Loss and every full gradient of the sharded twin (vocab-parallel loss included)."""
    comm = Comm(mesh)
    model = _Twin()
    whole = apply_plan(model, TWIN_PLAN, comm, sp)
    ids, targets = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(1)), _seeded(3, 6).abs()
    targets = (targets * 5).long() % 16
    loss = vocab_parallel_cross_entropy_sum(comm)(model(ids), targets)
    loss.backward()
    for p in whole:  # what TensorParallelSync does under SP
        comm.all_reduce(p.grad, "tp")
    grads = {n: gather_full(p.grad, getattr(p, "meshtrain_shard", None), comm) for n, p in model.named_parameters()}
    norm = clip_grad_norm_(list(model.parameters()), 0.0, comm)  # 0: measure only
    return {"loss": loss.item(), "grads": grads, "norm": norm,
            "whole": sorted(n for n, p in model.named_parameters() if any(p is q for q in whole))}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parallel_layers_equal_their_unsharded_twin(sp):
    ref = _Twin()
    ids = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(1))
    targets = ((_seeded(3, 6).abs() * 5).long()) % 16
    loss = F.cross_entropy(ref(ids).reshape(-1, 16), targets.reshape(-1), reduction="sum")
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    for rank in run_ranks(_twin_step, 2, sp, tp=2):
        assert rank["loss"] == pytest.approx(loss.item(), rel=1e-6)
        # the clipping norm counts each shard once and each whole parameter once, not tp times
        assert rank["norm"] == pytest.approx(norm, rel=1e-6)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(rank["grads"][name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
        # under SP the whole parameters (norm, row bias, positions) are the ones summed over tp
        assert rank["whole"] == (["norm.bias", "norm.weight", "pos.weight", "region.2.bias"] if sp else [])


class _LargestLastDim(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.largest = max(self.largest, t.shape[-1])
        return out


def _cross_entropy_of_shards(mesh):
    comm = Comm(mesh)
    full = _seeded(10, 64, seed=3)
    targets = torch.arange(10) * 7 % 64
    local = full.chunk(2, dim=-1)[mesh.rank].clone().requires_grad_()
    with _LargestLastDim() as seen:
        loss = vocab_parallel_cross_entropy_sum(comm)(local, targets)
        loss.backward()
    return {"loss": loss.item(), "grad": local.grad, "largest_last_dim": seen.largest}


def test_vocab_parallel_cross_entropy_equals_the_full_softmax_without_holding_it():
    full = _seeded(10, 64, seed=3).requires_grad_()
    targets = torch.arange(10) * 7 % 64
    loss = F.cross_entropy(full, targets, reduction="sum")
    loss.backward()
    ranks = run_ranks(_cross_entropy_of_shards, 2, tp=2)
    for rank, r in enumerate(ranks):
        assert r["loss"] == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(r["grad"], full.grad.chunk(2, dim=-1)[rank])
        assert r["largest_last_dim"] == 32  # no [tokens × 64] tensor on any rank


def tp_config(tp, dp=1, sp=False, microbatches=1, steps=3, model=GPT_TEST_4, dropout=0.0, attention="sdpa",
              **train) -> Config:
    c = Config()
    c.model.name, c.model.dropout, c.model.attention = model, dropout, attention
    c.layout.dp, c.layout.tp, c.layout.sp, c.layout.microbatches, c.layout.bucket_mb = dp, tp, sp, microbatches, 0.02
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = steps, 8, 32, 256, "cpu"
    if model == "mlp":
        c.train.data, c.train.batch_size = "digits", 32
    for k, v in train.items():
        setattr(c.train, k, v)
    return c


def _records(mesh, cfgs):
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


@pytest.mark.parametrize("world, tp, cfgs", [
    (2, 2, [tp_config(2), tp_config(2, sp=True), tp_config(2, sp=True, dropout=0.1), tp_config(2, model="mlp")]),
    (4, 4, [tp_config(4), tp_config(4, sp=True)]),
    (4, 2, [tp_config(2, dp=2), tp_config(2, dp=2, sp=True, microbatches=2),
            tp_config(2, dp=2, sp=True, microbatches=2, dropout=0.1, attention="math")]),
], ids=["tp2,tp2-sp,tp2-sp-dropout,mlp-tp2", "tp4,tp4-sp", "dp2-tp2,dp2-tp2-sp-mb2,+dropout-math"])
def test_tensor_parallel_layouts_pass_verify(world, tp, cfgs):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, tp=tp)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.layout.short(), cfg.layout.sp, result["failures"])


def _measure(mesh, cfg):
    r = train(cfg, Comm(mesh))
    sharded = sum(p.numel() for p in r.parallel.trained if hasattr(p, "meshtrain_shard"))
    return {"comm": r.comm_per_step, "n_params": r.n_params, "model_state": r.model_state, "sharded": sharded,
            "local": sum(p.numel() for p in r.parallel.trained)}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_traffic_matches_the_formula(sp):
    """Per step and rank, bytes sent on the tp axis (fp32, t = 2, one micro-batch):
    TP  — per block 2 all-reduces of b·s·h forward and 2 backward, the embedding's forward
          all-reduce and the head input's backward all-reduce, the cross-entropy's three
          all-reduces of b·s: ring 2(t−1)/t each.
    SP  — each all-reduce becomes an all-gather or a reduce-scatter ((t−1)/t each), twice as
          many; plus one backward re-gather of each region's input (attention, MLP, head),
          and the all-reduce of the gradients SP leaves whole (norms, row biases, positions)."""
    t, cfg = 2, tp_config(2, sp=sp, steps=2)
    b, s, h, layers = cfg.train.batch_size, cfg.train.seq_len, 32, PRESETS[cfg.model.name].n_layers
    ring, half = 2 * (t - 1) / t, (t - 1) / t
    act = b * s * h * 4
    ce = 3 * ring * b * s * 4
    if not sp:
        expected = ring * act * (4 * layers + 2) + ce
    else:
        whole = (layers * (2 * 2 * h + 2 * h) + 2 * h + 64 * h) * 4  # ln1, ln2, row biases; norm; positions
        regions = 2 * layers + 1
        expected = half * act * (2 * 2 * layers + 2 + 3 * regions) + ce + ring * whole
    for rank in run_ranks(_measure, 2, cfg, tp=2):
        assert rank["comm"]["tp"] == round(expected)
        assert rank["comm"]["dp"] == 0


def test_tp_model_state_is_the_replicated_part_plus_a_tp_th_of_the_sharded_one():
    cfg = tp_config(2, steps=1)
    for rank in run_ranks(_measure, 2, cfg, tp=2):
        replicated = rank["local"] - rank["sharded"]
        sharded_full = rank["n_params"] - replicated
        assert rank["sharded"] == sharded_full // 2
        # parameters, gradients and Adam's two moments, 16 bytes each, of what this rank holds
        assert rank["model_state"]["total"] == 16 * (replicated + sharded_full // 2)


def _masks_of_shards(mesh):
    """Each tp rank's SeededDropout, its input sharded along dim 1, applied to ones."""
    keys = DropoutKeys(seed=5)
    keys.use(step=3, rows=slice(2, 4))
    drop = SeededDropout(0.5, keys, "blocks.0.attn.attn_drop")
    drop.shard = (1, Comm(mesh))
    return drop(torch.ones(2, 2, 6, 6))


def test_dropout_masks_are_the_full_masks_cut_to_each_shard():
    keys = DropoutKeys(seed=5)
    keys.use(step=3, rows=slice(2, 4))
    full = SeededDropout(0.5, keys, "blocks.0.attn.attn_drop")(torch.ones(2, 4, 6, 6))
    shards = run_ranks(_masks_of_shards, 2, tp=2)
    assert torch.equal(torch.cat(shards, dim=1), full)
    assert 0.3 < (full == 0).float().mean() < 0.7 and set(full.unique().tolist()) == {0.0, 2.0}
    # another step, another site, or other samples: other masks
    for step, rows, site in [(4, slice(2, 4), "blocks.0.attn.attn_drop"), (3, slice(0, 2), "blocks.0.attn.attn_drop"),
                             (3, slice(2, 4), "blocks.1.attn.attn_drop")]:
        keys.use(step, rows)
        assert not torch.equal(SeededDropout(0.5, keys, site)(torch.ones(2, 4, 6, 6)), full)


def _layer_bytes(mesh, cfg):
    return train(cfg, Comm(mesh)).activation_bytes_per_layer


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_activation_bytes_per_layer_are_korthikantis_formula_in_fp32(sp):
    """What one block leaves alive for backward (--attention math, dropout on), against
    Korthikanti et al.'s per-layer bytes, sbh(10 + 24/t + 5as/(ht)) for TP and
    sbh/t·(34 + 5as/h) with SP, converted from fp16 (2-byte activations, 1-byte masks) to
    fp32 (4 and 1): sbh(18 + 48/t + 9as/(ht)) and sbh/t·(66 + 9as/h). The only extras are
    what the paper leaves out: LayerNorm's mean and 1/std (4 bytes per token each, for two
    norms, sharded with the sequence under SP) and the causal mask (s² bytes)."""
    t, cfg = 2, tp_config(2, sp=sp, steps=1, dropout=0.1, attention="math")
    b, s, h, a = cfg.train.batch_size, cfg.train.seq_len, 32, 4
    sbh = s * b * h
    if sp:
        formula = sbh / t * (66 + 9 * a * s / h)
        extras = 2 * 2 * b * s * 4 / t + s * s
    else:
        formula = sbh * (18 + 48 / t + 9 * a * s / (h * t))
        extras = 2 * 2 * b * s * 4 + s * s
    for measured in run_ranks(_layer_bytes, 2, cfg, tp=2):
        assert measured == formula + extras


@pytest.mark.slow
def test_gpt_small_tp2_model_state_is_the_replicated_part_plus_half_the_sharded_one():
    cfg = tp_config(2, steps=1, model="gpt-small", vocab_size=2048, seq_len=128)
    for rank in run_ranks(_measure, 2, cfg, tp=2):
        replicated = rank["local"] - rank["sharded"]
        assert rank["sharded"] * 2 + replicated == rank["n_params"]
        assert rank["model_state"]["total"] == 16 * (replicated + (rank["n_params"] - replicated) // 2)
