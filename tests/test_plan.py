"""The planner's pure half: parameter counts, model-state bytes and the paper accounting of
activations, against the published numbers they come from (each test names its source and
its accounting)."""

import pytest

from meshtrain.models import count_params
from meshtrain.recipes.build import build_model
from meshtrain.plan.activations import activation_bytes_per_layer, torch_activation_bytes_per_layer
from meshtrain.plan.model_states import model_state_bytes
from meshtrain.plan.stage_activations import in_flight, torch_activation_bytes
from meshtrain.plan.shapes import megatron_params
from meshtrain.recipes import published_shapes, shape_of

# The released checkpoints' parameter counts (their model cards / safetensors indexes).
LLAMA_COUNTS = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
                "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", LLAMA_COUNTS)
def test_llama_presets_have_the_exact_published_parameter_counts(name):
    assert published_shapes()[name].n_params() == LLAMA_COUNTS[name]


@pytest.mark.parametrize("layers, hidden, billions", [
    (24, 2304, 1.7), (30, 3072, 3.6), (36, 4096, 7.5), (40, 6144, 18.4), (48, 8192, 39.1), (60, 10240, 76.1),
    (80, 12288, 145.6), (96, 16384, 310.1), (105, 20480, 529.6), (128, 25600, 1008.0)])
def test_megatron_formula_gives_narayanan_table_1(layers, hidden, billions):
    """Narayanan et al. (2021), Table 1 (V = 51,200, s = 2048), to the 0.1B it prints."""
    assert round(megatron_params(layers, hidden, 51200, 2048) / 1e9, 1) == billions


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-test", "gpt-small", "gpt2"])
def test_gpt_shapes_count_what_meshtrain_builds(name):
    vocab = 256 if name in ("gpt-tiny", "gpt-test") else 2048
    assert shape_of(name, vocab).n_params() == count_params(build_model(name, 0, vocab_size=vocab))


