"""Expert parallelism (`parallel/experts.py`): `verify` passes with the experts split over ep
in every composition — dp, tp with and without SP, cp, pp (1F1B and zero-bubble), full
recompute, bf16, the bias — and on a rank that receives no tokens at all; it fails on each
mutant (patched inside the ranks only, so the one-process reference is the real code). The
all-to-all's bytes are the formula's, and each rank holds 1/ep of the experts."""

import dataclasses
from unittest import mock

import pytest
import torch
from distributed import run_ranks
from mutant_harness import records_of_every_mutant, verdicts_of
from test_moe import moe_config

from meshtrain import config as C
from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.parallel import experts as ep_module
from meshtrain.parallel.data import DataParallel
from meshtrain.recipes import PRESETS, add_preset

# 16 experts, one per token, dealt in turn: a micro-batch's 8 tokens all go to experts 0-7,
# which ep rank 0 holds — ep rank 1 receives nothing at all, and must still exchange.
WIDE = "moe-test-16"


def _add_wide_preset() -> None:
    add_preset(WIDE, dataclasses.replace(PRESETS["moe-test"], n_experts=16, top_k=1))


def _wide_config():
    c = moe_config(ep=2, moe_routing="balanced")
    c.model.name, c.train.seq_len, c.train.batch_size = WIDE, 8, 4  # micro-batches of 1 row: 8 tokens
    return c


LAYOUTS = {
    "dp2-ep2": moe_config(ep=2), "dp2-ep2-recompute": moe_config(ep=2, recompute="full"),
    "dp2-ep2-bf16": moe_config(ep=2, precision="bf16"),
    "dp2-ep2-bias": moe_config(ep=2, moe_balance="bias", moe_bias_rate=0.01),
    "tp2-ep2": moe_config(dp=1, tp=2, ep=2, microbatches=1),
    "tp2-sp-ep2": moe_config(dp=1, tp=2, sp=True, ep=2, microbatches=1),
    "cp2-ep2": moe_config(dp=1, cp=2, ep=2, microbatches=1),
    "ep2-no-tokens-on-rank-1": _wide_config(),
    # four ranks: an expert chunk with replicas (edp 2), and ep beside every other axis
    "dp4-ep2": moe_config(dp=4, ep=2, microbatches=1),
    "dp2-ep2-tp2-sp": moe_config(dp=2, tp=2, sp=True, ep=2, microbatches=1),
    "dp2-tp2-ep4": moe_config(dp=2, tp=2, ep=4, microbatches=1),
    "dp2-ep2-pp2": moe_config(dp=2, pp=2, ep=2, microbatches=4),
    "dp2-ep2-pp2-zb": moe_config(dp=2, pp=2, ep=2, microbatches=4, schedule="zb"),
    "dp2-ep2-cp2": moe_config(dp=2, cp=2, ep=2, microbatches=1),
    "dp2-ep2-recompute-4": moe_config(dp=4, ep=2, microbatches=1, recompute="full"),
}


