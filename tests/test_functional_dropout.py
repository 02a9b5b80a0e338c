"""Functional dropout in a user's model — `F.dropout` in its forward, `dropout_p` of
`F.scaled_dot_product_attention` — draws the one-process masks in every layout
(`parallel/dropout.FunctionalDropout`), recomputation included; where a layout cannot
draw them so (tensor parallelism) it is refused in one line at the first step. Two
mutants must fail verify: the calls left to the global generator, and a recomputation
that counts its calls on from the forward's."""

from contextlib import contextmanager, nullcontext
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from test_api import HD, OPTIMIZERS, PIPELINE, PLAN, Attention, Embed, TinyLM, batches

import meshtrain


class DropAttention(Attention):
    """Attention as transformers writes it: probabilities dropped inside the fused kernel's
    call, the output dropped by a functional call."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * HD, self.n_kv_heads * HD, self.n_kv_heads * HD], dim=-1)
        q = q.view(b, t, self.n_heads, HD).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, HD).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2 if self.training else 0.0,
                                           enable_gqa=True)
        return F.dropout(self.o(y.transpose(1, 2).reshape(b, t, self.n_heads * HD)), 0.1, self.training)


class DropEmbed(Embed):
    def forward(self, ids):
        return F.dropout(super().forward(ids), p=0.1, training=self.training)


class DropLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.embed = DropEmbed()
        for block in self.blocks:
            block.attn = DropAttention()


def make_model():
    torch.manual_seed(0)
    return DropLM()


LAYOUTS = {"dp2 (2 micro-batches)": ({"dp": 2}, {"microbatches": 2}),
           "dp2-zero3, full recompute": ({"dp": 2}, {"zero": 3, "recompute": "full"}),
           "pp2, full recompute": ({"pp": 2}, {"microbatches": 2, "recompute": "full"})}


def global_generator():
    """The functional calls left to torch's global generator: every rank draws its own masks."""
    from meshtrain.parallel.dropout import DropoutKeys
    return mock.patch.object(DropoutKeys, "scope", lambda self: nullcontext())


def recomputed_ordinals_go_on():
    """A recomputation counts its functional calls on from the forward's instead of afresh:
    each call draws the mask of a later one."""
    import meshtrain.parallel.recompute as R

    @contextmanager
    def keys_at(keys, where, again=False):
        now = (keys.step, keys.rows)
        keys.use(*where)
        try:
            with keys.scope() if again else nullcontext():
                yield
        finally:
            keys.use(*now)
    return mock.patch.object(R, "_keys_at", keys_at)


def _verify(_harness, layouts, mutant):
    out = {}
    for name in layouts:
        axes, options = LAYOUTS[name]
        if "pp" in axes:
            options = {**options, "pipeline": PIPELINE}
        with mutant() if mutant else nullcontext():
            report = meshtrain.verify(make_model, batches(3), optimizer=OPTIMIZERS["adamw"], clip_grad_norm=1.0,
                                      **axes, **options)
        out[name] = (report.passed, report.worst, report.failures[:1])
    tp = meshtrain.init(tp=2)
    job = meshtrain.parallelize(make_model(), tp, optimizer=OPTIMIZERS["sgd"], tp_plan=PLAN)
    try:
        job.step(*batches(1)[0])
        out["tp2"] = None
    except ValueError as e:
        out["tp2"] = str(e)
    return out


def test_functional_dropout_draws_the_one_process_masks_and_is_refused_under_tp():
    got = run_ranks(_verify, 2, list(LAYOUTS), None, timeout=600)[0]
    for name in LAYOUTS:
        passed, worst, failures = got[name]
        assert passed, (name, failures)
        assert worst["grad"][0] < 1e-5 and worst["eval"][0] < 1e-5, (name, worst)
    assert got["tp2"] is not None and got["tp2"].startswith("F.dropout under tensor parallelism"), got["tp2"]
    assert "nn.Dropout" in got["tp2"]


@pytest.mark.parametrize("mutant, layout", [(global_generator, "dp2 (2 micro-batches)"),
                                            (recomputed_ordinals_go_on, "dp2-zero3, full recompute")])
def test_verify_fails_unkeyed_functional_dropout(mutant, layout):
    passed, _, failures = run_ranks(_verify, 2, [layout], mutant, timeout=600)[0][layout]
    assert not passed and failures[0].startswith("step 1:") and "gradient" in failures[0], failures
