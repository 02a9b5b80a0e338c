"""The tests' own harness (tests/distributed.py): what a rank returns reaches the test as it was."""

import torch

from distributed import load_result, run_ranks, save_result


def _mixed():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    return {"fp32": base, "bf16": base.to(torch.bfloat16), "fp64": base.double(), "int": torch.arange(5),
            "bool": base > 0, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
            "strided": base.t()[1:, ::2], "nested": [(base[0], {"step": torch.tensor(2.0)}), None, "text", 7],
            "param": torch.nn.Parameter(base.clone()), "grad": base.clone().requires_grad_(), "size": base.shape}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and \
            a.requires_grad == b.requires_grad and torch.equal(a.detach(), b.detach())
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_ranks_result_comes_back_bit_for_bit_with_its_types(tmp_path):
    want = _mixed()
    save_result(want, tmp_path / "r.pt")
    got = load_result(tmp_path / "r.pt")
    assert _same(want, got)
    got["fp32"][0, 0] = 99.0  # writable, and its own memory
    assert want["fp32"][0, 0] != 99.0


def _return_mixed(mesh):
    return _mixed()


def test_run_ranks_returns_each_ranks_result():
    got = run_ranks(_return_mixed, 2)
    assert all(_same(_mixed(), r) for r in got)
