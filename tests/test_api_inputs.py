"""The Python API's bad input, each refused with one line naming the argument and nothing
half applied; and what `job` offers besides `step`: evaluation (`forward`, pipelines and
tensor parallelism included), `save`/`load` across layouts, `rows="local"`, a batch dict
with the model's own loss under bf16 and recompute, ZeRO-3 on an `nn.Sequential` and by
`wrap=`."""

import tempfile

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks
from test_api import OPTIMIZERS, PIPELINE, PLAN, D, V, batches, make_model

import meshtrain

SGD = OPTIMIZERS["sgd"]


def _refusal(make, *args, **kwargs):
    """The one-line message of what `make(...)` raises (None if it does not)."""
    try:
        make(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _untouched(model) -> bool:
    fresh = make_model()
    return (all(type(a) is type(b) for a, b in zip(model.modules(), fresh.modules()))
            and all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())))


def _bad_inputs(_harness):
    out = {}
    tp = meshtrain.init(tp=2)

    def refused(key, mesh, **kwargs):
        model = kwargs.pop("model", None) or make_model()
        out[key] = (_refusal(meshtrain.parallelize, model, mesh, **kwargs), _untouched(model))

    different = make_model()
    if tp.rank == 1:
        with torch.no_grad():
            different.blocks[1].mlp[0].weight[0, 0] += 1e-3
    out["differing weights"] = (_refusal(meshtrain.parallelize, different, tp, optimizer=SGD, tp_plan=PLAN), True)
    refused("plan names no module", tp, optimizer=SGD, tp_plan=meshtrain.TensorPlan({**PLAN.styles, "blocks.*.atn": meshtrain.ROW}))
    refused("unsplittable", tp, optimizer=SGD, tp_plan=meshtrain.TensorPlan({**PLAN.styles, "embed.tok": meshtrain.COLUMN}))
    refused("fused marked column", tp, optimizer=SGD,
            tp_plan=meshtrain.TensorPlan({**PLAN.styles, "blocks.*.attn.qkv": meshtrain.COLUMN}))
    refused("no tp plan", tp, optimizer=SGD)
    with torch.device("meta"):
        on_meta = make_model()
    out["meta without init"] = (_refusal(meshtrain.parallelize, on_meta, tp, optimizer=SGD, tp_plan=PLAN), True)
    refused("vocab head, opaque loss", tp, optimizer=SGD, loss_fn=lambda o, y: o.sum(),
            tp_plan=meshtrain.TensorPlan({**PLAN.styles, "head": (meshtrain.REGION, meshtrain.COLUMN)},
                                         vocab_parallel_loss=True))
    refused("factory returns no optimizer", tp, optimizer=lambda named: None, tp_plan=PLAN)
    refused("not element-wise under tp", tp, optimizer=lambda named: torch.optim.LBFGS([p for _, p in named]),
            tp_plan=PLAN)
    pp = meshtrain.init(pp=2)
    refused("stages miss a part", pp, optimizer=SGD,
            pipeline=meshtrain.PipelinePlan(("embed",), "blocks", ("norm",), PIPELINE.activation_shape))
    refused("too few blocks", pp, optimizer=SGD, pipeline=PIPELINE, chunks=2)
    dp = meshtrain.init(dp=2)
    refused("not element-wise under zero", dp, zero=2, optimizer=lambda named: torch.optim.LBFGS([p for _, p in named]))
    job = meshtrain.parallelize(make_model(), dp, optimizer=SGD, microbatches=2)
    x, y = batches(1, rows=6)[0]
    out["batch does not split"] = (_refusal(job.step, x, y), True)
    x, y = batches(1)[0]
    out["same share on every rank"] = (_refusal(job.step, x, y, rows="local"), True)
    out["uneven shares"] = (_refusal(job.step, x[:2 + 2 * dp.rank], y[:2 + 2 * dp.rank], rows="local"), True)
    scalar = meshtrain.parallelize(make_model(), dp, optimizer=SGD, loss_fn=lambda o, t: (o - 0).mean(-1))
    out["loss not a scalar"] = (_refusal(scalar.step, x, y), True)
    out["step after a refused step"] = (scalar.parallel is not None and _refusal(job.step, x, y) is None, True)
    return out


