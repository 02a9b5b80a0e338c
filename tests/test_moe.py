"""The mixture-of-experts family (`models/moe.py`): the experts' two kernels agree, the
balancing loss reaches the router through the backward exactly as if added to the loss,
per-row terms make it independent of how rows are cut, the load is counted once (under
recomputation too) and drives the bias; and `verify` passes in every layout and fails on
each mutant (patched inside the ranks only, so the one-process reference is the real code)."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from mutant_harness import assert_mutant_fails, assert_real_passes, records_of_every_mutant, verdicts_of

from meshtrain.cli.config import Config
from meshtrain.models import moe
from meshtrain.recipes.build import build_model


def _model(seed: int = 0, **moe_options):
    torch.manual_seed(seed)
    return build_model("moe-test", seed, vocab_size=256, moe=moe_options or None)


def _batch(rows: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))


def _grads(model, batch) -> dict[str, torch.Tensor]:
    """The gradients of the batch's mean cross-entropy (and of the balancing loss the model
    adds in its backward)."""
    model.zero_grad()
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- the model, in one process -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_and_the_loop_over_experts_agree_forward_and_backward(dtype):
    a, b = _model(experts="grouped").to(dtype), _model(experts="loop").to(dtype)
    assert all(l.mlp.experts.groupable(dtype) for l in a.layers if hasattr(l.mlp, "experts"))
    batch = _batch()
    ga, gb = _grads(a, batch), _grads(b, batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ga:
        scale = ga[name].float().abs().max().clamp_min(1e-12)
        assert (ga[name].float() - gb[name].float()).abs().max() / scale < tol, name


def test_every_token_reaches_its_k_experts_and_the_balanced_routing_deals_them_evenly():
    model = _model(routing="balanced")
    model.train()
    batch = _batch(rows=4, seq=16)
    model(batch[:, :-1])
    for layer in model.layers[1:]:
        load = layer.mlp.gate.expert_load
        assert load.sum() == 4 * 16 * 2  # dropless: tokens × k
        assert torch.all(load == load[0])  # dealt in turn: the same count each


def _aux_of(model, inputs: dict) -> torch.Tensor:
    """The balancing loss, computed explicitly from each MoE layer's input as a plain loop
    would add it to its mean loss: each layer's coefficient times the mean over rows of
    Σ_i f_i·P_i."""
    total = 0.0
    for name, x in inputs.items():
        layer = model.get_submodule(name)
        b, s, d = x.shape
        scores, chosen, _ = layer.gate(x.reshape(-1, d))
        share = scores / scores.sum(-1, keepdim=True)
        picked = F.one_hot(chosen, layer.gate.n_experts).sum(1).float()
        f = picked.view(b, s, -1).sum(1) * layer.gate.n_experts / (layer.gate.top_k * s)
        p = share.view(b, s, -1).mean(1)
        total = total + layer.aux_coef * (f * p).sum(1).mean()
    return total


def test_the_balancing_loss_reaches_the_router_as_if_added_to_the_loss():
    """Gradients with the loss injected in the backward = gradients of the mean cross-entropy
    + those of the balancing loss computed explicitly and added, as a plain PyTorch loop
    would (its default scale: a mean over this forward's rows)."""
    batch = _batch()
    injected = _grads(_model(aux_coef=0.5), batch)
    plain = _model(aux_coef=0.0)
    inputs: dict = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
             for n, m in plain.named_modules() if isinstance(m, moe.MoE)]
    plain.zero_grad()
    logits = plain(batch[:, :-1])
    for h in hooks:
        h.remove()
    for layer in plain.modules():
        if isinstance(layer, moe.MoE):
            layer.aux_coef = 0.5
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    (loss + _aux_of(plain, inputs)).backward()
    router = "layers.1.mlp.gate.weight"
    assert plain.get_parameter(router).grad is not None
    for name, g in injected.items():
        want = plain.get_parameter(name).grad
        assert (g - want).abs().max() <= 1e-5 * want.abs().max(), name
    # and the loss matters: without it the router's gradient differs
    assert not torch.allclose(_grads(_model(aux_coef=0.0), batch)[router], injected[router], rtol=1e-3)


