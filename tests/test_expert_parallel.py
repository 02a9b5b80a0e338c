"""Expert parallelism (`parallel/experts.py`): `verify` passes with the experts split over ep
in every composition — dp, ZeRO 1-3 (each expert chunk sharded over its own replicas), tp
with and without SP, cp, pp (1F1B and zero-bubble), full recompute, bf16, the bias, --compile; a rank that receives no tokens at all still exchanges (and
skipping it fails); verify fails on each
mutant (patched inside the ranks only, so the one-process reference is the real code). The
all-to-all's bytes are the formula's, and each rank holds 1/ep of the experts (`test_plan_moe.py`)."""

from unittest import mock

import pytest
import torch
from distributed import run_ranks
from helpers import verdict
from mutant_harness import assert_mutant_fails, assert_real_passes, records_of_every_mutant, verdicts_of
from test_moe import moe_config

import meshtrain
from meshtrain.cli import config as C
from meshtrain.cli.resume_at import resumed_config
from meshtrain.cli.validate import validate
from meshtrain.parallel.options import parse_layout
from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.parallel import experts as ep_module
from meshtrain.parallel.data import DataParallel

# 16 experts, one per token, dealt in turn along each row of 8 tokens: every token goes to
# experts 0-7, which ep rank 0 holds, in every layout and in one process alike — ep rank 1
# receives no row at all, and must still take part in every exchange.
SIXTEEN = "moe-test-16"


def _add_sixteen_preset() -> None:
    import dataclasses

    from meshtrain.recipes import PRESETS, add_preset
    add_preset(SIXTEEN, dataclasses.replace(PRESETS["moe-test"], n_experts=16, top_k=1))


def _no_tokens_config():
    _add_sixteen_preset()
    c = moe_config(ep=2, moe_routing="balanced")
    c.model.name, c.train.seq_len = SIXTEEN, 8
    return c


LAYOUTS = {
    "dp2-ep2": moe_config(ep=2), "dp2-ep2-recompute": moe_config(ep=2, recompute="full"),
    "dp2-ep2-bf16": moe_config(ep=2, precision="bf16"),
    "dp2-ep2-bias": moe_config(ep=2, moe_balance="bias", moe_bias_rate=0.01),
    "dp2-ep2-compile": moe_config(ep=2, compile=True, compile_backend="aot_eager"),  # the exchange runs eagerly
    "ep2-no-tokens-on-rank-1": _no_tokens_config(),
    "tp2-ep2": moe_config(dp=1, tp=2, ep=2, microbatches=1),
    "tp2-sp-ep2": moe_config(dp=1, tp=2, sp=True, ep=2, microbatches=1),
    "cp2-ep2": moe_config(dp=1, cp=2, ep=2, microbatches=1),
    # four ranks: an expert chunk with replicas (edp 2), and ep beside every other axis
    "dp4-ep2": moe_config(dp=4, ep=2, microbatches=1),
    "dp2-ep2-tp2-sp": moe_config(dp=2, tp=2, sp=True, ep=2, microbatches=1),
    "dp2-tp2-ep4": moe_config(dp=2, tp=2, ep=4, microbatches=1),
    "dp2-ep2-pp2": moe_config(dp=2, pp=2, ep=2, microbatches=4),
    "dp2-ep2-pp2-zb": moe_config(dp=2, pp=2, ep=2, microbatches=4, schedule="zb"),
    "dp2-ep2-cp2": moe_config(dp=2, cp=2, ep=2, microbatches=1),
    "dp2-ep2-recompute-4": moe_config(dp=4, ep=2, microbatches=1, recompute="full"),
    # ZeRO: the dense parameters sharded over dp·cp, each expert chunk over its edp replicas
    "dp2-ep2-zero1": moe_config(ep=2, zero=1), "dp2-ep2-zero3": moe_config(ep=2, zero=3),
    "dp2-ep2-zero3-bf16": moe_config(ep=2, zero=3, precision="bf16"),
    "dp4-ep2-zero3": moe_config(dp=4, ep=2, zero=3, microbatches=1),
    "dp4-ep2-zero2-recompute": moe_config(dp=4, ep=2, zero=2, microbatches=1, recompute="full"),
    "dp2-ep2-pp2-zero3": moe_config(dp=2, pp=2, ep=2, zero=3, microbatches=4),
    "dp2-ep2-tp2-sp-zero3": moe_config(dp=2, tp=2, sp=True, ep=2, zero=3, microbatches=1),
    # a capacity: the dropped rows do not travel, and every layout drops what one process drops
    "dp2-ep2-capacity": moe_config(ep=2, moe_capacity=0.5),
    "tp2-ep2-capacity": moe_config(dp=1, tp=2, ep=2, microbatches=1, moe_capacity=0.5),
}


