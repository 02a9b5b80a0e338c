"""The planner's `torch` accounting of the Llama (RMSNorm, rotary, grouped-query attention,
SwiGLU) against the trainer's live-storage meter: one block against the layer probe, and
the step's peak per rank on one process, under tp (with and without SP) and in 1F1B
pipeline stages (llama-test: d 32, 4 query heads over 2 key/value heads of 12, SwiGLU 64,
vocab 256)."""

import pytest

from meshtrain.plan.activations import torch_activation_bytes_per_layer
from meshtrain.plan.block_terms import LlamaDims
from meshtrain.plan.stage_activations import torch_activation_bytes

LAYERS, HIDDEN, HEADS, KV_WIDTH, FFN, VOCAB = 8, 32, 4, 24, 64, 256
DIMS = LlamaDims(q_width=48, kv_width=24, head_dim=12)


def _config(recompute="none", batch=4, seq=32, precision="fp32", **layout):
    from helpers import small_config

    cfg = small_config("llama-test", 1, batch, dp=1, recompute=recompute, precision=precision, **layout)
    cfg.train.seq_len = seq
    return cfg


def _bytes(cfg) -> int:
    return 2 if cfg.layout.precision == "bf16" else 4


def _planned(cfg, stage=0):
    lay = cfg.layout
    return torch_activation_bytes(LAYERS, cfg.train.seq_len, cfg.train.batch_size // lay.microbatches, HIDDEN, HEADS,
                                  VOCAB, element_bytes=_bytes(cfg), ffn=FFN, llama=DIMS, tp=lay.tp,
                                  sp=lay.sp, recompute=lay.recompute, pp=lay.pp, stage=stage, schedule=lay.schedule,
                                  microbatches=lay.microbatches, chunks=lay.chunks)


def _measured(mesh, cfgs):
    from meshtrain.comm import Comm
    from meshtrain.train import train
    return [(r.activation_bytes, r.activation_bytes_per_layer) for r in (train(cfg, Comm(mesh)) for cfg in cfgs)]


def _check(cfgs, measured, stage=0, tolerance=0.005):
    for cfg, (got, _) in zip(cfgs, measured):
        planned = _planned(cfg, stage)
        assert abs(planned - got) <= tolerance * got, (cfg.layout.short(), cfg.layout.recompute, stage, planned, got)


def _layer(cfg) -> int:
    """One block as the probe reads it at the block's end: what it keeps, and in bf16 its own
    output too (alive then; the next block's residual sum frees it)."""
    lay, e = cfg.layout, _bytes(cfg)
    kept = torch_activation_bytes_per_layer(cfg.train.seq_len, cfg.train.batch_size, HIDDEN, HEADS, element_bytes=e,
                                            ffn=FFN, llama=DIMS, tp=lay.tp, sp=lay.sp)
    output = cfg.train.batch_size * cfg.train.seq_len * HIDDEN * e // (lay.tp if lay.sp else 1)
    return kept + (output if e < 4 else 0)


def test_llama_accounting_on_one_process():
    """One block exactly (the layer probe), and the step's peak under no, selective, full and
    segments recompute, fp32 and bf16, b·s 4·32, 1·64, 2·32 and 8·32, within 0.1 %
    (measured: within 0.005 %, the loss's scalars): the moments are the loss (none,
    selective), the MLP backward of a recomputed unit (full: the down projection's backward,
    which holds its input's and weight's gradients with all three of the other row chunk's
    weight gradients, or the product's, which holds the gradients of SiLU's output and of
    up with the other chunk's gate and up weight gradients; segments). At b = 2 (chunks of
    one row) the down projection's moment is the larger: planned 4.4 % low on llama-small
    until the other chunk's down gradient was counted there."""
    import torch

    from meshtrain.mesh import Mesh

    cfgs = [_config(rec, b, s) for rec in ("none", "selective", "full", "segments") for b, s in ((4, 32), (1, 64), (2, 32), (8, 32))]
    cfgs += [_config(rec, precision="bf16") for rec in ("none", "selective", "full", "segments")]
    measured = _measured(Mesh.single(torch.device("cpu")), cfgs)
    _check(cfgs, measured, tolerance=0.001)
    for cfg, (_, layer) in zip(cfgs, measured):
        if cfg.layout.recompute in ("none",):
            assert layer == _layer(cfg), (cfg.layout.precision, cfg.train.batch_size, cfg.train.seq_len)


