"""transformers' `padding_idx` (issue 50, item 5): every causal LM it builds from a folder
(Llama, Mixtral, Qwen3-MoE, OLMoE; not GPT-2) embeds with `nn.Embedding(vocab, d,
padding_idx=config.pad_token_id)`, whose lookup gives the pad row no gradient (AdamW still
decays it; a tied head still trains it). meshtrain's Llama and MoE do the same from their
spec's `pad_token_id`: a fresh model holds a zero pad row built plainly or on meta; the
vocabulary-parallel embedding leaves the row alone on the rank that holds it; verify passes
in tp, tp + sp, ZeRO-1/2/3 (ZeRO-3 tied too), pp and compiled layouts, and fails a
vocabulary-parallel lookup that forgets the row; a fine-tune of a folder whose pad id is its EOS, on rows full of
EOS, gives the step losses of a plain transformers loop (Llama, Mixtral; one process and a
multi-rank layout each); and a user's own model is left as written."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks
from helpers import last_json, run_cli, run_main
from llama3_folder import (documents, hf_llama_folder, llama3_tokenizer, transformers_losses, write_documents,
                           write_tokenizer)

import meshtrain
from meshtrain.cli.config import TrainConfig
from meshtrain.comm import Comm
from meshtrain.models.llama import Llama
from meshtrain.models.moe import MoEModel
from meshtrain.models.specs import LlamaSpec
from meshtrain.parallel.state import gather_full
from meshtrain.parallel.tensor import VocabParallelEmbedding
from meshtrain.recipes import PRESETS
from meshtrain.recipes.build import init_spec
from meshtrain.recipes.llama import TP_PLAN, pipeline_plan

V, PAD, T, ROWS = 64, 37, 16, 8  # the pad row on tp rank 1 of 2
TINY = LlamaSpec(n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, head_dim=8, ffn_dim=32, max_seq_len=32,
                 pad_token_id=PAD)


def batches(n: int = 3) -> list:
    """(ids, targets) of `n` steps, a quarter of the ids the pad id."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (ROWS, T), generator=g)
        out.append((ids.masked_fill(torch.rand(ROWS, T, generator=g) < 0.25, PAD),
                    torch.randint(0, V, (ROWS, T), generator=g)))
    return out


def make_model(tied: bool = False) -> Llama:
    return Llama(dataclasses.replace(TINY, tie_embeddings=tied), V)


def make_tied() -> Llama:
    return make_model(tied=True)


def adamw(named):
    return meshtrain.adamw(1e-2, weight_decay=0.1)(named)


# ---- one process -------------------------------------------------------------------------------

@pytest.mark.parametrize("pad, row", [(PAD, PAD), (-1, V - 1)], ids=["pad", "negative-pad"])
def test_a_fresh_model_holds_a_zero_pad_row_built_plainly_or_on_meta(pad, row):
    """nn.Embedding zeroes it in a plain build; the recipe's rules (a meta build's draws)
    zero it too, as transformers' `_init_weights` does, and draw every other row as without it."""
    spec = dataclasses.replace(TINY, pad_token_id=pad)
    torch.manual_seed(0)
    assert not Llama(spec, V).embed_tokens.weight[row].any()
    with torch.device("meta"):
        padded, plain = Llama(spec, V), Llama(dataclasses.replace(spec, pad_token_id=None), V)
    drawn = init_spec(padded, 0).full_value("embed_tokens.weight")
    without = init_spec(plain, 0).full_value("embed_tokens.weight")
    others = torch.arange(V) != row
    assert not drawn[row].any() and without[row].any() and torch.equal(drawn[others], without[others])
    with torch.device("meta"):
        moe = MoEModel(dataclasses.replace(PRESETS["moe-test"], pad_token_id=pad), V)
    assert not init_spec(moe, 0).full_value("embed_tokens.weight")[row].any()


