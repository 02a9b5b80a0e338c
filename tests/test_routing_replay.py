"""A recomputed MoE block replays its forward's routing (issue 50): a test that perturbs
only the recomputation's router ranking (as a GPU's atomics or a compiled kernel's other
order would, on a near tie) sees the gradients of the run without recomputation, with and
without expert parallelism, under `full` and `segments:2`; without the replay (the mutant)
the perturbed recomputation chooses other experts and the gradients differ — under expert
parallelism the backward fails."""

from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from distributed import run_ranks

import meshtrain
from meshtrain.models import moe
from meshtrain.recipes.build import build_model

ROUTER = "layers.1.mlp.gate.weight"


def _noisy_in_recomputation():
    """TopKRouter.choose ranking by scores plus large noise when autograd's engine runs it
    (a recomputation): most tokens' top k change."""
    real, noise = moe.TopKRouter.choose, torch.Generator().manual_seed(7)

    def choose(self, ranked):
        if moe._in_backward():
            ranked = ranked + 10 * torch.rand(ranked.shape, generator=noise)
        return real(self, ranked)
    return mock.patch.object(moe.TopKRouter, "choose", choose)


def _grads(mesh, recompute: str) -> dict:
    torch.manual_seed(0)
    model = build_model("moe-test", 0, vocab_size=256)
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    job = meshtrain.parallelize(model, mesh, optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.0),
                                recompute=recompute)
    job.backward(ids[:, :-1], ids[:, 1:])
    return job.parallel.full_grads()


def _replayed(mesh, recompute: str, replay: bool = True):
    """The largest gradient difference, relative, between the run without recomputation
    and the perturbed recomputation (`replay=False`: the mutant, routing afresh)."""
    plain = _grads(mesh, "none")
    with ExitStack() as patches:
        patches.enter_context(_noisy_in_recomputation())
        if not replay:
            patches.enter_context(mock.patch("meshtrain.parallel.recompute._replayed", lambda choose: choose))
        again = _grads(mesh, recompute)
    if not mesh.is_main:
        return None
    assert plain[ROUTER].abs().max() > 0
    return max(float((again[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in plain.items())


@pytest.mark.parametrize("ep", [1, 2], ids=["one-process", "dp2-ep2"])
@pytest.mark.parametrize("recompute", ["full", "segments:2"])
def test_a_recomputation_replays_its_forwards_routing(recompute, ep):
    off = run_ranks(_replayed, ep, recompute, ep=ep)[0]
    assert off <= 1e-6, off


@pytest.mark.parametrize("recompute", ["full", "segments:2"])
def test_without_the_replay_a_perturbed_recomputation_trains_another_router(recompute):
    off = run_ranks(_replayed, 1, recompute, False)[0]
    assert off > 1e-2, off


def test_without_the_replay_expert_parallelism_fails_in_the_backward():
    with pytest.raises(AssertionError, match="CheckpointError|hung"):
        run_ranks(_replayed, 2, "full", False, ep=2, timeout=90)