def test_llama_accounting_under_tensor_and_sequence_parallelism():
    """Each rank of tp 2, with and without SP, under no, full, selective and segments
    recompute, and bf16 with SP: one block exactly, the step's peak within the issue's 5 %
    as the GPT's tp test holds it (measured on a quiet machine: −0.5 % to +0.2 %, the
    vocabulary-parallel loss's int64 copies of the targets; under load SP with segments
    −1.2 %: gloo's worker thread may still hold a finished collective's buffer when the
    meter reads the peak)."""
    from distributed import run_ranks

    cfgs = [_config(rec, tp=2, sp=sp) for sp in (False, True) for rec in ("none", "full", "selective", "segments")]
    cfgs += [_config(rec, tp=2, sp=True, precision="bf16") for rec in ("none", "full")]
    for measured in run_ranks(_measured, 2, cfgs, tp=2):
        _check(cfgs, measured, tolerance=0.05)
        for cfg, (_, layer) in zip(cfgs, measured):
            if cfg.layout.recompute == "none":
                assert layer == _layer(cfg), (cfg.layout.sp, cfg.layout.precision)


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2)])
def test_llama_accounting_of_pipeline_stages(schedule, chunks):
    """Each stage of pp 2, 4 micro-batches of 4, under no, full, selective and segments
    recompute (fp32) and no and full (bf16), within 1.5 % (measured: within 0.01 %, but
    bf16 with full recompute on the first stage, −1.4 %)."""
    from distributed import run_ranks

    cases = [(rec, "fp32") for rec in ("none", "full", "selective", "segments")] + [("none", "bf16"), ("full", "bf16")]
    cfgs = [_config(rec, batch=16, precision=prec, pp=2, microbatches=4, schedule=schedule, chunks=chunks)
            for rec, prec in cases]
    for stage, measured in enumerate(run_ranks(_measured, 2, cfgs, pp=2)):
        _check(cfgs, measured, stage, tolerance=0.015)


def test_plan_of_a_llama_preset_uses_its_head_dim_and_groups():
    """The planner's device figures for llama-test are the accounting's (the shape's head_dim
    12 ≠ d/h = 8, and 2 key/value heads), not a GPT's of the same d and heads."""
    from meshtrain.cli.config import Config
    from meshtrain.plan.planner import Device, Workload
    from meshtrain.recipes import shape_of

    cfg = Config()
    cfg.layout.dp = 1
    work = Workload(shape_of("llama-test", vocab_size=VOCAB), batch=4, seq=32)
    assert work.shape.head_size == 12 and work.shape.kv_width == KV_WIDTH
    device = Device(work, cfg.layout, "torch")
    assert device.activations(0) == _planned(_config())


def _measured_cp(_mesh, cfgs):
    import meshtrain
    from meshtrain.comm import Comm
    from meshtrain.train import train
    return [(r.activation_bytes, r.comm_per_step["cp"])
            for r in (train(cfg, Comm(meshtrain.init(cp=2))) for cfg in cfgs)]


ALL_TO_ALL_READS = 3