def _grads(model: Llama, ids: torch.Tensor, targets: torch.Tensor) -> dict:
    meshtrain.cross_entropy(model(ids), targets).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_the_lookup_gives_the_pad_row_no_gradient_and_a_tied_head_trains_it():
    (ids, targets), = batches(1)
    torch.manual_seed(0)
    untied = make_model()
    grads = _grads(untied, ids, targets)
    assert not grads["embed_tokens.weight"][PAD].any()
    assert grads["embed_tokens.weight"][ids[ids != PAD][0]].any() and grads["lm_head.weight"][PAD].any()
    tied = make_tied()
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.embed_tokens.weight)  # the tied model's weights, in two tensors
        tied.load_state_dict(untied.state_dict())
    untied.zero_grad()
    apart, together = _grads(untied, ids, targets), _grads(tied, ids, targets)
    assert torch.equal(together["embed_tokens.weight"][PAD], apart["lm_head.weight"][PAD])  # the head's alone


def test_a_step_only_decays_the_pad_row_as_adamw_does_a_zero_gradient():
    """The row's gradient is zero, not missing: AdamW decays it and its moments stay zero."""
    torch.manual_seed(0)
    model = make_model()
    before = model.embed_tokens.weight[PAD].detach().clone()
    job = meshtrain.parallelize(model, meshtrain.init(), optimizer=adamw, clip_grad_norm=1.0)
    for x, y in batches():
        job.step(x, y)
    after = job.state_dict()["model"]["embed_tokens.weight"][PAD]
    torch.testing.assert_close(after, before * (1 - 1e-2 * 0.1) ** 3, rtol=1e-6, atol=0)


def test_an_own_model_keeps_its_embedding_as_written():
    """A user's model (test_api's, whose embedding has no padding_idx) trains in meshtrain as
    in a plain loop: no pad row is imposed on it."""
    from test_api import OPTIMIZERS, SCHEDULER, plain_loop
    from test_api import batches as own_batches
    from test_api import make_model as own_model
    model = own_model()
    assert model.embed.tok.padding_idx is None
    job = meshtrain.parallelize(model, meshtrain.init(), optimizer=OPTIMIZERS["adamw"],
                                loss_fn=meshtrain.cross_entropy, clip_grad_norm=1.0, lr_scheduler=SCHEDULER)
    losses = [job.step(x, y).loss for x, y in own_batches()]
    want, weights = plain_loop("adamw")
    assert losses == pytest.approx(want, rel=1e-6) and model.embed.tok.padding_idx is None
    torch.testing.assert_close(job.state_dict()["model"]["embed.tok.weight"], weights["embed.tok.weight"])


# ---- the vocabulary-parallel embedding and the layouts ----------------------------------------

def _lookup(embedding: nn.Module, pad: int) -> torch.Tensor:
    """A 16-row table's lookup of ids holding the pad id three times, backward from a
    weighted sum; its output."""
    out = embedding(torch.tensor([[pad % 16, 1, pad % 16, 9], [15, pad % 16, 3, 8]]))
    (out * torch.arange(8.0)).sum().backward()
    return out.detach()


def _vocab_parallel_lookup(mesh, pad):
    comm = Comm(mesh)
    torch.manual_seed(0)
    sharded = VocabParallelEmbedding(nn.Embedding(16, 8, padding_idx=pad), comm, sp=False)
    return _lookup(sharded, pad), gather_full(sharded.weight.grad, sharded.weight.meshtrain_shard, comm)


@pytest.mark.parametrize("pad", [3, 13, -1], ids=["rank0", "rank1", "negative"])
def test_the_vocabulary_parallel_lookup_gives_the_pad_row_no_gradient(pad):
    torch.manual_seed(0)
    full = nn.Embedding(16, 8, padding_idx=pad)
    want = _lookup(full, pad)
    assert not full.weight.grad[pad].any()
    for out, grad in run_ranks(_vocab_parallel_lookup, 2, pad, tp=2):
        assert torch.equal(out, want) and torch.equal(grad, full.weight.grad)


LAYOUTS = {  # name: (mesh axes, parallelize options, the model)
    "tp2": ({"tp": 2}, {"tp_plan": TP_PLAN}, make_model),
    "tp2-sp": ({"tp": 2}, {"tp_plan": TP_PLAN, "sp": True}, make_model),
    "dp2-zero1": ({"dp": 2}, {"zero": 1}, make_model),
    "dp2-zero2": ({"dp": 2}, {"zero": 2}, make_model),
    "dp2-zero3": ({"dp": 2}, {"zero": 3}, make_model),
    "dp2-zero3-tied": ({"dp": 2}, {"zero": 3}, make_tied),
    "pp2": ({"pp": 2}, {"pipeline": pipeline_plan(TINY.d_model), "microbatches": 2}, make_model),
    "dp2-compiled": ({"dp": 2}, {"compile": True, "compile_backend": "aot_eager"}, make_model),
}