def tokens_sent_to_the_neighbouring_ranks_experts():
    """Each block of rows goes to the next ep rank, whose experts run it."""
    real = ep_module.dispatch_and_run

    def shifted(compute, rows, counts, comm):
        return real(compute, rows, counts.roll(counts.numel() // comm.mesh.size("ep")), comm)
    return [mock.patch.object(ep_module, "dispatch_and_run", shifted)]


def expert_gradients_reduced_over_all_of_dp():
    """The experts' gradients summed over the whole dp group, not their chunk's replicas
    (their synchroniser built over dp instead of edp)."""
    real = DataParallel.__init__

    def init(self, model, comm, **options):
        real(self, model, comm, **{**options, "axis": "dp" if options.get("axis") == "edp" else options["axis"]})
    return [mock.patch.object(DataParallel, "__init__", init)]


def every_tp_rank_dispatches_every_token():
    """tp without SP: each tp rank sends all its (replicated) tokens, so each is computed tp times."""
    real = ep_module.apply_expert_parallel
    return [mock.patch("meshtrain.parallel.compose.apply_expert_parallel",
                       lambda model, comm, split_tp, **options: real(model, comm, split_tp=False, **options))]


def a_rank_receiving_no_tokens_skips_its_exchange():
    real = ep_module.dispatch_and_run

    def skipping(compute, rows, counts, comm):
        receive = comm.all_to_all(counts.view(comm.mesh.size("ep"), -1).contiguous(), "ep")
        if receive.sum() == 0:
            return torch.zeros_like(rows)
        return real(compute, rows, counts, comm)
    return [mock.patch.object(ep_module, "dispatch_and_run", skipping)]


def capacity_counted_per_forward():
    """Each expert's capacity counted over a forward's rows, not per sequence: which choices
    are dropped then depends on the micro-batch."""
    from meshtrain.models import moe
    real = moe.capacity_keep
    return [mock.patch.object(moe, "capacity_keep", lambda chosen, weights, rows, factor, n: real(
        chosen, weights, 1, factor * rows, n))]


MUTANTS = {f.__name__: (f, layout) for f, layout in (
    (capacity_counted_per_forward, "dp2-ep2-capacity"),
    (tokens_sent_to_the_neighbouring_ranks_experts, "dp2-ep2"),
    (expert_gradients_reduced_over_all_of_dp, "dp2-ep2"),
    (every_tp_rank_dispatches_every_token, "tp2-ep2"))}
SKIPPING = {"a_rank_receiving_no_tokens_skips_its_exchange": (a_rank_receiving_no_tokens_skips_its_exchange,
                                                               "ep2-no-tokens-on-rank-1")}


def _records(mesh, layouts, mutants):
    _add_sixteen_preset()  # in the ranks too
    return records_of_every_mutant(mesh, layouts, LAYOUTS, mutants)


@pytest.fixture(scope="module")
def verdicts():

    def ranks(world, layouts, **axes):
        return run_ranks(_records, world, layouts, MUTANTS, **axes)[0]
    records = ranks(2, ["dp2-ep2", "dp2-ep2-recompute", "dp2-ep2-bf16", "dp2-ep2-bias", "dp2-ep2-compile",
                        "ep2-no-tokens-on-rank-1", "dp2-ep2-zero1",
                        "dp2-ep2-zero3", "dp2-ep2-zero3-bf16", "dp2-ep2-capacity"], ep=2)
    records.update(ranks(2, ["tp2-ep2", "tp2-sp-ep2", "tp2-ep2-capacity"], tp=2, ep=2))
    records.update(ranks(2, ["cp2-ep2"], cp=2, ep=2))
    records.update(ranks(4, ["dp4-ep2", "dp2-ep2-recompute-4", "dp4-ep2-zero3", "dp4-ep2-zero2-recompute"], ep=2))
    records.update(ranks(4, ["dp2-ep2-tp2-sp", "dp2-ep2-tp2-sp-zero3"], tp=2, ep=2))
    records.update(ranks(4, ["dp2-tp2-ep4"], tp=2, ep=4))
    records.update(ranks(4, ["dp2-ep2-pp2", "dp2-ep2-pp2-zb", "dp2-ep2-pp2-zero3"], pp=2, ep=2))
    records.update(ranks(4, ["dp2-ep2-cp2"], cp=2, ep=2))
    return verdicts_of(records, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_with_the_experts_split(verdicts, layout):
    assert_real_passes(verdicts, layout)


@pytest.mark.parametrize("name", MUTANTS)
def test_verify_fails_on_the_mutant(verdicts, name):
    assert_mutant_fails(verdicts, name)


def _no_tokens_for_rank_1(mesh):
    """Both ranks send every token to experts 0-1 (ep rank 0's): rank 1 receives nothing.
    Each rank's output and gradients against one process running both ranks' tokens."""
    from meshtrain.models.moe import Experts
    from meshtrain.models.specs import MoESpec

    spec = MoESpec(n_layers=1, n_heads=2, n_kv_heads=2, d_model=16, ffn_dim=32, n_experts=4, top_k=2,
                   expert_ffn_dim=16, max_seq_len=16)
    torch.manual_seed(0)
    full = Experts(spec)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.2)
    xs = [torch.randn(6, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    chosen = torch.tensor([[0, 1], [1, 0]] * 3)
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(9))
    x_all = torch.cat(xs).requires_grad_()
    want = full.combine(x_all, torch.cat([chosen, chosen]), torch.cat([weights, weights]))
    want.square().sum().backward()
    holder = torch.nn.Module()
    holder.experts = Experts(spec)
    holder.experts.load_state_dict(full.state_dict())
    ep_module.apply_expert_parallel(holder, Comm(mesh), split_tp=False)
    me = mesh.coord("ep")
    x = xs[me].clone().requires_grad_()
    got = holder.experts.combine(x, chosen, weights)
    got.square().sum().backward()
    rows = slice(6 * me, 6 * (me + 1))
    assert torch.allclose(got, want[rows], atol=1e-6)
    assert torch.allclose(x.grad, x_all.grad[rows], atol=1e-6)
    for name in ep_module.EXPERT_PARAMS:
        mine, whole = getattr(holder.experts, name), getattr(full, name)
        assert torch.allclose(mine.grad, whole.grad[2 * me:2 * (me + 1)], atol=1e-5), name
    return mine.grad.abs().sum().item()


def test_a_rank_receiving_no_tokens_exchanges_and_computes_nothing():
    grads = run_ranks(_no_tokens_for_rank_1, 2, ep=2)
    assert grads[0] > 0 and grads[1] == 0  # rank 1's experts got no row, and a zero gradient


def _both_ways(mesh):
    """The dispatch overlapped with the rank's own experts' work against the serial one, on
    the same learned-like routing: outputs and gradients."""
    from functools import partial

    from meshtrain.models.moe import Experts
    from meshtrain.models.specs import MoESpec

    spec = MoESpec(n_layers=1, n_heads=2, n_kv_heads=2, d_model=16, ffn_dim=32, n_experts=4, top_k=2,
                   expert_ffn_dim=16, max_seq_len=16)
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.experts = Experts(spec)
    for p in holder.experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ep_module.apply_expert_parallel(holder, Comm(mesh), split_tp=False)
    experts, me = holder.experts, mesh.coord("ep")
    chosen = torch.rand(10, 4, generator=torch.Generator().manual_seed(me)).topk(2, -1).indices
    weights = torch.rand(10, 2, generator=torch.Generator().manual_seed(5 + me))
    results = []
    for overlap in (False, True):
        experts.zero_grad()
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(me)).requires_grad_()
        order, token, counts = experts.sort_rows(chosen)
        run = partial(ep_module.dispatch_and_run, overlap=overlap)
        y = experts.weigh(x, run(experts.compute, x[token], counts, Comm(mesh)), token, order, weights)
        y.square().sum().backward()
        results.append([y.detach(), x.grad] + [q.grad.clone() for q in experts.parameters()])
    for serial, overlapped in zip(*results):
        assert torch.allclose(serial, overlapped, atol=1e-6)
    return True


def test_the_overlapped_dispatch_computes_what_the_serial_one_does():
    assert run_ranks(_both_ways, 2, ep=2) == [True, True]


def _skipping(mesh):
    with a_rank_receiving_no_tokens_skips_its_exchange()[0]:
        return _no_tokens_for_rank_1(mesh)


def test_verify_fails_when_a_rank_receiving_no_tokens_skips_its_exchange():
    """In the layout where ep rank 1 receives nothing, that rank skipping the exchange leaves
    its peer's collectives to pair with the wrong ones: NCCL would hang; on gloo the run
    fails or its numbers do — verify must not pass it."""
    layout = "ep2-no-tokens-on-rank-1"
    try:
        records = run_ranks(_records, 2, [layout], SKIPPING, ep=2, timeout=120, collective_timeout=20)[0]
    except AssertionError as e:  # a rank failed (or hung): not a pass either
        assert "exit codes" in str(e) or "hung" in str(e)
        return
    verdicts = verdicts_of(records, LAYOUTS)
    assert_real_passes(verdicts, layout)
    assert_mutant_fails(verdicts, next(iter(SKIPPING)))


def test_a_rank_receiving_no_tokens_that_skips_its_exchange_fails():
    """Its peer's rows never come back (NCCL would hang; on gloo the collectives pair wrongly
    or time out): the run must not succeed."""
    with pytest.raises(AssertionError, match="exit codes|hung"):
        run_ranks(_skipping, 2, ep=2, timeout=90, collective_timeout=15)


# ---- resumed across ep ------------------------------------------------------------------------

def _resume_config(resume_layout: str, **layout):
    c = moe_config(**layout)
    c.train.steps, c.train.resume_at, c.train.resume_layout = 4, 2, resume_layout
    validate(c)
    return c


def _resumed_record(mesh, cfg, second):
    return verify.record_resumed(cfg, second, Comm(mesh), "layout")


@pytest.mark.parametrize("first,resumed", [("ep=2", "dp=2"), ("ep=2", "tp=2 microbatches=1"), ("", "dp=2 ep=2"),
                                           ("ep=2 zero=3", "tp=2 microbatches=1"), ("zero=1", "dp=2 ep=2 zero=3")])
def test_a_checkpoint_resumes_across_ep_within_verify_s_tolerances(first, resumed):
    """Saved with the experts split over ep (each rank's chunk, by the one-process names; under
    ZeRO each chunk's flat shards) and resumed with them whole on every rank, or the other
    way round: weights and Adam's moments come back bit for bit."""
    cfg = _resume_config(resumed, **parse_layout(first) if first else {})
    second = resumed_config(cfg)
    rec = run_ranks(_resumed_record, 2, cfg, second, ep=cfg.layout.ep)[0]
    result = verdict(cfg, rec)
    assert result["passed"], result["failures"]
    assert result["max_resume_rel_diff"] == 0.0


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,says", [
    (dict(dp=2, ep=3), "--ep 3 does not divide dp·cp·tp = 2·1·1 = 2"),
    (dict(dp=3, ep=3), "--ep 3 does not divide the 4 experts of moe-test"),
    (dict(dp=2, ep=0), "--ep 0: must be a positive integer"),
    (dict(dp=2, ep=2, ep_max_load=0.5), "--ep-max-load 0.5: some rank always receives at least the balanced share"),
    (dict(dp=2, ep=1, ep_max_load=2.0), "--ep-max-load 2: it bounds the rows expert parallelism moves"),
    (dict(dp=1, cp=2, ep=2, microbatches=1, moe_capacity=1.0), "counts its experts' capacity per sequence"),
    (dict(dp=2, moe_capacity=0.0), "capacity 0: a capacity factor must be above 0"),
])
def test_bad_ep_is_refused_in_one_line_before_any_rank_starts(layout, says):
    c = moe_config(**layout)
    with pytest.raises(C.ConfigError, match=says.replace("(", r"\(")):
        validate(c)