def test_the_plan_of_context_parallel_layouts():
    """The planner under cp 2 (llama-test, 4 × 64 tokens, each rank 32 of each sequence):
    each rank's activation peak within 0.2 % of the trainer's meter (measured: within
    0.05 %) for the ring with no and selective recompute, in bf16, and all-to-all attention;
    with full recompute, whose peak is the ring's backward, within 0.5 % (measured −0.3 %).
    The cp bytes it plans equal those sent in every case."""
    from distributed import run_ranks

    from meshtrain.plan import traffic
    from meshtrain.plan.planner import Device, Workload
    from meshtrain.recipes import shape_of

    cases = [("ring", "none", "fp32"), ("ring", "selective", "fp32"), ("ring", "full", "fp32"),
             ("ring", "none", "bf16"), ("ulysses", "none", "fp32")]
    cfgs = [_config(rec, batch=4, seq=64, precision=prec, cp=2, cp_mode=mode) for mode, rec, prec in cases]
    # The all-to-all's send buffers are released by gloo's worker thread a moment after the
    # caller wakes; a step allocating in that moment reads them as live too (+47,988 B in 3 of
    # 92 ulysses readings here, +48,640 B once in `make test-all`; none in 84 with a 5 ms pause
    # after each all-to-all). Ulysses is read three times, its lowest reading kept.
    reads = [ALL_TO_ALL_READS if cfg.layout.cp_mode == "ulysses" else 1 for cfg in cfgs]
    runs = [cfg for cfg, n in zip(cfgs, reads) for _ in range(n)]
    for measured in run_ranks(_measured_cp, 2, runs):
        readings = iter(measured)
        for cfg, n in zip(cfgs, reads):
            got, sent = min(next(readings) for _ in range(n))
            device = Device(Workload(shape_of("llama-test", vocab_size=VOCAB), batch=4, seq=64, device="cpu"), cfg.layout, "torch")
            planned = device.activations(0)
            tolerance = 0.005 if cfg.layout.recompute == "full" else 0.002
            assert abs(planned - got) <= tolerance * got, (cfg.layout.short(), cfg.layout.recompute, planned, got)
            assert traffic.bytes_per_axis(traffic.transfers(device, 0))["cp"] == sent, cfg.layout.short()


def _measured_math_kernel(_mesh, cfgs):
    import meshtrain
    from meshtrain.comm import Comm
    from meshtrain.parallel import context
    from meshtrain.parallel.block_kernels import math_kernel
    from meshtrain.train import train
    context.choose_kernel = lambda device, dtype, override=None: math_kernel()  # the kernel the plan models off CPU
    return [train(cfg, Comm(meshtrain.init(cp=2))).activation_bytes for cfg in cfgs]


def test_the_plan_of_the_rings_math_kernel():
    """The ring's blocks in the math kernel (what the plan models off CPU), planned for a CUDA run: with
    no recompute within 0.2 % of the meter (measured −0.04 %); with full recompute, whose
    peak is a block's backward with its two score tiles, within 1 % (measured −0.45 %)."""
    from distributed import run_ranks

    from meshtrain.plan.planner import Device, Workload
    from meshtrain.recipes import shape_of

    cfgs = [_config(rec, batch=4, seq=64, cp=2) for rec in ("none", "full")]
    for cfg, got in zip(cfgs, run_ranks(_measured_math_kernel, 2, cfgs)[0]):
        work = Workload(shape_of("llama-test", vocab_size=VOCAB), batch=4, seq=64, device="cuda")
        planned = Device(work, cfg.layout, "torch").activations(0)
        tolerance = 0.01 if cfg.layout.recompute == "full" else 0.002
        assert abs(planned - got) <= tolerance * got, (cfg.layout.recompute, planned, got)


def _measured_cp_pp(_mesh, cfg):
    import meshtrain
    from meshtrain.comm import Comm
    from meshtrain.train import train
    mesh = meshtrain.init(cp=2, pp=2)
    return mesh.coord("pp"), train(cfg, Comm(mesh)).activation_bytes


def test_the_plan_of_a_context_parallel_pipeline():
    """cp 2 · pp 2 (1F1B, 2 micro-batches): each stage's planned peak within the issue's 5 %
    of the meter (measured: −0.7 % and −0.1 %). The first stage peaks at a backward, where
    the ring's buffers are held after the block's MLP tensors were freed (planned +5.6 %
    before that was counted)."""
    from distributed import run_ranks

    from meshtrain.plan.planner import Device, Workload
    from meshtrain.recipes import shape_of

    cfg = _config("none", batch=4, seq=64, cp=2, pp=2, microbatches=2)
    device = Device(Workload(shape_of("llama-test", vocab_size=VOCAB), batch=4, seq=64, device="cpu"), cfg.layout, "torch")
    for stage, got in run_ranks(_measured_cp_pp, 4, cfg, timeout=300):
        planned = device.activations(stage)
        assert abs(planned - got) <= 0.05 * got, (stage, planned, got)
