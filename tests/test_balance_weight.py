"""A mixture of experts' balancing loss weighs the same whatever the main loss (issue 50):
the gradients a job takes equal a plain PyTorch loop's of `mean cross-entropy + mean
balancing loss over the batch's tokens`, for meshtrain's cross-entropy, a F.cross_entropy
wrapper, a hand-written mean cross-entropy and a model dividing its own loss by
`num_items_in_batch`, with no target ignored and with half of them ignored (a prompt
mask), at one process, dp 2·ep 2 and dp 2·ep 2 with ZeRO-3; the balancing loss's value is
reported beside the loss; and the weight's prediction is checked each step."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks

import meshtrain
from meshtrain.recipes.build import build_model

KINDS = ("meshtrain", "wrapper", "hand_written", "num_items")
COEF = 0.5


def _model():
    torch.manual_seed(0)
    return build_model("moe-test", 0, vocab_size=256, moe={"aux_coef": COEF})


def _batch(ignored: bool):
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    if ignored:
        targets[:, :8] = -100  # a prompt mask: half of every row
    return inputs, targets


def _wrapper(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _hand_written(out, y):
    """A mean cross-entropy meshtrain cannot see into (weighted by rows: every row here
    has as many targets, so that is exact)."""
    keep = y != -100
    picked = out.float().log_softmax(-1).gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
    return -(picked * keep).sum() / keep.sum()


class _DividesByNumItems(nn.Module):
    """A model computing its own loss as transformers' do: summed, over num_items_in_batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.model(input_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_items_in_batch
        return SimpleNamespace(loss=loss, logits=logits)


def _plain(inputs, targets):
    """The plain loop: one forward of the whole batch, its mean cross-entropy backward (the
    model adds its balancing loss's mean over this forward's tokens), and that loss's value."""
    model = _model()
    model(inputs)  # the first forward's balancing value is read below; no gradient
    for m in model.modules():
        if hasattr(m, "balance_loss"):
            m.balance_loss.zero_()
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    value = sum(m.balance_loss for m in model.modules() if hasattr(m, "balance_loss"))
    return {n: p.grad for n, p in model.named_parameters()}, float(value)


def _job_grads(mesh, kind, ignored, zero):
    inputs, targets = _batch(ignored)
    model = _model()
    options = {"loss_fn": {"meshtrain": meshtrain.cross_entropy, "wrapper": _wrapper,
                           "hand_written": _hand_written, "num_items": None}[kind]}
    if kind == "num_items":
        model = _DividesByNumItems(model)
    job = meshtrain.parallelize(model, mesh, optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.0),
                                zero=zero, **options)
    if kind == "num_items":
        job.backward({"input_ids": inputs, "labels": targets})
    else:
        job.backward(inputs, targets)
    grads = job.parallel.full_grads()
    out = job.update(torch.zeros(()))
    prefix = "model." if kind == "num_items" else ""
    return {n.removeprefix(prefix): g for n, g in grads.items()}, float(out.balance_loss)


def _every_kind(mesh, zero):
    results = {}
    for ignored in (False, True):
        want, value = _plain(*_batch(ignored))
        for kind in KINDS:
            got, logged = _job_grads(mesh, kind, ignored, zero)
            if mesh.is_main:
                router = "layers.1.mlp.gate.weight"
                off = {n: float((got[n] - g).abs().max() / g.abs().max()) for n, g in want.items()}
                results[(kind, ignored)] = (off[router], max(off.values()), abs(logged - value) / value)
    return results


@pytest.mark.parametrize("world,zero", [(1, 0), (2, 0), (2, 3)], ids=["one-process", "dp2-ep2", "dp2-ep2-zero3"])
def test_the_balancing_loss_weighs_alike_for_every_loss(world, zero):
    results = run_ranks(_every_kind, world, zero, ep=world)[0]
    assert len(results) == 2 * len(KINDS)
    for case, (router, worst, value) in results.items():
        assert router <= 1e-5, (case, router)
        assert worst <= 1e-5, (case, worst)
        assert value <= 1e-5, (case, value)


