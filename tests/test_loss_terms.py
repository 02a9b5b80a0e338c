"""Every mean's terms counted, whatever the loss looks like: a user's wrapper around
F.cross_entropy or F.nll_loss, transformers' own `LlamaForCausalLM.loss` on right-padded
labels (with `num_items_in_batch`, as transformers' Trainer passes it) — each trained in a
layout against a plain PyTorch or transformers loop over the same batches. What cannot be
re-weighted is refused in one line at the first step; a mean of another kind over targets
with ignored entries is weighted by rows, and the first step says so."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks
from test_api import OPTIMIZERS, V, make_model

import meshtrain

transformers = pytest.importorskip("transformers")

SGD = OPTIMIZERS["sgd"]
HV, T = 64, 12
HF_PLAN = meshtrain.TensorPlan({  # docs/api.md's plan for transformers' Llama
    "model.layers.*.self_attn": meshtrain.REGION,
    "model.layers.*.self_attn.[qkv]_proj": meshtrain.COLUMN, "model.layers.*.self_attn.o_proj": meshtrain.ROW,
    "model.layers.*.mlp": meshtrain.REGION,
    "model.layers.*.mlp.gate_proj": meshtrain.COLUMN, "model.layers.*.mlp.up_proj": meshtrain.COLUMN,
    "model.layers.*.mlp.down_proj": meshtrain.ROW,
})


def hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=HV, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def padded_batches(n=5, rows=8):
    """Right-padded rows of uneven lengths: labels -100 past each row's end, so ranks and
    micro-batches hold very different numbers of real targets."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, HV, (rows, T), generator=g)
        labels = ids.clone()
        for r, length in enumerate(torch.randint(2, T + 1, (rows,), generator=g).tolist()):
            labels[r, length:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def wrapped_ce(out, y):
    """The wrapper every sequence model needs: a mean meshtrain cannot see from outside."""
    return F.cross_entropy(out.logits.reshape(-1, HV), y.reshape(-1))


def wrapped_nll(out, y):
    return F.nll_loss(F.log_softmax(out.logits, -1).reshape(-1, HV), y.reshape(-1))


def plain_loop(loss_of):
    """transformers and PyTorch alone: the losses and the final weights."""
    model = hf_llama()
    opt = SGD(list(model.named_parameters()))
    losses = []
    for b in padded_batches():
        loss = loss_of(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


LOSSES = {  # name -> (loss_fn, how job.step is called, how a plain loop computes the loss)
    "own .loss": (None, lambda job, b: job.step(b), lambda m, b: m(**b).loss),
    "wrapped F.cross_entropy": (wrapped_ce, lambda job, b: job.step({"input_ids": b["input_ids"]}, b["labels"]),
                                lambda m, b: wrapped_ce(m(input_ids=b["input_ids"]), b["labels"])),
    "wrapped F.nll_loss": (wrapped_nll, lambda job, b: job.step({"input_ids": b["input_ids"]}, b["labels"]),
                           lambda m, b: wrapped_nll(m(input_ids=b["input_ids"]), b["labels"])),
}
LAYOUTS = {"dp2 (2 micro-batches)": ({"dp": 2}, {"microbatches": 2}), "dp2-zero3": ({"dp": 2}, {"zero": 3}),
           "tp2 (REGION on self_attn)": ({"tp": 2}, {"tp_plan": HF_PLAN})}


def _train_transformers_llama(_harness):
    out = {}
    for layout, (axes, options) in LAYOUTS.items():
        mesh = meshtrain.init(**axes)
        for name, (loss_fn, step, _) in LOSSES.items():
            if name == "wrapped F.nll_loss" and layout != "dp2 (2 micro-batches)":
                continue
            job = meshtrain.parallelize(hf_llama(), mesh, optimizer=SGD, loss_fn=loss_fn, **options)
            losses = [step(job, b).loss for b in padded_batches()]
            weights = job.state_dict()["model"]
            if mesh.is_main:
                out[(layout, name)] = (losses, weights, job._loss.resolved)
    return out


def test_transformers_llama_and_wrapped_losses_train_what_a_plain_loop_trains():
    got = run_ranks(_train_transformers_llama, 2, timeout=600)[0]
    initial = {n: p.detach() for n, p in hf_llama().named_parameters()}
    for name, (_, _, plain_loss) in LOSSES.items():
        plain_losses, plain_weights = plain_loop(plain_loss)
        for (layout, loss_name), (losses, weights, resolved) in got.items():
            if loss_name != name:
                continue
            # the own loss divides by num_items_in_batch; a wrapper's mean is counted
            assert resolved == ("normalized" if name == "own .loss" else "counted"), (layout, name, resolved)
            for a, b in zip(losses, plain_losses):
                assert abs(a - b) / abs(b) < 1e-5, (layout, name, losses, plain_losses)
            for n, w in plain_weights.items():
                update, ref = (weights[n] - initial[n]).double(), (w - initial[n]).double()
                assert (update - ref).norm() / ref.norm() < 1e-4, (layout, name, n)


# ---- what cannot be re-weighted, and the mean of another kind ---------------------------------

class WithAuxiliary(nn.Module):
    """A model whose loss adds a term to its cross-entropy mean (as a mixture-of-experts'
    router loss does)."""

    def __init__(self):
        super().__init__()
        self.lm = make_model()

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids)
        return {"loss": meshtrain.cross_entropy(logits, labels) + 0.01 * logits.pow(2).mean()}


class DividesUnshifted(nn.Module):
    """A model taking **kwargs that shifts its labels itself without telling: its summed loss
    divided by num_items_in_batch counts other terms than it has."""

    def __init__(self):
        super().__init__()
        self.lm = make_model()

    def forward(self, input_ids, labels, num_items_in_batch=None, **kwargs):
        logits = self.lm(input_ids)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum")
        return {"loss": loss / num_items_in_batch}


def _batch(rows=8):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (rows, 8), generator=g)
    y = torch.randint(0, V, (rows, 8), generator=g)
    y[torch.rand(rows, 8, generator=g) < 0.4] = -100  # unevenly over rows, ranks and micro-batches
    return x, y