def test_zero_paper_figure_1_and_section_5():
    """Rajbhandari et al. (2020), Figure 1: Ψ = 7.5B, N_d = 64, K = 12 (paper accounting):
    120 GB, 31.4 GB, 16.6 GB, 1.9 GB for the baseline, P_os, P_os+g, P_os+g+p."""
    totals = [model_state_bytes(7.5e9, z, 64, accounting="paper")["total"] / 1e9 for z in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("precision, grad_dtype, per_param", [
    ("fp32", "compute", [16, 8 + 8 / 4, 4 + 12 / 4, 16 / 4]),
    ("bf16", "compute", [16, 4 + 12 / 4, 2 + 14 / 4, 16 / 4]),
    ("bf16", "fp32", [18, 6 + 12 / 4, 2 + 16 / 4, 18 / 4])])
def test_torch_accounting_is_what_the_trainer_keeps(precision, grad_dtype, per_param):
    """The torch accounting's bytes per parameter at dp = 4: the formulas test_zero.py checks
    against the trainer's measured model-state bytes."""
    for zero, expected in enumerate(per_param):
        got = model_state_bytes(1000, zero, 4, precision=precision, grad_dtype=grad_dtype)
        assert got["total"] == pytest.approx(1000 * expected)


def test_korthikanti_table_2():
    """Korthikanti et al. (2022), Table 2 (paper accounting), for GPT-3 175B's layer (s 2048,
    h 12288, a 96) at b = 1 and t = 8: sbh(10 + 24/t + 5as/(ht)) without SP,
    sbh(34/t + 5as/(ht)) with it, 34·sbh/t with SP and selective recompute, 2sbh full."""
    s, h, a, t = 2048, 12288, 96, 8
    sbh = s * h
    assert activation_bytes_per_layer(s, 1, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, 1, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(s, 1, h, a, tp=t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(s, 1, h, a, tp=t, sp=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert activation_bytes_per_layer(s, 1, h, a, recompute="full") == 2 * sbh
    # the paper's point: with SP and selective recompute a 175B layer needs ~0.1 GB per micro-batch
    assert round(34 * sbh / t / 1e9, 3) == 0.107


def test_first_stage_holds_p_micro_batches_under_1f1b():
    assert in_flight(4, 8) == 4 and in_flight(4, 2) == 2 and in_flight(4, 8, "gpipe") == 8
    assert in_flight(4, 8, "interleaved", chunks=2) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight(1, 8) == 1


def test_bad_planner_input():
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        shape_of("gpt5")
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        model_state_bytes(1, 4, 2)
    with pytest.raises(ValueError, match="unknown accounting"):
        model_state_bytes(1, 0, 2, accounting="guess")


@pytest.mark.parametrize("attention", ["math", "sdpa"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_accounting_of_a_layer_is_what_the_layer_probe_measures(attention, dropout, precision):
    """torch accounting: one block's activation bytes against the trainer's layer probe
    (gpt-test, b 8, s 64, one process), exactly."""
    import torch
    from helpers import small_config

    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh
    from meshtrain.train import train

    cfg = small_config("gpt-test", 1, 8, dp=1, precision=precision)
    cfg.model.attention, cfg.model.dropout, cfg.train.seq_len = attention, dropout, 64
    measured = train(cfg, Comm(Mesh.single(torch.device("cpu")))).activation_bytes_per_layer
    planned = torch_activation_bytes_per_layer(64, 8, 32, 4, element_bytes=2 if precision == "bf16" else 4,
                                               attention=attention, dropout=dropout)
    assert planned == measured


def _layer_probe(mesh, cfgs):
    from meshtrain.comm import Comm
    from meshtrain.train import train
    return [train(cfg, Comm(mesh)).activation_bytes_per_layer for cfg in cfgs]


def test_torch_accounting_of_a_layer_under_tensor_and_sequence_parallelism():
    """torch accounting: one block's bytes on each rank of tp = 2, with and without SP, math
    and sdpa, with and without dropout, against the layer probe, exactly."""
    from distributed import run_ranks
    from helpers import small_config

    cases = [(att, drop, sp) for att in ("math", "sdpa") for drop in (0.0, 0.1) for sp in (False, True)]
    cfgs = []
    for att, drop, sp in cases:
        cfg = small_config("gpt-test", 1, 8, dp=1, tp=2, sp=sp)
        cfg.model.attention, cfg.model.dropout, cfg.train.seq_len = att, drop, 64
        cfgs.append(cfg)
    for measured in run_ranks(_layer_probe, 2, cfgs, tp=2):
        for (att, drop, sp), got in zip(cases, measured):
            planned = torch_activation_bytes_per_layer(64, 8, 32, 4, attention=att, dropout=drop, tp=2, sp=sp)
            assert planned == got, (att, drop, sp)


@pytest.mark.parametrize("model, attention, dropout, precision, batch, seq", [
    ("gpt-test", "math", 0.0, "fp32", 8, 64), ("gpt-test", "sdpa", 0.0, "bf16", 8, 64),
    ("gpt-test", "sdpa", 0.1, "fp32", 4, 32), ("gpt-tiny", "math", 0.0, "fp32", 4, 128)])
def test_torch_accounting_of_a_step_is_the_measured_peak(model, attention, dropout, precision, batch, seq):
    """torch accounting: the whole step's activation peak against the trainer's live-storage
    meter (one process), within 0.1 % (what is left are the loss's scalars and such)."""
    import torch
    from helpers import small_config

    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh
    from meshtrain.train import train

    cfg = small_config(model, 1, batch, dp=1, precision=precision)
    cfg.model.attention, cfg.model.dropout, cfg.train.seq_len = attention, dropout, seq
    measured = train(cfg, Comm(Mesh.single(torch.device("cpu")))).activation_bytes
    spec = cfg.model.spec()
    planned = torch_activation_bytes(spec.n_layers, seq, batch, spec.d_model, spec.n_heads, 256,
                                     element_bytes=2 if precision == "bf16" else 4, attention=attention,
                                     dropout=dropout)
    assert abs(planned - measured) <= 0.001 * measured, (planned, measured)
