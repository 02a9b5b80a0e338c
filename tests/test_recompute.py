"""Activation checkpointing (`--recompute full|selective|segments[:K]`): every mode through
verify in data, tensor (with SP), pipeline and ZeRO layouts (stage 3 gathering the
parameters again for the recomputation), with dropout; the measured activation bytes of
each mode against none; and the refusals."""

import pytest
import torch
from distributed import run_ranks
from helpers import small_config, verdict
from presets import GPT_TEST_4

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import ConfigError
from meshtrain.cli.validate import validate
from meshtrain.parallel.options import parse_recompute
from meshtrain.mesh import Mesh
from meshtrain.train import train


def recompute_config(recompute, dp=1, tp=1, pp=1, microbatches=1, sp=False, zero=0, dropout=0.1, steps=3,
                     model=GPT_TEST_4):
    c = small_config(model, steps, 8, dp=dp, tp=tp, pp=pp, microbatches=microbatches, sp=sp, zero=zero,
                     recompute=recompute)
    c.model.dropout, c.model.attention = dropout, "math"
    return c


def _records(mesh, cfgs):
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


@pytest.mark.parametrize("world, sizes, cfgs", [
    (2, {}, [recompute_config(r, dp=2, microbatches=2) for r in ("full", "selective", "segments", "segments:3")]
     + [recompute_config("full", dp=2, zero=z) for z in (1, 2, 3)] + [recompute_config("selective", dp=2, zero=3)]
     + [recompute_config("segments", dp=2, zero=3, microbatches=2)]),
    (2, {"tp": 2}, [recompute_config("full", tp=2, sp=True), recompute_config("selective", tp=2, sp=True)]),
    (2, {"pp": 2}, [recompute_config("full", pp=2, microbatches=4), recompute_config("segments", pp=2, microbatches=4),
                    recompute_config("selective", pp=2, microbatches=4)]),
], ids=["dp2-every-mode-and-zero1-2-3", "tp2-sp", "pp2-1f1b"])
def test_every_recompute_mode_passes_verify_with_dropout(world, sizes, cfgs):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, **sizes)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.layout.recompute, cfg.layout.short(), result["failures"])


@pytest.fixture(scope="module")
def activation_bytes():
    """gpt-test (8 blocks, d 32, s 64, math attention), one process, one step per mode."""
    out = {}
    for mode in ("none", "full", "selective", "segments", "segments:8"):
        cfg = recompute_config(mode, dropout=0.0, steps=1, model="gpt-test")
        cfg.train.seq_len = 64
        r = train(cfg, Comm(Mesh.single(torch.device("cpu"))))
        out[mode] = r.activation_bytes
        if mode == "none":
            out["per_layer"] = r.activation_bytes_per_layer
    return out


def test_recompute_keeps_less_in_the_order_the_papers_give(activation_bytes):
    """Measured by the live-storage meter, which sees inside checkpoints and the recompute
    peak: full < segments < none, full < selective < none; a segment of all 8 blocks
    recomputes the whole stack at once, which is no checkpoint's peak plus its input."""
    a = activation_bytes
    assert a["full"] < a["segments"] < a["none"]
    assert a["full"] < a["selective"] < a["none"]
    # full keeps the 8 block inputs (8·64·32·4 bytes each) instead of 7 of the 8 blocks'
    # activations (what one block's forward leaves alive, measured by the layer probe)
    block_input = 8 * 64 * 32 * 4
    assert a["full"] <= a["none"] - 7 * a["per_layer"] + 8 * block_input, a
    assert a["segments:8"] <= a["none"] + block_input, a


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_full_keeps_one_blocks_share_of_none_and_the_block_inputs_on_gpt_small(attention):
    """The issue's bound, on gpt-small (8 blocks, d 256, batch 8 × 128, vocab 2048, fp32) as
    the benchmark runs it: full ≤ 1/L of none plus the 8 block inputs (measured: 29.5 MiB ≤
    22.3 + 8 under math, 26.0 ≤ 18.3 + 8 under sdpa). It holds because full runs the MLP in
    two chunks of rows and the loss holds two logits-sized tensors, not three: a whole
    block's recomputation held 33 and 29 MiB."""
    out = {}
    for mode in ("none", "full"):
        cfg = small_config("gpt-small", 1, 8, dp=1, recompute=mode)
        cfg.model.attention, cfg.train.seq_len, cfg.train.vocab_size = attention, 128, 2048
        out[mode] = train(cfg, Comm(Mesh.single(torch.device("cpu")))).activation_bytes
    block_input = 8 * 128 * 256 * 4
    assert out["full"] <= out["none"] / 8 + 8 * block_input, out


def test_bad_recompute_values_are_refused():
    assert parse_recompute("segments:4") == ("segments", 4) and parse_recompute("full") == ("full", None)
    for bad in ("segments:0", "segments:x", "full:2", "everything", "segments:"):
        with pytest.raises(ConfigError, match="--recompute none \\| full \\| selective \\| segments\\[:K\\]"):
            validate(recompute_config(bad, dp=1))
    mlp = small_config("mlp", 1, 8, dp=1, recompute="selective")
    with pytest.raises(ConfigError, match="mlp has no attention"):
        validate(mlp)
    validate(recompute_config("full", dp=2, zero=3))
    validate(recompute_config("segments:2", dp=2, zero=3))
