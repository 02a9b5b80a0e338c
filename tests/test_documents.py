"""Documents: each file (or .jsonl line) is a document with the tokenizer's BOS before it
and EOS after it in the cached stream; `--pad-documents` gives rows that start at document
starts, padded, whose padding targets are IGNORE_INDEX and left out of the loss's mean in
every layout (checked by verify, with a mutant that counts the padding)."""

import json
from contextlib import ExitStack
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from helpers import small_config, verdict

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.data.corpus import DataError
from meshtrain.data.datasets import DOCUMENTS_FILE, META_FILE, TOKENS_FILE, TextData, prepare_text
from meshtrain.data.tokenizer import EOS_TEXT, load_tokenizer
from meshtrain.loss import IGNORE_INDEX, cross_entropy_sum

DOCS = ["To be, or not to be, that is the question:\n" * 4, "Now is the winter of our discontent\n",
        "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n" * 2]


def _folder(tmp_path, docs=DOCS):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"{i:03}.txt").write_text(doc)
    return folder


def _cache(folder):
    meta = json.loads((folder / META_FILE).read_text())
    return (meta, np.fromfile(folder / TOKENS_FILE, dtype=meta["dtype"]).astype(np.int64),
            np.fromfile(folder / DOCUMENTS_FILE, dtype=np.int64))


def test_own_bpe_puts_endoftext_after_each_document(tmp_path):
    cache = prepare_text(str(_folder(tmp_path)), 300, log=lambda msg: None)
    meta, tokens, bounds = _cache(cache)
    tok = load_tokenizer(cache, meta["vocab_size"])
    eos = tok.token_to_id(EOS_TEXT)
    assert tok.vocab_size <= 300 and meta["eos_id"] == eos and meta["bos_id"] is None and meta["documents"] == 3
    want = np.concatenate([np.append(tok.encode(d), eos) for d in DOCS])
    assert np.array_equal(tokens, want)
    assert np.flatnonzero(tokens == eos).tolist() == (bounds[1:] - 1).tolist() and bounds[0] == 0