@pytest.mark.parametrize("balance,rows", [("sequence", 1), ("batch", 2)])
def test_per_row_balancing_does_not_depend_on_how_rows_are_cut(balance, rows):
    """Two micro-batches of 2 rows accumulate the gradients one batch of 4 rows gives (each
    weighted by the whole batch's tokens, as a job weighs them)."""
    batch = _batch(rows=4)

    def sums(model, part):
        model.zero_grad()
        logits = model(part[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), part[:, 1:].flatten(), reduction="sum").backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    whole_model, model = (_model(balance=balance, balance_rows=rows, aux_coef=0.5) for _ in range(2))
    for m in (whole_model, model):
        moe_layers = [l.mlp for l in m.layers if isinstance(l.mlp, moe.MoE)]
        for layer in moe_layers:
            layer.aux_scale = 1.0  # summed, as the cross-entropy here
    whole = sums(whole_model, batch)
    first = sums(model, batch[:2])
    halves = {n: first[n] + g for n, g in sums(model, batch[2:]).items()}
    for name in whole:
        assert (whole[name] - halves[name]).abs().max() <= 1e-5 * whole[name].abs().max(), name


def test_a_job_trains_what_a_plain_loop_of_mean_cross_entropy_and_balancing_loss_trains():
    """meshtrain's job (its loss a sum divided by the step's count of targets) against a plain
    PyTorch loop adding the balancing loss's mean over rows to the mean cross-entropy."""
    import meshtrain
    batch = _batch(rows=4)
    model = _model(aux_coef=0.5)
    job = meshtrain.parallelize(model, meshtrain.init(device="cpu"),
                                optimizer=lambda named: torch.optim.SGD((p for _, p in named), lr=0.0))
    job.backward(batch[:, :-1], batch[:, 1:])
    got = {n: p.grad.clone() for n, p in job.parallel.module.named_parameters()}
    plain = _model(aux_coef=0.0)  # the loop adds the balancing loss itself
    inputs: dict = {}
    for n, m in plain.named_modules():
        if isinstance(m, moe.MoE):
            m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0]))
    logits = plain(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    for m in plain.modules():
        if isinstance(m, moe.MoE):
            m.aux_coef = 0.5
    (loss + _aux_of(plain, inputs)).backward()
    for name, p in plain.named_parameters():
        assert (got[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name


def test_recomputation_counts_the_load_once():
    plain, again = _model(), _model()
    batch = _batch()
    _grads(plain, batch)

    def checkpointed(block, x):
        return torch.utils.checkpoint.checkpoint(block.__class__.forward, block, x, use_reentrant=False)
    for i, block in enumerate(again.layers):
        block.forward = lambda x, b=block: checkpointed(b, x)
    _grads(again, batch)
    for a, b in zip(plain.layers[1:], again.layers[1:]):
        assert torch.equal(a.mlp.gate.expert_load, b.mlp.gate.expert_load)


def test_the_bias_moves_towards_the_mean_load_and_only_selects():
    model = _model(balance="bias", bias_rate=0.01)
    router = model.layers[1].mlp.gate
    assert "layers.1.mlp.gate.expert_bias" in model.state_dict()  # checkpointed with the weights
    assert "layers.1.mlp.gate.expert_load" not in model.state_dict()  # a count restarted each step
    assert all(n.endswith(("weight", "proj")) for n, _ in model.named_parameters())  # no optimizer, no decay
    router.update_bias(torch.tensor([10.0, 0.0, 4.0, 6.0]))  # mean 5
    assert torch.allclose(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, -0.01]))
    assert torch.all(router.expert_load == 0)
    x = torch.randn(6, 32)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))  # expert 3 always chosen
    scores, chosen, weights = router(x)
    assert torch.all((chosen == 3).any(1))
    assert torch.allclose(weights, scores.gather(1, chosen) / scores.gather(1, chosen).sum(1, keepdim=True))