def test_without_the_weighing_a_loss_counted_by_rows_or_num_items_trains_another_router():
    """The mutant: the balancing loss weighted by 1 before the step's division (as a watched
    loss's was before this issue) gives the hand-written mean 16× (the sequence length) and
    the model dividing by num_items 64× (the batch's tokens) its weight."""
    from unittest import mock
    ones = lambda *args, **kw: torch.ones((), dtype=torch.float64)  # noqa: E731
    for kind in ("hand_written", "num_items"):
        want, _ = _plain(*_batch(False))
        with mock.patch("meshtrain.job.later_divisor", ones), mock.patch("meshtrain.job.step_tokens", ones):
            got, _ = _job_grads(meshtrain.init(device="cpu"), kind, False, 0)
        router = "layers.1.mlp.gate.weight"
        assert (got[router] - want[router]).abs().max() > 1e-3 * want[router].abs().max(), kind


def test_a_cross_entropy_given_other_targets_than_the_batch_is_refused_in_one_line():
    """A wrapper shifting its targets counts other terms than the targets predict: the step
    is refused before its update."""
    inputs, targets = _batch(False)
    job = meshtrain.parallelize(_model(), meshtrain.init(device="cpu"),
                                optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
                                loss_fn=lambda out, y: F.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten()))
    before = {n: p.detach().clone() for n, p in job.module.named_parameters()}
    with pytest.raises(ValueError, match=r"counted 60 terms this step, but its targets hold 64"):
        job.step(inputs, targets)
    assert all(torch.equal(p, before[n]) for n, p in job.module.named_parameters())