def _imported(tmp_path, tokenizer_config: dict | None, config: dict, template: str | None = None):
    """A Hugging Face-style folder: a BPE built with `tokenizers`, with special tokens, a
    post-processor adding `template`'s around a sequence, and the JSON files that name the EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                      special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if template:
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 1), ("</s>", 2)])
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    if tokenizer_config is not None:
        (hf / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (hf / "config.json").write_text(json.dumps(config))
    return hf / "tokenizer.json"


@pytest.mark.parametrize("tokenizer_config, config, template, bos, eos, pad", [
    # Llama's: the post-processor puts BOS first, the EOS separates (tokens named as strings and
    # as added-token objects; tokenizer_config.json's add_*_token keys are not what decides)
    ({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "add_bos_token": True,
      "add_eos_token": False}, {"bos_token_id": 5, "eos_token_id": 6}, "<s> $A", 1, 2, 2),
    # a post-processor that ends each sequence with the EOS already: no second one; the pad token pads
    ({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, {}, "<s> $A </s>", 1, 2, 3),
    # no post-processor, no tokenizer_config.json: config.json's EOS (Llama 3's list of EOS ids: the first)
    (None, {"bos_token_id": 1, "eos_token_id": [2, 3]}, None, None, 2, 2),
], ids=["llama-bos-template", "template-with-eos", "config-ids"])
def test_an_imported_tokenizer_s_bos_and_eos_go_around_each_document(tmp_path, tokenizer_config, config, template,
                                                                      bos, eos, pad):
    path = _imported(tmp_path, tokenizer_config, config, template)
    cache = prepare_text(str(_folder(tmp_path)), 320, log=lambda msg: None, tokenizer=path)
    meta, tokens, bounds = _cache(cache)
    assert (meta["bos_id"], meta["eos_id"], meta["pad_id"], meta["documents"]) == (bos, eos, pad, 3)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    want = np.concatenate([np.array(tok.encode(d).ids + ([] if template and template.endswith("</s>") else [eos]))
                           for d in DOCS])  # `tokenizers`' own, whole document, then the separator
    assert np.array_equal(tokens, want)
    assert np.flatnonzero(tokens == eos).tolist() == (bounds[1:] - 1).tolist()
    if bos is not None:
        assert np.flatnonzero(tokens == bos).tolist() == bounds[:-1].tolist()


def test_a_jsonl_line_without_text_is_refused_naming_file_and_line(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    meta, tokens, bounds = _cache(prepare_text(str(good), 256, log=lambda msg: None))
    assert meta["documents"] == 2 and bytes(tokens.astype(np.uint8)) == b"one\n\ntwo"  # bytes: a blank line between
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"body": "two"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2 has no \"text\"") as e:
        prepare_text(str(bad), 256)
    assert "\n" not in str(e.value)


def test_padded_rows_start_at_document_starts_and_padding_targets_are_ignored(tmp_path):
    rng = np.random.default_rng(0)
    docs = [" ".join(f"w{i}" for i in range(40))] + [" ".join(["word"] * int(n)) + "." for n in rng.integers(1, 6, size=60)]
    cache = prepare_text(str(_folder(tmp_path, docs)), 300, log=lambda msg: None)
    meta, tokens, bounds = _cache(cache)
    seq = 16
    data = TextData(cache, seq, seed=0, pad_documents=True)
    starts, ends = data.doc_rows[0]
    # every row starts at a document's start or seq_len further on in a long one, and every
    # training target of every document is in exactly one row
    doc_of = np.searchsorted(bounds, starts, side="right") - 1
    assert np.all((starts - bounds[doc_of]) % seq == 0) and np.all(ends == np.minimum(bounds[doc_of + 1], data.split))
    covered = np.zeros(len(tokens), dtype=int)
    for s, e in zip(starts, ends):
        covered[s + 1:min(e, s + seq + 1)] += 1
    inside = np.ones(data.split, dtype=bool)
    inside[np.clip(bounds, 0, data.split - 1)] = False  # a document's first token is no target
    assert np.all(covered[:data.split][inside] == 1)
    assert (bounds[1] - 1) // seq + (1 if (bounds[1] - 1) % seq else 0) == np.sum(doc_of == 0) > 1  # cut
    x, y = data.batch(3, 8, slice(0, 8))
    picks = np.random.default_rng([0, 3]).integers(0, len(starts), size=8)
    for row, i in enumerate(picks):
        n = int(min(ends[i] - starts[i], seq + 1))
        assert x[row, :n].tolist() == tokens[starts[i]:starts[i] + n].tolist()[:seq]
        assert y[row, :n - 1].tolist() == tokens[starts[i] + 1:starts[i] + n].tolist()
        assert torch.all(y[row, n - 1:] == IGNORE_INDEX) and torch.all(x[row, n:] == meta["pad_id"])
    assert int((y == IGNORE_INDEX).sum()) > 0
    assert torch.equal(data.batch(3, 8, slice(4, 8))[1], y[4:])  # a DP rank's rows are its slice
    vx, vy = data.val_batch(0, 4, slice(0, 4))
    assert vx.shape == (4, seq) and int((vy != IGNORE_INDEX).sum()) > 0


@pytest.mark.parametrize("some_ignored", [True, False])
def test_cross_entropy_sum_skips_ignored_targets_in_value_and_gradient(some_ignored):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 7), generator=g)
    if some_ignored:
        targets[0, 4:] = IGNORE_INDEX
        targets[2, 1] = IGNORE_INDEX
    mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    a = cross_entropy_sum(mine, targets)
    b = F.cross_entropy(theirs.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    a.backward(torch.tensor(0.5, dtype=torch.float64))
    (b * 0.5).backward()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-15)
    assert torch.all(mine.grad[targets == IGNORE_INDEX] == 0)
    assert int((mine.grad.abs().sum(-1) > 0).sum()) == int((targets != IGNORE_INDEX).sum())


def _short_documents(tmp_path):
    """Documents of 2 to 40 bytes: most rows of 32 tokens are padded, unevenly."""
    rng = np.random.default_rng(1)
    words = "now is the winter of our discontent made glorious summer by this sun of york".split()
    return _folder(tmp_path, [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 7, size=400)])


def _config(data, **layout):
    cfg = small_config("gpt-test", steps=2, batch=8, microbatches=2 if layout.get("dp", 1) > 1 else 1, **layout)
    cfg.train.data, cfg.train.pad_documents, cfg.train.warmup = str(data), True, 1
    return cfg


def test_one_process_loss_is_the_mean_over_real_targets(tmp_path):
    from meshtrain.mesh import Mesh
    from meshtrain.train import setup, train_step
    cfg = _config(_short_documents(tmp_path), dp=1)
    data, job = setup(cfg, Comm(Mesh.single(torch.device("cpu"))))
    x, y = data.batch(0, 8, slice(0, 8))
    vx, vy = data.val_batch(0, 8, slice(0, 8))
    with torch.no_grad():
        want = F.cross_entropy(job.module(x).flatten(0, 1), y.reshape(-1), ignore_index=IGNORE_INDEX).item()
        want_val = F.cross_entropy(job.module(vx).flatten(0, 1), vy.reshape(-1), ignore_index=IGNORE_INDEX).item()
    assert abs(job.evaluate(vx, vy) - want_val) < 1e-6 * want_val
    assert abs(train_step(job, data, 0, cfg).loss - want) < 1e-6 * want


def counts_the_padding():
    """The mutant: the loss divided by every target of the global batch, padding included."""
    import meshtrain.train as T
    return [mock.patch.object(T, "loss_terms_per_step", lambda cfg: (lambda targets: targets.numel()))]


def _records(mesh, cfgs: dict, mutants: dict):
    out = {name: verify.record(cfg, Comm(mesh), name) for name, cfg in cfgs.items()}
    for name, (mutant, layout) in mutants.items():
        with ExitStack() as stack:
            for patch in mutant():
                stack.enter_context(patch)
            out[name] = verify.record(cfgs[layout], Comm(mesh), name)
    return out


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    data = _short_documents(tmp_path_factory.mktemp("short"))
    cfgs = {"dp2": _config(data, dp=2), "tp2": _config(data, dp=1, tp=2)}
    prepare_text(str(data), 256, log=lambda msg: None)  # once, before the ranks
    one = TextData(prepare_text(str(data), 256), 32, 0, pad_documents=True)
    _, y = one.batch(0, 8, slice(0, 8))
    real = (y != IGNORE_INDEX).sum(dim=1)
    assert real[:4].sum() != real[4:].sum() and real.sum() < y.numel() // 2  # uneven across dp ranks, mostly padding
    records = run_ranks(_records, 2, {"dp2": cfgs["dp2"]}, {"dp2 counts the padding": (counts_the_padding, "dp2")})[0]
    records.update(run_ranks(_records, 2, {"tp2": cfgs["tp2"]}, {}, tp=2)[0])
    layout_of = {"dp2": "dp2", "tp2": "tp2", "dp2 counts the padding": "dp2"}
    return {name: verdict(cfgs[layout_of[name]], rec) for name, rec in records.items()}


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_verify_passes_with_padded_documents(verdicts, layout):
    assert verdicts[layout]["passed"], verdicts[layout]["failures"]
    assert verdicts[layout]["max_grad_rel_diff"] <= verify.GRAD_TOLERANCE / 10  # a margin, not a scrape


def test_verify_fails_when_the_normalizer_counts_the_padding(verdicts):
    v = verdicts["dp2 counts the padding"]
    assert not v["passed"] and v["first_failure"].startswith("step 1:"), v["first_failure"]