def test_a_bias_the_model_carries_stays_fp32_to_the_bit_under_bf16():
    """`parallelize(precision="bf16")` casts the model, but a router's bias and load are fp32
    state: they keep the values the model had (a cast there and back rounded 1/3 to
    0.3339844, a step of the 1e-3 bias rate)."""
    import meshtrain
    model = _model(balance="bias", bias_rate=0.001)
    carried = torch.tensor([1 / 3, -2 / 7, 1e-4, 0.1], dtype=torch.float32)
    model.layers[1].mlp.gate.expert_bias.copy_(carried)
    job = meshtrain.parallelize(model, meshtrain.init(), optimizer=lambda named: torch.optim.AdamW(
        [p for _, p in named], lr=1e-3), loss_fn=meshtrain.cross_entropy, precision="bf16")
    router = job.module.get_submodule("layers.1.mlp.gate")
    assert router.expert_bias.dtype == router.expert_load.dtype == torch.float32
    assert torch.equal(router.expert_bias, carried)
    assert job.module.get_submodule("layers.1.mlp.gate").weight.dtype == torch.bfloat16


def test_shared_experts_and_sigmoid_scores():
    """DeepSeek's shape: sigmoid scores (the weights renormalised over the chosen), shared
    experts every token passes through, added to the routed ones."""
    import dataclasses
    from meshtrain.models.moe import MoE
    from meshtrain.recipes import PRESETS
    spec = dataclasses.replace(PRESETS["moe-test"], score="sigmoid", shared_ffn_dim=24)
    torch.manual_seed(0)
    layer = MoE(spec)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 32)
    scores, chosen, weights = layer.gate(x.reshape(-1, 32))
    assert torch.allclose(scores, torch.sigmoid(x.reshape(-1, 32) @ layer.gate.weight.T), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(10))
    routed = layer.experts(x.reshape(-1, 32), chosen, weights).view(2, 5, 32)
    assert torch.allclose(layer(x), routed + layer.shared_experts(x), atol=1e-6)
    layer(x).sum().backward()
    assert layer.shared_experts.down_proj.weight.grad.abs().sum() > 0


def test_routing_has_a_margin_rounding_cannot_cross():
    """verify compares layouts whose sums round differently; a token whose k-th and (k+1)-th
    scores were as close as that rounding could change experts and fail a correct layout. On
    the suite's model and batches the smallest gap between the k-th and (k+1)-th score is
    over 50 times the largest difference rounding makes to a score (measured here: the same
    rows routed in one batch and in halves, and the scores' fp32 resolution), and a
    routing bug (the neighbouring-expert mutant below) still fails verify."""
    model = _model()
    routers = [m for m in model.modules() if isinstance(m, moe.TopKRouter)]
    seen: dict = {}

    def record(m, args, out):
        seen.setdefault(id(m), []).append(out[0].detach())
    for m in routers:
        m.register_forward_hook(record)
    gaps, noise = [], 0.0
    for seed in range(4):
        batch = _batch(rows=8, seq=32, seed=seed)[:, :-1]
        seen.clear()
        model(batch)
        whole = {k: v[0] for k, v in seen.items()}
        seen.clear()
        model(batch[:4]), model(batch[4:])
        for m in routers:
            halves = torch.cat(seen[id(m)])
            ulp = torch.finfo(torch.float32).eps * whole[id(m)].max().item()  # the scores' resolution
            noise = max(noise, (halves - whole[id(m)]).abs().max().item(), ulp)
            top = whole[id(m)].topk(m.top_k + 1, dim=-1).values
            gaps.append((top[:, -2] - top[:, -1]).min().item())
    assert min(gaps) > 50 * noise, (min(gaps), noise)


