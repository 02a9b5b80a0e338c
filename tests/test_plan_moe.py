"""The planner's mixture of experts (issue 37, point 5): its parameter counts against the
built models and the released checkpoints, its FLOPs against the recipe's (the trainer's
MFU numerator), and its `torch` accounting against the trainer's meter with forced-balanced
routing (`--moe-routing balanced`): one block against the layer probe, and each rank's
model states, activation peak and bytes sent in real runs — one process under every
recompute mode, dp 2 with ZeRO, tp 2 with and without SP, pp 2. Then `plan --model` and
`plan --search` of MoE shapes.

Two test models: `moe-test` (block 0 dense, three MoE layers; its vocabulary of 256 makes
the loss the step's peak) and `moe-wide`, the same with every block a MoE layer of experts
512 wide, whose peak is a MoE layer's backward (at the SwiGLU product's: registered in each
process that trains it); and once `moe-small` (d 256, experts 352 wide), whose MoE layers
peak at the weighting's backward."""

import dataclasses

import pytest

from meshtrain.plan import traffic
from meshtrain.plan.cost import model_flops
from meshtrain.plan.memory import torch_activation_bytes_per_layer
from meshtrain.plan.planner import Device, Workload
from meshtrain.recipes import PRESETS, PUBLISHED, family_of, shape_of

VOCAB = 256
# The released checkpoints' parameter counts (their safetensors indexes: bytes ÷ 2 in bf16),
# and what their model cards call them active per token, in billions.
MOE_COUNTS = {"mixtral-8x7b": (46_702_792_704, 12.9), "mixtral-8x22b": (140_630_071_296, 39.2),
              "qwen3-30b-a3b": (30_532_122_624, 3.35), "qwen3-235b-a22b": (235_093_634_560, 22.2),
              "olmoe-1b-7b": (6_919_161_856, 1.28)}


def _register():
    """`moe-wide`: moe-test with every block a MoE layer of experts 512 wide."""
    from meshtrain.recipes import add_preset, is_preset
    if not is_preset("moe-wide"):
        add_preset("moe-wide", dataclasses.replace(PRESETS["moe-test"], dense_layers=(), expert_ffn_dim=512))


def _config(model="moe-test", recompute="none", batch=4, seq=32, precision="fp32", **layout):
    from helpers import small_config

    cfg = small_config(model, 1, batch, recompute=recompute, precision=precision, **{"dp": 1, **layout})
    cfg.train.seq_len = seq
    cfg.model.moe_routing = "balanced"  # a fixed load: each expert k·tokens/E rows
    return cfg


def _device(cfg, stage_device="cpu") -> Device:
    _register()
    spec = PRESETS[cfg.model.name]
    shape = family_of(spec).shape(spec, VOCAB)
    return Device(Workload(shape, cfg.train.batch_size, cfg.train.seq_len, device=stage_device), cfg.layout)


def _measured(_mesh, cfgs):
    import meshtrain
    from meshtrain.comm import Comm
    from meshtrain.train import train

    _register()
    out = []
    for cfg in cfgs:
        lay = cfg.layout
        mesh = meshtrain.init(dp=lay.dp, tp=lay.tp, pp=lay.pp, device="cpu")
        r = train(cfg, Comm(mesh))
        gathered = r.model_state.get("gathered", 0)
        out.append((mesh.coord("pp"), r.model_state["total"], gathered, r.activation_bytes,
                    r.activation_bytes_per_layer, r.comm_detail_per_step))
    return out


def _by_kind(transfers) -> dict:
    return {k: sum(x.total for x in transfers if x.kind == k) for k in {x.kind for x in transfers}}