def _verify(_mesh, names, forget_the_row=False):
    if forget_the_row:  # a mutant: the rank holding the pad row trains it through the lookup
        from meshtrain.parallel import tensor
        tensor._local_row = lambda row, start, rows: None
    reports = {}
    for name in names:
        axes, options, model = LAYOUTS[name]
        reports[name] = meshtrain.verify(model, batches(), optimizer=adamw, mesh=meshtrain.init(**axes),
                                         clip_grad_norm=1.0, **options)
    return reports


def test_verify_passes_with_a_pad_row_in_every_layout_and_fails_one_that_forgets_it():
    for name, report in run_ranks(_verify, 2, list(LAYOUTS), timeout=600)[0].items():
        assert report.passed, (name, report)
    forgot = run_ranks(_verify, 2, ["tp2"], True, timeout=300)[0]["tp2"]
    assert not forgot.passed and "embed_tokens.weight" in str(forgot.failures), forgot


# ---- fine-tuning a folder whose pad id is its EOS, against transformers -------------------------

STEPS, BATCH, SEQ, LR, WARMUP = 10, 4, 32, 3e-3, 2
EOS = 1  # llama3_folder's <|end_of_text|>


def _mixtral_folder(folder, tok, vocab_size: int = 384, balancing: bool = False):
    """A tiny random MixtralForCausalLM (`balancing`: its balancing loss in `.loss`, weighed
    0.05), its routers' weights spread (N(0, 0.5)) so that no token's experts are decided by
    a near tie."""
    import transformers
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                        bos_token_id=0, eos_token_id=EOS, output_router_logits=balancing,
                                        router_aux_loss_coef=0.05, attn_implementation="eager")
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder, tok)


def _pad_is_eos(folder, to):
    """A copy of `folder` whose config.json names its EOS as the pad id, as fine-tuning folders
    often do after pretraining (so the EOS row is a trained one, not zero)."""
    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "pad_token_id": config["eos_token_id"]}))
    return to


FOLDERS = {"llama": (hf_llama_folder, ("--tp", "2")), "mixtral": (_mixtral_folder, ("--dp", "2", "--ep", "2"))}


@pytest.fixture(scope="module", params=list(FOLDERS))
def padded_folder(tmp_path_factory, request):
    """(the folder whose pad id is EOS, its prepared tokens — one-sentence documents, so each
    32-token row holds EOS a few times —, transformers' losses on it and without the pad id,
    the family's multi-rank layout)."""
    pytest.importorskip("transformers")
    write_folder, layout = FOLDERS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    docs = [s.strip() + "." for d in documents(n=40) for s in d.replace("!", ".").replace("?", ".").split(".")
            if s.strip()]
    tok = llama3_tokenizer(docs)
    write_folder(root / "plain", tok)
    padded = _pad_is_eos(root / "plain", root / "padded")
    r = run_main("prepare", "--data", write_documents(root / "docs", docs), "--init-from", padded,
                 "--out", root / "prep")
    assert r.returncode == 0, r.stderr
    tr = TrainConfig(steps=STEPS, lr=LR, warmup=WARMUP, batch_size=BATCH, seq_len=SEQ)
    return (padded, root / "prep", transformers_losses(padded, root / "prep", tr),
            transformers_losses(root / "plain", root / "prep", tr), layout)


def _rel(got, want) -> float:
    return max(abs(a - b) / b for a, b in zip(got, want))