def tokens_sent_to_the_neighbouring_ranks_experts():
    """Each block of rows goes to the next ep rank, whose experts run it."""
    real = ep_module.dispatch_and_run

    def shifted(compute, rows, counts, comm):
        return real(compute, rows, counts.roll(counts.numel() // comm.mesh.size("ep")), comm)
    return [mock.patch.object(ep_module, "dispatch_and_run", shifted)]


def expert_gradients_reduced_over_all_of_dp():
    """The experts' gradients summed over the whole dp group, not their chunk's replicas."""
    real = DataParallel._launch

    def launch(self, bucket):
        if self.axis == "edp":
            return self.comm.all_reduce(bucket.buffer, "dp", async_op=True)
        return real(self, bucket)
    return [mock.patch.object(DataParallel, "_launch", launch)]


def every_tp_rank_dispatches_every_token():
    """tp without SP: each tp rank sends all its (replicated) tokens, so each is computed tp times."""
    real = ep_module.apply_expert_parallel
    return [mock.patch("meshtrain.parallel.compose.apply_expert_parallel",
                       lambda model, comm, split_tp: real(model, comm, split_tp=False))]


def a_rank_receiving_no_tokens_skips_its_exchange():
    real = ep_module.dispatch_and_run

    def skipping(compute, rows, counts, comm):
        receive = comm.all_to_all(counts.view(comm.mesh.size("ep"), -1).contiguous(), "ep")
        if receive.sum() == 0:
            return torch.zeros_like(rows)
        return real(compute, rows, counts, comm)
    return [mock.patch.object(ep_module, "dispatch_and_run", skipping)]


MUTANTS = {f.__name__: (f, layout) for f, layout in (
    (tokens_sent_to_the_neighbouring_ranks_experts, "dp2-ep2"),
    (expert_gradients_reduced_over_all_of_dp, "dp2-ep2"),
    (every_tp_rank_dispatches_every_token, "tp2-ep2"))}


def _records(mesh, layouts, mutants):
    _add_wide_preset()  # in the ranks too
    return records_of_every_mutant(mesh, layouts, LAYOUTS, mutants)


@pytest.fixture(scope="module")
def verdicts():
    _add_wide_preset()

    def ranks(world, layouts, **axes):
        return run_ranks(_records, world, layouts, MUTANTS, **axes)[0]
    records = ranks(2, ["dp2-ep2", "dp2-ep2-recompute", "dp2-ep2-bf16", "dp2-ep2-bias", "ep2-no-tokens-on-rank-1"],
                    ep=2)
    records.update(ranks(2, ["tp2-ep2", "tp2-sp-ep2"], tp=2, ep=2))
    records.update(ranks(2, ["cp2-ep2"], cp=2, ep=2))
    records.update(ranks(4, ["dp4-ep2", "dp2-ep2-recompute-4"], ep=2))
    records.update(ranks(4, ["dp2-ep2-tp2-sp"], tp=2, ep=2))
    records.update(ranks(4, ["dp2-tp2-ep4"], tp=2, ep=4))
    records.update(ranks(4, ["dp2-ep2-pp2", "dp2-ep2-pp2-zb"], pp=2, ep=2))
    records.update(ranks(4, ["dp2-ep2-cp2"], cp=2, ep=2))
    return verdicts_of(records, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_with_the_experts_split(verdicts, layout):
    real = verdicts[f"real {layout}"]
    assert real["passed"], real["failures"]


@pytest.mark.parametrize("name", MUTANTS)
def test_verify_fails_on_the_mutant(verdicts, name):
    v = verdicts[name]
    assert not v["passed"], f"{name} slipped through verify"


def test_verify_fails_when_a_rank_receiving_no_tokens_skips_its_exchange():
    """A rank that receives no rows and skips the exchange leaves its peers' collectives to
    pair with the wrong ones: NCCL would hang; gloo either fails the run or mixes the data,
    and verify must not pass it."""
    _add_wide_preset()
    layout = "ep2-no-tokens-on-rank-1"
    mutants = {"skip": (a_rank_receiving_no_tokens_skips_its_exchange, layout)}
    try:
        records = run_ranks(_records, 2, [layout], mutants, ep=2, timeout=90, collective_timeout=15)[0]
    except AssertionError:  # a rank failed or hung: not a pass either
        return
    verdicts = verdicts_of(records, LAYOUTS)
    assert verdicts[f"real {layout}"]["passed"]
    assert not verdicts["skip"]["passed"], "a skipped exchange slipped through verify"


def test_the_layout_of_no_tokens_really_sends_rank_1_nothing():
    """The premise of the two tests above: under balanced routing of 8 tokens over 16 experts,
    ep rank 1 (experts 8-15) receives no row."""
    from meshtrain.models.moe import expert_counts
    chosen = (torch.arange(8 * 1) % 16).view(8, 1)  # TopKRouter's balanced routing of 8 tokens, k = 1
    counts = expert_counts(chosen, 16).view(2, 8)
    assert counts[1].sum() == 0 and counts[0].sum() == 8


# ---- resumed across ep ------------------------------------------------------------------------

def _resume_config(resume_layout: str, **layout):
    c = moe_config(**layout)
    c.train.steps, c.train.resume_at, c.train.resume_layout = 4, 2, resume_layout
    C.validate(c)
    return c


def _resumed_record(mesh, cfg, second):
    return verify.record_resumed(cfg, second, Comm(mesh), "layout")


@pytest.mark.parametrize("first,resumed", [("ep=2", "dp=2"), ("ep=2", "tp=2 microbatches=1"), ("", "dp=2 ep=2")])
def test_a_checkpoint_resumes_across_ep_within_verify_s_tolerances(first, resumed):
    """Saved with the experts split over ep (each rank's chunk, by the one-process names) and
    resumed with them whole on every rank, or the other way round: weights and Adam's
    moments come back bit for bit."""
    cfg = _resume_config(resumed, **C.parse_layout(first) if first else {})
    second = C.resumed_config(cfg)
    rec = run_ranks(_resumed_record, 2, cfg, second, ep=cfg.layout.ep)[0]
    result = verify.compare(rec, verify.run_reference(cfg, rec))
    assert result["passed"], result["failures"]
    assert result["max_resume_rel_diff"] == 0.0
