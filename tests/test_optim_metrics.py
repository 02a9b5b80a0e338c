import math

import pytest
import torch
from distributed import run_ranks

import torch.utils.checkpoint

from meshtrain.comm import Comm
from meshtrain.cli.config import LayoutConfig, TrainConfig
from meshtrain.loss import cross_entropy_sum
from meshtrain.mesh import Mesh
from meshtrain.metrics import ActivationMeter
from meshtrain.recipes.build import build_model
from meshtrain.optim import SHARDED_OVER, clip_grad_norm_, grad_norm
from meshtrain.train import parallelize_config as parallelize
from meshtrain.recipes import PRESETS
from meshtrain.recipes.gpt import flops_per_step


def _full_grads():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randn(5, generator=g)


def _clip_with_one_sharded_param(mesh):
    """Rank r holds rows r::2 of the sharded gradient and the whole replicated one."""
    sharded_full, replicated = _full_grads()
    a = torch.nn.Parameter(torch.zeros(3, 4))
    a.grad = sharded_full[mesh.rank::2].clone()
    setattr(a, SHARDED_OVER, ("dp",))
    b = torch.nn.Parameter(torch.zeros(5))
    b.grad = replicated.clone()
    norm = clip_grad_norm_([a, b], 1.0, Comm(mesh))
    return norm, a.grad, b.grad


def test_clipping_uses_the_global_norm_of_sharded_gradients():
    sharded_full, replicated = _full_grads()
    expected = math.sqrt(sharded_full.pow(2).sum().item() + replicated.pow(2).sum().item())
    results = run_ranks(_clip_with_one_sharded_param, 2)
    scale = 1.0 / (expected + 1e-6)
    for rank, (norm, a_grad, b_grad) in enumerate(results):
        assert norm == pytest.approx(expected, rel=1e-6)
        torch.testing.assert_close(a_grad, sharded_full[rank::2] * scale)
        torch.testing.assert_close(b_grad, replicated * scale)


def test_clipping_leaves_small_gradients_alone():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.1, 0.2, 0.2])
    assert clip_grad_norm_([p], 1.0, Comm(Mesh.single(torch.device("cpu")))) == pytest.approx(0.3)
    assert torch.equal(p.grad, torch.tensor([0.1, 0.2, 0.2]))


def _large_gradient() -> torch.Tensor:
    """1,050,000 elements, a large vocabulary head's gradient: enough for fp32 sums to lose."""
    return torch.randn(1000, 1050, generator=torch.Generator().manual_seed(0))


def _with_grad(grad: torch.Tensor, sharded_over=()) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    if sharded_over:
        setattr(p, SHARDED_OVER, sharded_over)
    return p


def _norms_whole_and_in_pieces(mesh, axis):
    """The norm of the large gradient held whole (a replica on each rank) and in this rank's
    piece of it: a tensor-parallel half (columns) or a ZeRO piece (of the flat tensor)."""
    full, n, r = _large_gradient(), mesh.size(axis), mesh.coord(axis)
    piece = full.chunk(n, dim=1)[r].contiguous() if axis == "tp" else full.flatten().chunk(n)[r].clone()
    comm = Comm(mesh)
    return grad_norm([_with_grad(full)], comm).item(), grad_norm([_with_grad(piece, (axis,))], comm).item()


@pytest.mark.parametrize("axis", ["tp", "dp"])
def test_a_large_gradient_has_its_fp64_norm_whole_or_in_pieces(axis):
    """Whole, in tp halves or in ZeRO pieces, a gradient's norm is its fp64 norm: the squares
    are summed in fp64, so layouts that cut tensors differently agree (verify's gradient-norm
    check, at 1e-5). Summed in fp32 as before, this tensor's norm was 9.9e-6 off whole and
    4.8e-6 off in tp halves."""
    full = _large_gradient()
    exact = full.double().norm().item()
    fp32 = torch._foreach_norm([full], 2.0, dtype=torch.float32)[0].item()
    assert abs(fp32 - exact) / exact > 1e-6  # the old way's loss: the test can tell
    for whole, pieces in run_ranks(_norms_whole_and_in_pieces, 2, axis, tp=2 if axis == "tp" else 1):
        assert whole == pytest.approx(exact, rel=1e-6) and pieces == pytest.approx(exact, rel=1e-6)