EXPECTED = {  # what each refusal must say (the argument it names, and the reason)
    "differing weights": ["model:", "blocks.1.mlp.0.weight", "differs"],
    "plan names no module": ["tp_plan:", "'blocks.*.atn'"],
    "unsplittable": ["tp_plan: embed.tok", "nn.Linear"],
    "fused marked column": ["tp_plan: blocks.0.attn.qkv", "Fused"],
    "no tp plan": ["tp_plan:"],
    "meta without init": ["init:", "meta device"],
    "vocab head, opaque loss": ["loss_fn:", "vocabulary-parallel"],
    "factory returns no optimizer": ["optimizer:", "NoneType"],
    "not element-wise under tp": ["optimizer: LBFGS"],
    "stages miss a part": ["pipeline:", "head.weight"],
    "too few blocks": ["pipeline:", "2 blocks cannot fill 4"],
    "not element-wise under zero": ["optimizer: LBFGS"],
    "batch does not split": ["6 rows", "dp·microbatches"],
    "same share on every rank": ["rows='local'", "same rows"],
    "uneven shares": ["rows='local'", "different sizes"],
    "loss not a scalar": ["loss_fn returned", "not a scalar"],
}


def test_bad_input_is_refused_with_one_line_and_nothing_half_applied():
    got = run_ranks(_bad_inputs, 2, timeout=300)[0]
    for key, words in EXPECTED.items():
        message, untouched = got[key]
        assert message is not None, f"{key}: not refused"
        assert "\n" not in message, (key, message)
        assert all(w in message for w in words), (key, message)
        assert untouched, f"{key}: the model was changed before the refusal"
    assert got["step after a refused step"] == (True, True)  # a refused step leaves the job usable


def _forward_save_load(_harness, folder):
    """Train 2 steps in one layout, save; load into other layouts, evaluate, step once more."""
    data = batches(3)
    results = {}
    dp = meshtrain.init(dp=2)
    job = meshtrain.parallelize(make_model(), dp, optimizer=OPTIMIZERS["adamw"], zero=3)
    for x, y in data[:2]:
        job.step(x, y)
    job.save(folder)
    for name, axes, options in [("tp2", {"tp": 2}, {"tp_plan": PLAN}),
                                ("pp2", {"pp": 2}, {"pipeline": PIPELINE, "microbatches": 2}),
                                ("dp2", {"dp": 2}, {})]:
        mesh = meshtrain.init(**axes)
        other = meshtrain.parallelize(make_model(), mesh, optimizer=OPTIMIZERS["adamw"], **options)
        other.load(folder)
        logits = other.forward(data[2][0])
        loss = other.step(*data[2]).loss
        if mesh.is_main or (name == "pp2" and logits is not None):
            results[name] = (logits, loss)
    return results


def test_forward_and_save_load_across_layouts():
    with tempfile.TemporaryDirectory() as folder:
        got = {}
        for rank_result in run_ranks(_forward_save_load, 2, folder, timeout=300):
            got.update(rank_result)
    model = make_model()
    opt = OPTIMIZERS["adamw"](list(model.named_parameters()))
    data = batches(3)
    for x, y in data[:2]:
        meshtrain.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = model(data[2][0])
    loss = meshtrain.cross_entropy(model(data[2][0]), data[2][1]).item()
    assert set(got) == {"tp2", "pp2", "dp2"}
    for name, (out, step_loss) in got.items():
        assert out is not None and out.shape == (8, 8, V), name
        assert torch.allclose(out, logits, rtol=1e-4, atol=1e-5), (name, (out - logits).abs().max())
        assert abs(step_loss - loss) / loss < 1e-5, (name, step_loss, loss)


class OwnLoss(nn.Module):
    """An HF-style model: keyword inputs, an output that carries its loss."""

    def __init__(self):
        super().__init__()
        self.lm = make_model()

    def forward(self, input_ids, labels):
        logits = self.lm(input_ids)
        return {"logits": logits, "loss": meshtrain.cross_entropy(logits.float(), labels)}