def _kept_by_hand(chosen, weights, rows, factor, n_experts):
    """capacity_keep's rule, one sequence and expert at a time: the ⌈F·s·k/E⌉ highest-weighted
    choices (ties: the earlier token, then slot)."""
    import math
    tokens, k = chosen.shape
    s = tokens // rows
    cap = math.ceil(factor * s * k / n_experts)
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    for r in range(rows):
        for e in range(n_experts):
            mine = [(-weights[t, j].item(), t, j) for t in range(r * s, (r + 1) * s) for j in range(k)
                    if chosen[t, j] == e]
            for _, t, j in sorted(mine)[:cap]:
                keep[t, j] = True
    return keep


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 1.5])
def test_a_capacity_keeps_each_sequences_highest_weighted_choices(factor):
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(3 * 12, 8, generator=g)
    scores[5, :] = scores[6, :]  # a tie between tokens: the earlier one wins
    weights, chosen = scores.topk(2, dim=-1)
    got = moe.capacity_keep(chosen, weights, 3, factor, 8)
    assert torch.equal(got, _kept_by_hand(chosen, weights, 3, factor, 8))
    if factor < 1:
        assert not got.all()  # something was dropped


def test_a_capacity_drops_what_one_process_drops_and_weighs_the_dropped_zero():
    """A model with a capacity: each micro-batch of whole rows drops what the whole batch
    drops, and the dropped choices add nothing to the output."""
    model = _model(capacity=0.5)
    batch = _batch(rows=4)
    whole = _grads(model, batch)
    halves = {n: g / 2 for n, g in _grads(model, batch[:2]).items()}
    for n, g in _grads(model, batch[2:]).items():
        halves[n] = halves[n] + g / 2
    for name in whole:
        assert (whole[name] - halves[name]).abs().max() <= 1e-5 * whole[name].abs().max(), name
    dropless = _grads(_model(), batch)
    assert not torch.allclose(dropless["layers.1.mlp.gate.weight"], whole["layers.1.mlp.gate.weight"], rtol=1e-3)


def test_bad_moe_options_are_refused_in_one_line():
    from meshtrain.recipes.moe import problems
    from meshtrain.recipes import PRESETS
    import dataclasses
    spec = PRESETS["moe-test"]
    assert "top_k 5" in problems(dataclasses.replace(spec, top_k=5))[0]
    assert "unknown router score" in problems(dataclasses.replace(spec, score="tanh"))[0]
    assert "unknown balancing" in problems(dataclasses.replace(spec, balance="loss"))[0]
    assert "must be above 0" in problems(dataclasses.replace(spec, capacity=0.0))[0]


# ---- every layout against one process, and the mutants -------------------------------------

STEPS = 3  # every step sampled by verify (1, 2, 3)


def moe_config(**layout) -> Config:
    c = Config()
    c.model.name = "moe-test"
    c.layout.dp, c.layout.microbatches = 2, 2
    for k, v in layout.items():
        if k.startswith("moe_"):
            setattr(c.model, k, v)
        else:
            setattr(c.layout, k, v)
    c.model.moe_aux_coef = c.model.moe_aux_coef or 0.05  # large enough that a wrong loss shows in the gradients
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size = STEPS, 8, 32, 256
    c.train.warmup, c.train.device = 1, "cpu"
    return c


