import torch

from meshtrain.models import count_params
from meshtrain.recipes.build import build_model


def test_sizes():
    assert count_params(build_model("gpt-tiny", 0, vocab_size=256)) < 1_000_000
    assert 5_000_000 <= count_params(build_model("gpt-small", 0, vocab_size=2048)) <= 10_000_000
    mlp = build_model("mlp", 0, n_inputs=64, n_classes=10)
    assert all(isinstance(m, (torch.nn.Linear, torch.nn.ReLU, torch.nn.Sequential, torch.nn.ModuleList))
               for m in mlp.modules() if m is not mlp)


def test_weights_come_from_the_seed():
    a, b, c = (build_model("gpt-tiny", s, vocab_size=256) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_gpt_is_causal():
    model = build_model("gpt-tiny", 0, vocab_size=256).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(x)[:, :10], model(y)[:, :10])
        assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


def test_gpt_has_plain_structure():
    model = build_model("gpt-tiny", 0, vocab_size=256)
    names = {n for n, _ in model.named_children()}
    assert {"embed", "blocks", "norm", "head"} == names