def _dict_bf16(_harness):
    mesh = meshtrain.init(dp=2)
    torch.manual_seed(0)
    job = meshtrain.parallelize(OwnLoss(), mesh, optimizer=SGD, loss_fn=None, precision="bf16", recompute="full")
    rows = mesh.rows(8)
    local = [(job.step({"input_ids": x[rows], "labels": y[rows]}, rows="local").loss) for x, y in batches()]
    torch.manual_seed(0)
    seq = meshtrain.parallelize(nn.Sequential(*[nn.Linear(D, D) for _ in range(3)]), mesh, optimizer=SGD, zero=3,
                                loss_fn=lambda o, t: (o - t).pow(2).mean())
    wrapped = meshtrain.parallelize(make_model(), mesh, optimizer=SGD, zero=3, wrap=["embed", "blocks.0", "blocks.1"])
    return local, seq.step(torch.ones(4, D), torch.zeros(4, D)).loss, wrapped.step(*batches(1)[0]).loss


def test_batch_dict_own_loss_bf16_recompute_and_zero3_units():
    local, seq_loss, wrapped_loss = run_ranks(_dict_bf16, 2, timeout=300)[0]
    model = make_model()
    opt = SGD(list(model.named_parameters()))
    plain = []
    for x, y in batches():
        loss = meshtrain.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    # bf16 follows the fp32 curve (verify's 2 %); the own loss's cross-entropy mean is
    # counted by its non-ignored targets (`loss_terms`), as the plain loop's mean is.
    assert all(abs(a - b) / b < 0.02 for a, b in zip(local, plain)), (local, plain)
    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Linear(D, D) for _ in range(3)])
    assert seq_loss == pytest.approx(seq(torch.ones(4, D)).pow(2).mean().item(), rel=1e-6)
    assert wrapped_loss == pytest.approx(meshtrain.cross_entropy(make_model()(batches(1)[0][0]), batches(1)[0][1]).item(),
                                         rel=1e-6)


def _fill(name, tensor, generator):
    """A user's init for a meta-device model: normals everywhere, ones for the norms' weights."""
    if ".ln" in name or name.startswith("norm."):
        tensor.fill_(1.0 if name.endswith("weight") else 0.0)
    else:
        tensor.normal_(0.0, 0.05, generator=generator)


def _meta_and_vocab_head(_harness):
    out = {}
    for name, axes, options in [("dp2-zero3", {"dp": 2}, {"zero": 3}), ("tp2", {"tp": 2}, {"tp_plan": PLAN})]:
        mesh = meshtrain.init(**axes)
        with torch.device("meta"):
            model = make_model()
        job = meshtrain.parallelize(model, mesh, optimizer=SGD, init=_fill, **options)
        losses = [job.step(x, y).loss for x, y in batches(2)]
        if mesh.is_main:
            out[name] = losses
    vocab = meshtrain.TensorPlan({**PLAN.styles, "embed.tok": meshtrain.VOCAB, "head": (meshtrain.REGION, meshtrain.COLUMN)},
                                 vocab_parallel_loss=True)
    mesh = meshtrain.init(tp=2)
    job = meshtrain.parallelize(make_model(), mesh, optimizer=SGD, tp_plan=vocab)
    x, y = batches(1)[0]
    out["vocab logits"] = job.forward(x)
    out["vocab loss"] = job.step(x, y).loss
    return out


def test_a_meta_device_model_with_a_users_init_and_a_vocabulary_parallel_head():
    got = run_ranks(_meta_and_vocab_head, 2, timeout=300)[0]
    from meshtrain.function_init import FunctionInit  # the reference draws the same values, whole
    model = make_model()
    spec = FunctionInit.of(model, _fill, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(spec.full_value(name))
    opt = SGD(list(model.named_parameters()))
    plain = []
    for x, y in batches(2):
        loss = meshtrain.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    for name in ("dp2-zero3", "tp2"):
        assert got[name] == pytest.approx(plain, rel=1e-5), (name, got[name], plain)
    fresh = make_model()
    x, y = batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(got["vocab logits"], fresh(x), rtol=1e-4, atol=1e-5)  # gathered whole over tp
    assert got["vocab loss"] == pytest.approx(meshtrain.cross_entropy(fresh(x), y).item(), rel=1e-5)