LAYOUTS = {
    "dp": moe_config(), "dp-batch": moe_config(moe_balance="batch", moe_balance_rows=2),
    "dp-bias": moe_config(moe_balance="bias", moe_bias_rate=0.01), "zero3": moe_config(zero=3),
    "dp-recompute": moe_config(recompute="full"),
    "tp": moe_config(dp=1, tp=2, microbatches=1), "tp-sp": moe_config(dp=1, tp=2, sp=True, microbatches=1),
    "pp": moe_config(dp=1, pp=2, microbatches=4), "pp-zb": moe_config(dp=1, pp=2, microbatches=4, schedule="zb"),
    "cp": moe_config(dp=1, cp=2, microbatches=1),
    # a capacity per sequence: the layout drops what one process drops (recomputed: replayed too)
    "dp-capacity-recompute": moe_config(moe_capacity=0.5, recompute="segments:2"),
    "pp-capacity": moe_config(dp=1, pp=2, microbatches=4, moe_capacity=0.5),
    # transformers' pooled loss, one forward per step (dp) or micro-batches of one process's rows (tp)
    "dp-pooled": moe_config(moe_balance="pooled", microbatches=1),
    "tp-sp-pooled": moe_config(dp=1, tp=2, sp=True, microbatches=2, moe_balance="pooled"),
}


def batch_loss_from_one_ranks_counts():
    """Context parallelism: each rank's balancing loss from its own tokens' counts alone."""
    from meshtrain.parallel import compose
    return [mock.patch.object(compose, "sum_sequences_over", lambda *a, **k: None)]


def combine_without_the_router_weights():
    """The experts' outputs summed unweighted."""
    real = moe.Experts.forward
    return [mock.patch.object(moe.Experts, "forward", lambda self, x, c, w: real(self, x, c, torch.ones_like(w)))]


def tokens_sent_to_the_neighbouring_expert():
    real = moe.Experts.forward
    return [mock.patch.object(moe.Experts, "forward",
                              lambda self, x, c, w: real(self, x, (c + 1) % self.n_experts, w))]


def bias_updated_from_local_counts():
    """Each data-parallel rank moves its bias by its own tokens' load."""
    from meshtrain.parallel.expert_load import ExpertLoad
    return [mock.patch.object(ExpertLoad, "__init__", _local_axes(ExpertLoad.__init__))]


def _local_axes(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.axes = []
    return patched


def expert_gradient_counted_twice_in_the_norm():
    """Tensor parallelism: the replicated experts' gradients counted on every tp rank."""
    from meshtrain import optim
    real = optim.grad_norm

    def norm(params, comm, **options):
        for p in params:
            if p.dim() == 3:  # the stacked experts
                setattr(p, optim.SHARDED_OVER, ("tp",))
        return real(params, comm, **options)
    return [mock.patch.object(optim, "grad_norm", norm), mock.patch("meshtrain.job.grad_norm", norm)]


def pooled_over_each_ranks_tokens():
    """The pooled loss of each rank's own tokens, not the forward's over dp."""
    from meshtrain.parallel import compose
    return [mock.patch.object(compose, "pool_over_ranks", lambda *a, **k: None)]


MUTANTS = {f.__name__: (f, layout) for f, layout in (
    (pooled_over_each_ranks_tokens, "dp-pooled"),
    (batch_loss_from_one_ranks_counts, "cp"), (combine_without_the_router_weights, "dp"),
    (tokens_sent_to_the_neighbouring_expert, "dp"), (bias_updated_from_local_counts, "dp-bias"),
    (expert_gradient_counted_twice_in_the_norm, "tp"))}


@pytest.fixture(scope="module")
def verdicts():
    def ranks(layouts, **axes):
        return run_ranks(records_of_every_mutant, 2, layouts, LAYOUTS, MUTANTS, **axes)[0]
    records = ranks(["dp", "dp-batch", "dp-bias", "zero3", "dp-recompute", "dp-capacity-recompute", "dp-pooled"])
    records.update(ranks(["tp", "tp-sp", "tp-sp-pooled"], tp=2))
    records.update(ranks(["pp", "pp-zb", "pp-capacity"], pp=2))
    records.update(ranks(["cp"], cp=2))
    return verdicts_of(records, LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_passes_in_every_layout(verdicts, layout):
    assert_real_passes(verdicts, layout)


@pytest.mark.parametrize("name", MUTANTS)
def test_verify_fails_on_the_mutant(verdicts, name):
    assert_mutant_fails(verdicts, name)