def test_the_balancing_loss_is_logged_beside_the_loss(tmp_path):
    """`train` gives each step's balancing loss beside its loss (the cross-entropy alone) in
    metrics.jsonl, TensorBoard and --json: moe-test's three MoE layers at coefficient 1e-3,
    each Σ f·P ≈ 1 near balance."""
    import json

    from helpers import last_json, run_cli
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    r = run_cli("train", "--model", "moe-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "4",
                "--data", "benchmarks/data/hamlet.txt", "--dp", "2", "--ep", "2", "--steps", "2", "--tensorboard",
                "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    j = last_json(r.stdout)
    logged = [json.loads(line)["balance_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == j["balance_losses"] and j["balance_loss"] == logged[-1] and len(logged) == 2
    assert all(3e-3 * 0.5 < v < 3e-3 * 2 for v in logged), logged
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("moe/balance_loss")] == pytest.approx(logged, rel=1e-6)


# ---- padding leaves the counts; transformers' pooled definition ------------------------------

def _padded_batch():
    """4 rows of 16, documents of 17, 12, 7 and 3 tokens padded (--pad-documents' rows):
    their targets past a document's end ignored, the positions after it padding."""
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(5))
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    for row, n in enumerate((17, 12, 7, 3)):
        inputs[row, n:] = 0
        targets[row, n - 1:] = -100
    from meshtrain.train import real_positions
    return inputs, targets, real_positions(targets)


def _spec_model(**moe):
    torch.manual_seed(0)
    return build_model("moe-test", 0, vocab_size=256, moe={"aux_coef": COEF, **moe})


def _masked_plain(mask, **moe):
    """A plain loop's gradients: mean cross-entropy of the real targets, and the model's
    balancing loss over the positions `mask` keeps (its layers told so)."""
    inputs, targets, _ = _padded_batch()
    model = _spec_model(**moe)
    for m in model.modules():
        if hasattr(m, "token_mask"):
            m.token_mask = lambda: mask.reshape(-1)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _transformers_pooled(mask=None):
    """transformers' loop: the mean cross-entropy plus router_aux_loss_coef ×
    `load_balancing_loss_func` of every MoE layer's router logits (and the attention mask),
    on a model without balancing of its own."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    inputs, targets, _ = _padded_batch()
    model = _spec_model(balance="none")
    layers = [m for m in model.modules() if hasattr(m, "token_mask")]
    logits = []
    for layer in layers:
        layer.register_forward_pre_hook(
            lambda m, a: logits.append(F.linear(a[0].reshape(-1, a[0].shape[-1]).float(), m.gate.weight.float())))
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    spec = model.spec
    coef = COEF * len(layers) / spec.top_k  # what export --hf writes as router_aux_loss_coef
    aux = load_balancing_loss_func(tuple(logits), spec.n_experts, spec.top_k, mask)
    (loss + coef * aux).backward()
    return {n: p.grad for n, p in model.named_parameters()}, float(coef * aux.detach())


def _worst(got: dict, want: dict) -> float:
    return max(float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in want.items())


def test_the_pooled_definition_is_transformers_loss():
    """A plain loop of the pooled model (balance="pooled") against transformers' function on
    the same router logits, without and with the attention mask."""
    inputs, targets, mask = _padded_batch()
    for m in (None, mask):
        want, _ = _transformers_pooled(m)
        model = _spec_model(balance="pooled")
        if m is not None:
            for layer in model.modules():
                if hasattr(layer, "token_mask"):
                    layer.token_mask = lambda: mask.reshape(-1)
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        assert _worst({n: p.grad for n, p in model.named_parameters()}, want) <= 1e-5


def _layout_grads(mesh, balance, masked, options):
    from meshtrain.recipes import family_of
    inputs, targets, mask = _padded_batch()
    model = _spec_model(balance=balance)
    family = family_of(model.spec)
    plans = {**({"tp_plan": family.tp_plan(model.spec)} if mesh.size("tp") > 1 else {}),
             **({"pipeline": family.pipeline_plan(model.spec)} if mesh.size("pp") > 1 else {})}
    job = meshtrain.parallelize(model, mesh, **options, **plans,
                                optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.0))
    job.backward(inputs, targets, token_mask=mask if masked else None)
    grads = job.parallel.full_grads()
    out = job.update(torch.zeros(()))
    return grads, float(out.balance_loss)


@pytest.mark.parametrize("world,axes,options", [
    (1, {}, {}), (2, {}, {"microbatches": 2}), (2, {"cp": 2}, {}), (2, {"tp": 2}, {"sp": True}),
    (2, {"pp": 2}, {"microbatches": 2}), (2, {"ep": 2}, {"zero": 3}),
], ids=["one-process", "dp2-micro2", "cp2", "tp2-sp", "pp2", "dp2-ep2-zero3"])
def test_padding_leaves_the_balancing_counts_in_every_layout(world, axes, options):
    """--pad-documents' padding positions (their mask) leave the per-row loss's counts: each
    layout's gradients are a plain loop's over the real tokens."""
    _, _, mask = _padded_batch()
    want = _masked_plain(mask)
    got, _ = run_ranks(_layout_grads, world, "sequence", True, options, **axes)[0]
    assert _worst(got, want) <= 1e-5
    counted = _masked_plain(torch.ones_like(mask))  # the padding counted: another gradient
    assert _worst(counted, want) > 1e-3


@pytest.mark.parametrize("world,axes,options", [
    (1, {}, {}), (2, {"ep": 2}, {}), (2, {"ep": 2}, {"zero": 3}), (2, {"tp": 2}, {"sp": True}), (2, {"cp": 2}, {}),
], ids=["one-process", "dp2-ep2", "dp2-ep2-zero3", "tp2-sp", "cp2"])
def test_the_pooled_definition_in_a_layout_is_transformers_loop(world, axes, options):
    """One forward per step: each layout's gradients and logged balancing loss are
    transformers' loop's on the whole batch, its padding masked."""
    _, _, mask = _padded_batch()
    want, value = _transformers_pooled(mask)
    got, logged = run_ranks(_layout_grads, world, "pooled", True, options, **axes)[0]
    assert _worst(got, want) <= 1e-5
    assert abs(logged - value) <= 1e-5 * value


def test_the_pooled_definition_under_pipeline_parallelism_is_refused_in_one_line():
    with pytest.raises(AssertionError, match="balance='pooled' .* pipeline parallelism splits over stages"):
        run_ranks(_layout_grads, 2, "pooled", False, {"microbatches": 2}, pp=2)