def _probe(cfg, device: Device, layer: int) -> int:
    """Block `layer` as the layer probe reads it at the block's end: what it keeps (the RoPE
    table with it), and in bf16 its own output too (alive then)."""
    sh, lay, e = device.shape, cfg.layout, device.element_bytes
    kept = torch_activation_bytes_per_layer(device.seq, device.micro_batch, sh.hidden, sh.heads, element_bytes=e,
                                            moe=device.moe_dims() if sh.is_moe(layer) else None,
                                            **{k: v for k, v in device._torch_terms().items()
                                               if k not in ("element_bytes", "attention", "dropout", "cp_mode")})
    return kept + (device.micro_batch * device.seq * sh.hidden * e // (lay.tp if lay.sp else 1) if e < 4 else 0)


RESIDUALS = {}  # what the runs measured, for the doc's table (printed with -s)


def _check(cfgs, per_rank, tolerance=0.05):
    for rank, measured in enumerate(per_rank):
        for cfg, (stage, state, gathered, act, layer, sent) in zip(cfgs, measured):
            lay = cfg.layout
            d = _device(cfg)
            where = (cfg.model.name, lay.short(), lay.recompute, lay.precision, rank)
            planned_state = d.model_states(stage)["total"]
            planned_act = d.activations(stage)
            RESIDUALS[where] = (planned_state / state - 1, planned_act / act - 1)
            print(where, f"states {planned_state:.0f} / {state:.0f}, activations {planned_act:.0f} / {act} "
                         f"({100 * (planned_act / act - 1):+.2f} %)")
            assert abs(planned_state - state) <= 0.05 * state, (where, planned_state, state)
            if gathered:  # the meter also sees the parameter buffers ZeRO-3 gathers during the step
                assert planned_act <= act * 1.001 and act <= (planned_act + gathered) * 1.001, (where, planned_act, act)
            else:
                assert abs(planned_act - act) <= tolerance * act, (where, planned_act, act)
            if lay.recompute == "none" and layer is not None:  # the stage's first block, exactly
                first = d.layers_on(stage)[0]
                assert layer == _probe(cfg, d, first), (where, layer, _probe(cfg, d, first))
            planned = {axis: _by_kind(xs) for axis, xs in traffic.transfers(d, stage).items()}
            assert planned == {axis: sent.get(axis, {}) for axis in planned}, (where, planned, sent)


def test_moe_accounting_on_one_process():
    """Each recompute mode, fp32 and bf16, on moe-test (the loss's moment) and moe-wide (a
    MoE layer's backward: at the weighting, or in fp32 at the SwiGLU product's backward)."""
    from distributed import run_ranks

    cfgs = [_config(model, rec) for model in ("moe-test", "moe-wide") for rec in ("none", "selective", "full", "segments")]
    cfgs += [_config(model, rec, precision="bf16") for model in ("moe-test", "moe-wide") for rec in ("none", "full")]
    cfgs += [_config("moe-small", "none", batch=2)]
    _check(cfgs, run_ranks(_measured, 1, cfgs))


def test_moe_accounting_under_data_tensor_and_sequence_parallelism():
    """tp 2 with and without SP (the experts replicated: not divided by tp; under SP each rank
    routes its half of the sequence), and dp 2 with ZeRO-1 and ZeRO-3."""
    from distributed import run_ranks

    cfgs = [_config(model, rec, tp=2, sp=sp) for model in ("moe-test", "moe-wide") for sp in (False, True)
            for rec in ("none", "full")]
    cfgs += [_config("moe-wide", "selective", tp=2, sp=True), _config("moe-wide", "none", tp=2, sp=True, precision="bf16")]
    _check(cfgs, run_ranks(_measured, 2, cfgs))
    cfgs = [_config(model, "none", dp=2, zero=zero) for model in ("moe-test", "moe-wide") for zero in (1, 3)]
    _check(cfgs, run_ranks(_measured, 2, cfgs))


def test_moe_accounting_of_pipeline_stages():
    """pp 2, 1F1B, 4 micro-batches: stage 0 holds the dense block and a MoE layer, stage 1
    two MoE layers (whose first the layer probe measures)."""
    from distributed import run_ranks

    cfgs = [_config(model, rec, batch=16, pp=2, microbatches=4) for model in ("moe-test", "moe-wide")
            for rec in ("none", "full")]
    _check(cfgs, run_ranks(_measured, 2, cfgs))