def _refusals(_harness):
    import contextlib
    import io

    mesh = meshtrain.init(dp=2)
    x, y = _batch()
    out = {}

    def first_step(model, loss_fn, *batch):
        job = meshtrain.parallelize(model, mesh, optimizer=SGD, loss_fn=loss_fn)
        try:
            job.step(*batch)
        except ValueError as e:
            return str(e)
        return None

    out["auxiliary"] = first_step(WithAuxiliary(), None, {"input_ids": x, "labels": y})
    out["class weights"] = first_step(make_model(), lambda o, t: F.cross_entropy(
        o.reshape(-1, V), t.reshape(-1), weight=torch.ones(V)), x, y)
    out["two means"] = first_step(make_model(), lambda o, t: (meshtrain.cross_entropy(o, t)
                                                              + meshtrain.cross_entropy(o[:, 1:], t[:, 1:])), x, y)
    out["num_items miscounted"] = first_step(DividesUnshifted(), None, {"input_ids": x, "labels": y})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        onehot = lambda o, t: (o.softmax(-1) - F.one_hot(t.clamp(min=0), V).float()).pow(2).mean()  # noqa: E731
        job = meshtrain.parallelize(make_model(), mesh, optimizer=SGD, loss_fn=onehot)
        job.step(x, y)
        job.step(x, y)
    out["rows warning"] = (err.getvalue() if mesh.is_main else None, job._loss.resolved)
    return out


def test_what_cannot_be_reweighted_is_refused_and_a_rows_mean_is_said_once():
    got = run_ranks(_refusals, 2)[0]
    assert "adds other terms" in got["auxiliary"] and "loss_reduction='sum'" in got["auxiliary"], got["auxiliary"]
    assert "class-weighted" in got["class weights"], got["class weights"]
    assert "adds other terms" in got["two means"], got["two means"]
    assert "num_items_in_batch" in got["num_items miscounted"] and "terms" in got["num_items miscounted"]
    warning, resolved = got["rows warning"]
    assert resolved == "rows"
    assert warning.count("weighted by its rows") == 1 and "-100" in warning, warning


# ---- the mutant: a countable mean weighted by rows ---------------------------------------------

def _verify_wrapped(_harness, mutant):
    from unittest import mock

    from meshtrain.loss_terms import CountedMeans
    patches = [mock.patch.object(CountedMeans, "_loss", lambda self, func, args, kwargs: func(*args, **kwargs))] \
        if mutant else []
    for p in patches:
        p.start()
    data = [(x, y) for x, y in (_batch(),) * 3]
    report = meshtrain.verify(make_model, data, optimizer=SGD, dp=2, microbatches=2,
                              loss_fn=lambda o, t: F.cross_entropy(o.reshape(-1, V), t.reshape(-1)))
    return report.passed, report.failures[:1], report.worst


@pytest.mark.parametrize("mutant", [False, True])
def test_verify_fails_a_countable_mean_weighted_by_rows(mutant):
    passed, failures, worst = run_ranks(_verify_wrapped, 2, mutant)[0]
    if not mutant:
        assert passed, failures
        assert worst["grad"][0] < 1e-6 and worst["eval"][0] < 1e-6, worst
    else:  # the means of each micro-batch weighted by rows: step 1's gradients differ
        assert not passed and failures[0].startswith("step 1:") and "gradient" in failures[0], failures