@pytest.mark.parametrize("ranks", ["one-process", "multi-rank"])
def test_a_fine_tune_with_the_pad_id_of_the_folder_matches_a_transformers_loop(padded_folder, ranks, tmp_path):
    padded, prep, want, without, multi_rank = padded_folder
    layout = multi_rank if ranks == "multi-rank" else ()
    r = run_cli("train", "--init-from", padded, "--data", prep, *layout, "--steps", STEPS, "--batch-size", BATCH,
                "--seq-len", SEQ, "--lr", LR, "--warmup", WARMUP, "--device", "cpu", "--out", tmp_path / "run",
                "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_json(r.stdout)["losses"]
    assert len(got) == STEPS and _rel(got, want) < 1e-5, (got, want)
    assert _rel(without, want) > 1e-4  # the case is one the pad row decides (without it: 1e-3 away)
    assert want[-1] < want[0]  # it trains


def test_a_pad_id_outside_the_vocabulary_is_refused_in_one_line(tmp_path):
    """Through `train --init-from` (before any rank starts) for a Llama folder, and by the
    MoE formats' reader alike; a negative id within the vocabulary is the row torch counts."""
    from meshtrain.hf import HFError, spec_from_config
    llama = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 48, "vocab_size": 384}
    mixtral = {**llama, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    assert spec_from_config({**llama, "pad_token_id": -1})[0].pad_token_id == -1
    (tmp_path / "config.json").write_text(json.dumps({**llama, "pad_token_id": 384}))
    r = run_main("train", "--init-from", tmp_path, "--device", "cpu", "--steps", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--init-from" in r.stderr and "pad_token_id 384 is outside the vocabulary of 384 tokens" in r.stderr
    for config in (llama, mixtral):
        with pytest.raises(HFError, match="pad_token_id -385 is outside the vocabulary of 384 tokens"):
            spec_from_config({**config, "pad_token_id": -385})


def test_a_model_with_a_pad_id_is_written_with_it_and_read_back(tmp_path):
    """`save_hf` writes the spec's pad id into config.json (transformers then builds the same
    padding_idx), also for a model that no folder's configs go with."""
    transformers = pytest.importorskip("transformers")
    from meshtrain.hf import load_hf, save_hf
    torch.manual_seed(0)
    save_hf(make_model(), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == PAD
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert theirs.model.embed_tokens.padding_idx == PAD and load_hf(tmp_path).spec.pad_token_id == PAD


@pytest.fixture(scope="module")
def balanced_mixtral(tmp_path_factory):
    """(a Mixtral folder with pad id = EOS whose `.loss` adds its balancing loss, its prepared
    tokens, transformers' losses on its own `.loss`)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("balanced")
    docs = [s.strip() + "." for d in documents(n=40) for s in d.replace("!", ".").replace("?", ".").split(".")
            if s.strip()]
    tok = llama3_tokenizer(docs)
    _mixtral_folder(root / "plain", tok, balancing=True)
    padded = _pad_is_eos(root / "plain", root / "padded")
    r = run_main("prepare", "--data", write_documents(root / "docs", docs), "--init-from", padded,
                 "--out", root / "prep")
    assert r.returncode == 0, r.stderr
    tr = TrainConfig(steps=STEPS, lr=LR, warmup=WARMUP, batch_size=BATCH, seq_len=SEQ)
    return padded, root / "prep", transformers_losses(padded, root / "prep", tr, own_loss=True)


@pytest.mark.parametrize("layout", [(), ("--dp", "2", "--ep", "2")], ids=["one-process", "dp2-ep2"])
def test_a_fine_tune_under_the_pooled_balancing_loss_is_transformers_loop_on_its_own_loss(balanced_mixtral, layout,
                                                                                        tmp_path):
    """output_router_logits true: `--moe-balance pooled` trains what transformers' `.loss`
    trains (the step's loss + balancing loss against `.loss`, 10 steps); the per-row default
    does not; and where a forward is no plain loop's, one line."""
    padded, prep, want = balanced_mixtral
    common = ("--init-from", padded, "--data", prep, *layout, "--steps", STEPS, "--batch-size", BATCH, "--seq-len",
              SEQ, "--lr", LR, "--warmup", WARMUP, "--device", "cpu", "--json")
    r = run_cli("train", *common, "--moe-balance", "pooled", "--out", tmp_path / "pooled")
    assert r.returncode == 0, r.stderr[-3000:]
    j = last_json(r.stdout)
    got = [a + b for a, b in zip(j["losses"], j["balance_losses"])]
    assert len(got) == STEPS and _rel(got, want) < 1e-5, (got, want)
    if not layout:
        r = run_cli("train", *common, "--out", tmp_path / "per-row")
        j = last_json(r.stdout)
        assert _rel([a + b for a, b in zip(j["losses"], j["balance_losses"])], want) > 1e-4
        r = run_cli("train", *common, "--moe-balance", "pooled", "--dp", "2", "--microbatches", "2",
                    "--out", tmp_path / "refused")
        assert r.returncode == 2 and "use --microbatches 1, or --moe-balance sequence" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
