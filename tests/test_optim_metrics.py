import math

import pytest
import torch
from distributed import run_ranks

from meshtrain.comm import Comm
from meshtrain.config import TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.metrics import ActivationMeter, model_state_bytes
from meshtrain.models import build_model
from meshtrain.optim import SHARDED_OVER, build_optimizer, clip_grad_norm_


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


def test_activation_bytes_scale_with_the_micro_batch():
    model = build_model("gpt-tiny", 0, vocab_size=256)
    sizes = []
    for batch in (2, 4):
        meter = ActivationMeter(model)
        with meter:
            model(torch.randint(0, 256, (batch, 32))).sum().backward()
        sizes.append(meter.peak)
    assert sizes[0] > 0 and sizes[1] == pytest.approx(2 * sizes[0], rel=0.05)


def test_model_state_is_16_bytes_per_parameter_in_fp32_adam():
    model = build_model("gpt-tiny", 0, vocab_size=256)
    opt = build_optimizer(model, TrainConfig())
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert model_state_bytes(model, opt) == {"total": 16 * n, "params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
