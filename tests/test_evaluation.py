"""Evaluation in every layout: `--eval-every`'s held-out loss under cp 2 (ring and
all-to-all), pp 2 and tp 2 equals one process's, and `job.forward` under cp returns the
whole sequence in its original order, as one process computes it."""

import torch
from distributed import run_ranks
from test_verify_mutants import mutant_config

import meshtrain
from meshtrain.comm import Comm
from meshtrain.mesh import Mesh
from meshtrain.train import train

LAYOUTS = {"cp2 ring": {"cp": 2}, "cp2 ulysses": {"cp": 2, "cp_mode": "ulysses"}, "pp2": {"pp": 2, "microbatches": 2},
           "tp2": {"tp": 2}}


def eval_config(**layout):
    cfg = mutant_config(**{"dp": 1, "microbatches": 1, **layout})
    cfg.train.steps, cfg.train.eval_every, cfg.train.eval_batches = 2, 1, 2
    return cfg


def _held_out_losses(_harness):
    out = {}
    for name, layout in LAYOUTS.items():
        axes = {k: v for k, v in layout.items() if k in ("cp", "pp", "tp")}
        mesh = meshtrain.init(**axes)
        result = train(eval_config(**layout), Comm(mesh))
        out[name] = result.val_losses
    mesh = meshtrain.init(cp=2)
    torch.manual_seed(0)
    from meshtrain.recipes.build import build_model
    model = build_model("gpt-test", 0, vocab_size=256)
    job = meshtrain.parallelize(model, mesh, optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    out["forward"] = job.forward(x)
    return out


def test_held_out_loss_and_forward_equal_one_process_in_every_layout():
    got = run_ranks(_held_out_losses, 2, timeout=600)[0]
    reference = train(eval_config(), Comm(Mesh.single(torch.device("cpu")))).val_losses
    assert [s for s, _ in reference] == [1, 2]
    for name in LAYOUTS:
        assert [s for s, _ in got[name]] == [1, 2], (name, got[name])
        for (_, a), (_, b) in zip(got[name], reference):
            assert abs(a - b) / b < 1e-5, (name, got[name], reference)
    from meshtrain.recipes.build import build_model
    model = build_model("gpt-test", 0, vocab_size=256).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(x)
    assert got["forward"].shape == whole.shape
    assert torch.allclose(got["forward"], whole, rtol=1e-5, atol=1e-5), (got["forward"] - whole).abs().max()