def _peak(fn) -> int:
    with ActivationMeter() as meter:
        fn()
    return meter.peak


def _model_with_gradient_buffers(name: str):
    """As in training, gradients live in buffers made before the step, not counted."""
    model = build_model(name, 0, vocab_size=256)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def test_activation_peak_scales_with_the_micro_batch():
    model = _model_with_gradient_buffers("gpt-tiny")
    sizes = [_peak(lambda: model(torch.randint(0, 256, (b, 32))).sum().backward()) for b in (2, 4)]
    assert sizes[0] > 0 and sizes[1] == pytest.approx(2 * sizes[0], rel=0.05)


def test_activation_meter_sees_inside_checkpointing_and_micro_batches_in_flight():
    """What saved_tensors_hooks could not: recomputed blocks keep less alive, and two
    micro-batches whose forwards both ran before either backward hold twice one's peak."""
    model = _model_with_gradient_buffers("gpt-test")
    x = torch.randint(0, 256, (2, 32))

    def checkpointed():
        h = model.embed(x)
        for block in model.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        model.head(model.norm(h)).sum().backward()

    def two_in_flight():
        a, b = model(x).sum(), model(x).sum()
        a.backward()
        b.backward()
    plain = _peak(lambda: model(x).sum().backward())
    assert _peak(checkpointed) < plain / 2
    assert _peak(two_in_flight) == pytest.approx(2 * plain, rel=0.1)


def _what_the_meter_counts(mesh):
    """Readings of one meter: a fresh allocation; a view, an in-place op, `_unsafe_view` (a
    view its schema calls fresh) of a parameter; a collective's result (its input); the
    fresh storage again through a view; after the fresh storage is freed."""
    param = torch.nn.Parameter(torch.zeros(64))
    grad = torch.ones(32)
    with ActivationMeter() as meter:
        fresh = torch.ones(1000)  # 4,000 bytes
        readings = [meter.live]
        param.view(8, 8)
        grad.mul_(2)
        torch.ops.aten._unsafe_view(param, [8, 8])
        Comm(mesh).all_reduce(grad, "dp")
        torch.ops.aten._unsafe_view(fresh, [10, 100])
        readings.append(meter.live)
        del fresh
        readings += [meter.live, meter.peak]
    return readings


def test_the_meter_counts_each_fresh_storage_once_and_no_input_s():
    """Fresh storages count until freed; views, in-place results, `_unsafe_view` of an input
    and a collective's result (its input, though its schema does not say so) never count."""
    assert run_ranks(_what_the_meter_counts, 2) == [[4000, 4000, 0, 4000]] * 2


def test_gpt_flops_formula_matches_a_count_of_every_matmul():
    """72·B·s·l·h²·(1 + s/6h + V/12lh) against torch's FLOP counter on a real step (the math
    attention path, whose matmuls the counter sees)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model("gpt-test", 0, vocab_size=256)
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cross_entropy_sum(model(x), y).backward()
    assert counter.get_total_flops() == flops_per_step(PRESETS["gpt-test"], 256, batch=2, seq_len=32)


def test_model_state_is_16_bytes_per_parameter_in_fp32_adam():
    model = build_model("gpt-tiny", 0, vocab_size=256)
    p = parallelize(model, Comm(Mesh.single(torch.device("cpu"))), LayoutConfig(dp=1), TrainConfig())
    p.loss_fn(model(torch.randint(0, 256, (1, 8))), torch.randint(0, 256, (1, 8))).backward()
    p.optimizer.step()
    n = sum(q.numel() for q in model.parameters())
    assert p.model_state_bytes() == {"total": 16 * n, "params": 4 * n, "grads": 4 * n, "master": 0,
                                     "optimizer": 8 * n, "gathered": 0}