def test_ep_on_a_dense_model_is_refused_in_one_line():
    c = moe_config(ep=2)
    c.model.name, c.model.moe_aux_coef = "llama-test", None
    with pytest.raises(C.ConfigError, match="llama-test has none"):
        validate(c)


def test_a_capacity_on_a_dense_model_is_refused_in_one_line():
    c = moe_config()
    c.model.name, c.model.moe_aux_coef, c.model.moe_capacity = "llama-test", None, 1.25
    with pytest.raises(C.ConfigError, match="--moe-capacity applies to the mixture-of-experts presets"):
        validate(c)


def _collapsed(mesh, bound):
    """Every token routed to experts 0 and 1 (ep rank 0's) in dp 2·ep 2 under `bound`: what
    each rank raised (None: it trained)."""
    from meshtrain.models import moe
    from meshtrain.recipes.build import build_model

    def first_two(self, ranked):
        return torch.tensor([0, 1]).expand(ranked.shape[0], 2).contiguous()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    with mock.patch.object(moe.TopKRouter, "choose", first_two):
        job = meshtrain.parallelize(build_model("moe-test", 0, vocab_size=256), mesh, ep_max_load=bound,
                                    optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
        try:
            job.step(ids[:, :-1], ids[:, 1:])
        except ep_module.LoadOverBound as e:
            return str(e)
    return None


def test_a_collapsed_routing_stops_every_rank_alike_before_the_rows_move():
    """Rank 0 would receive both ranks' 2·16·2 rows, rank 1 none: twice the balanced share."""
    said = run_ranks(_collapsed, 2, 1.5, ep=2)
    assert said[0] == said[1] == ("layers.1.mlp.experts: its ep ranks would receive [128, 0] rows, above the "
                                  "bound of 1.5 × the balanced 64 (--ep-max-load); raise the bound, set "
                                  "--moe-capacity, or balance the routing harder")
    assert run_ranks(_collapsed, 2, 2.0, ep=2) == [None, None]  # twice the share is within a bound of 2


def test_the_command_line_stops_on_its_bound_in_one_line(tmp_path):
    """`train --ep-max-load 1`: the first layer whose learned routing is not exactly even
    stops the run, rank 0 saying so in one line, exit 2."""
    from helpers import run_cli
    r = run_cli("train", "--model", "moe-test", "--data", "benchmarks/data/hamlet.txt", "--dp", "2", "--ep", "2",
                "--ep-max-load", "1", "--steps", "2", "--batch-size", "4", "--seq-len", "32", "--out", tmp_path)
    said = [line for line in r.stderr.splitlines() if "meshtrain: error:" in line]  # after the bar's last draw
    assert r.returncode == 2 and len(said) == 1, r.stderr[-2000:]
    assert "mlp.experts: its ep ranks would receive [" in said[0] and "(--ep-max-load)" in said[0], said


def test_an_unset_dp_fills_what_ep_needs_from_a_shell():
    c = moe_config(ep=4)
    c.layout.dp = None
    validate(c)
    assert c.layout.dp == 4 and c.layout.world_size == 4


def test_init_refuses_an_ep_that_does_not_divide_the_world_in_one_line():
    import meshtrain
    with pytest.raises(ValueError, match="ep=2 does not divide dp·cp·tp = 1"):
        meshtrain.init(ep=2, device="cpu")
