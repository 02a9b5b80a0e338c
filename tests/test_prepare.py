"""Tokens as the tokenizer makes them, in a folder a user can read: `meshtrain prepare` with a
Llama-3-style tokenizer (built with `tokenizers`, no download) gives each whole document's ids
as `tokenizers` encodes it, then the EOS (docs/data.md), read back here with numpy alone; a
long document cut into pieces where the pre-tokenizer splits anyway keeps those ids; shards
read as one stream; and what cannot be used is refused in one line. The commands run through
the command line's `main` in this process (test_prepare_scale runs `prepare` itself)."""

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import run_main
from llama3_folder import BOS, EOS, documents, llama3_tokenizer, write_documents, write_tokenizer

from meshtrain.data.datasets import TextData, build_folder, prepare_folder
from meshtrain.data.prepared import VERSION, file_sha256, read_meta
from meshtrain.data.tokenizer import BPETokenizer, Specials


def _read(folder):
    """The prepared folder as docs/data.md says to read it: numpy, meta.json, nothing else."""
    meta = json.loads((folder / "meta.json").read_text())
    tokens = [np.fromfile(folder / s["tokens"], dtype=np.dtype(meta["dtype"]).newbyteorder("<")) for s in meta["shards"]]
    bounds = [np.fromfile(folder / s["documents"], dtype="<i8") for s in meta["shards"]]
    return meta, tokens, bounds


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(documents, their folder, a tokenizer-only Hugging Face folder, the `tokenizers` object)."""
    root = tmp_path_factory.mktemp("llama3")
    docs = documents()
    tok = llama3_tokenizer(docs)
    write_tokenizer(root / "hf", tok)
    (root / "hf" / "config.json").write_text(json.dumps({"vocab_size": 384, "bos_token_id": 0, "eos_token_id": 1}))
    return docs, write_documents(root / "docs", docs), root / "hf", tok


def test_prepared_ids_are_tokenizers_own_whole_document_ids_then_the_eos(llama3, tmp_path):
    docs, text, hf, tok = llama3
    r = run_main("prepare", "--data", text, "--init-from", hf, "--out", tmp_path / "prep")
    assert r.returncode == 0, r.stderr
    meta, (tokens,), (bounds,) = _read(tmp_path / "prep")
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    want = [tok.encode(d, add_special_tokens=True).ids + [eos] for d in docs]  # BOS from the post-processor
    assert all(w[0] == bos for w in want)
    assert tokens.tolist() == [i for w in want for i in w]
    assert bounds.tolist() == np.cumsum([0] + [len(w) for w in want]).tolist()
    assert (meta["format"], meta["version"], meta["dtype"], meta["vocab_size"]) == ("meshtrain-tokens", VERSION,
                                                                                   "uint16", 384)
    assert (meta["bos_id"], meta["eos_id"], meta["documents"], meta["n_tokens"]) == (bos, eos, len(docs), len(tokens))
    assert meta["tokenizer"]["sha256"] == file_sha256(hf / "tokenizer.json") == file_sha256(tmp_path / "prep" /
                                                                                           "tokenizer.json")
    assert (tmp_path / "prep" / "tokenizer_config.json").read_bytes() == (hf / "tokenizer_config.json").read_bytes()
    # What line-by-line tokenization (meshtrain before) gave: other, more ids for the same text
    by_line = sum(len(tok.encode(line, add_special_tokens=False).ids) for d in docs for line in d.splitlines(True))
    assert by_line > sum(len(w) - 2 for w in want)
    assert tok.decode(tokens[bounds[1]:bounds[2]].tolist()) == docs[1]


@pytest.mark.parametrize("kind", ["llama3", "metaspace-first", "gpt2-prefix-space", "no-pre-tokenizer"])
def test_a_long_document_cut_into_pieces_keeps_the_whole_document_s_ids(llama3, kind):
    """Pieces of about 120 characters, cut only where the pre-tokenizer starts a piece and the
    text around it tokenizes alike: the ids are the whole document's, for pre-tokenizers where
    such places are plenty (Llama 3's), rarer (a prefix space or ▁ added to each piece's start)
    or absent (no pre-tokenizer: the document stays whole)."""
    from tokenizers import pre_tokenizers
    docs, _, _, tok = llama3
    tok = llama3_tokenizer(docs)
    if kind == "metaspace-first":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    elif kind == "gpt2-prefix-space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif kind == "no-pre-tokenizer":
        tok.pre_tokenizer = None
    bpe = BPETokenizer(tok)
    bpe.piece_chars = 120
    long_doc = "".join(docs)
    pieces = bpe.pieces(long_doc)
    assert "".join(pieces) == long_doc
    if kind == "no-pre-tokenizer":
        assert pieces == [long_doc]
    else:
        assert len(pieces) > len(long_doc) // 240 and max(map(len, pieces)) <= 120
    ids, bounds = bpe.encode_documents([long_doc, docs[0]], Specials(eos=1))
    want = [tok.encode(d).ids + [1] for d in (long_doc, docs[0])]
    assert ids.tolist() == want[0] + want[1] and bounds.tolist() == [0, len(want[0]), len(want[0]) + len(want[1])]


def test_shards_read_as_one_stream(llama3, tmp_path):
    """Shards of about 100 tokens (each ending at a document's end) give the single shard's
    stream, document boundaries and batches."""
    docs, text, hf, _ = llama3
    one = prepare_folder(str(text), tmp_path / "one", 384, hf / "tokenizer.json", log=lambda m: None)
    many = prepare_folder(str(text), tmp_path / "many", 384, hf / "tokenizer.json", log=lambda m: None,
                          shard_tokens=100)
    assert len(one["shards"]) == 1 and len(many["shards"]) > 5 and many["n_tokens"] == one["n_tokens"]
    _, (tokens,), (bounds,) = _read(tmp_path / "one")
    _, shards, shard_bounds = _read(tmp_path / "many")
    assert np.array_equal(np.concatenate(shards), tokens)
    assert all(len(s) >= 100 for s in shards[:-1]) and all(b[0] == 0 and b[-1] == len(s)
                                                            for s, b in zip(shards, shard_bounds))
    offsets = np.cumsum([0] + [len(s) for s in shards])
    joined = np.concatenate([b[:-1] + o for b, o in zip(shard_bounds, offsets)] + [[len(tokens)]])
    assert np.array_equal(joined, bounds)
    for pad in (False, True):
        a, b = TextData(tmp_path / "one", 32, 0, pad_documents=pad), TextData(tmp_path / "many", 32, 0, pad_documents=pad)
        for step in range(4):
            for x, y in zip(a.batch(step, 8, slice(0, 8)), b.batch(step, 8, slice(0, 8))):
                assert torch.equal(x, y)


def test_train_s_text_cache_is_a_prepared_folder_of_the_same_ids(llama3, tmp_path):
    from meshtrain.data.datasets import prepare_text
    docs, text, hf, _ = llama3
    cache = prepare_text(str(text), 384, log=lambda m: None, tokenizer=hf / "tokenizer.json")
    prepare_folder(str(text), tmp_path / "prep", 384, hf / "tokenizer.json", log=lambda m: None)
    assert read_meta(cache)["tokenizer"] == read_meta(tmp_path / "prep")["tokenizer"]
    assert (cache / "tokens.bin").read_bytes() == (tmp_path / "prep" / "tokens.bin").read_bytes()
    own = tmp_path / "own"
    own.mkdir()
    meta = build_folder(own, sorted(text.iterdir()), str(text), 300, log=lambda m: None)
    _, (tokens,), (bounds,) = _read(own)
    mine = BPETokenizer.load(own / "tokenizer.json")  # meshtrain's own BPE: whole documents too, then <|endoftext|>
    assert meta["bos_id"] is None and tokens.tolist() == [i for d in docs for i in mine.encode(d).tolist() + [meta["eos_id"]]]


def _one_line_refusal(r, *phrases):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) >= 1, r.stderr
    assert all(p in lines[-1] for p in phrases), r.stderr


def test_prepare_refuses_a_folder_with_no_text_and_a_used_out(tmp_path, llama3):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.jsonl").write_text("\n\n")
    _one_line_refusal(run_main("prepare", "--data", empty, "--vocab-size", "256", "--out", tmp_path / "p"),
                      "no text there")
    _one_line_refusal(run_main("prepare", "--data", empty, "--out", tmp_path / "p"), "no text there")  # a BPE to train
    assert not (tmp_path / "p").exists() and [p.name for p in tmp_path.iterdir()] == ["empty"]
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    _, text, hf, _ = llama3
    _one_line_refusal(run_main("prepare", "--data", text, "--init-from", hf, "--vocab-size", "512", "--out",
                              tmp_path / "q"), "--vocab-size 512 with --init-from")
    _one_line_refusal(run_main("prepare", "--data", text, "--vocab-size", "256", "--out", tmp_path / "used"),
                      "not empty")


def test_train_refuses_a_prepared_folder_of_another_version_or_tokenizer(llama3, tmp_path):
    """A prepared folder of format version 99, or tokenized by another tokenizer than
    --init-from's (meshtrain's byte tokenizer; another tokenizer.json): one line, exit 2,
    before any rank starts."""
    pytest.importorskip("transformers")
    from llama3_folder import hf_llama_folder
    docs, text, _, tok = llama3
    hf = tmp_path / "hf"
    hf_llama_folder(hf, tok)
    other = tmp_path / "other"
    shutil.copytree(hf, other)
    write_tokenizer(other, llama3_tokenizer(docs[:6], 380))  # another tokenizer.json, same special ids
    prepare_folder(str(text), tmp_path / "bytes", 256, log=lambda m: None)
    prepare_folder(str(text), tmp_path / "theirs", 384, other / "tokenizer.json", log=lambda m: None)
    shutil.copytree(tmp_path / "theirs", tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    (tmp_path / "old" / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    flags = ["--seq-len", "16", "--batch-size", "2", "--steps", "1", "--device", "cpu", "--dp", "1"]
    _one_line_refusal(run_main("train", "--data", tmp_path / "old", "--init-from", other, *flags, "--out",
                              tmp_path / "r1"), "format version 99", "prepare it again")
    _one_line_refusal(run_main("train", "--data", tmp_path / "bytes", "--init-from", hf, *flags, "--out",
                              tmp_path / "r2"), "prepared with the byte tokenizer", "--init-from")
    _one_line_refusal(run_main("train", "--data", tmp_path / "theirs", "--init-from", hf, *flags, "--out",
                              tmp_path / "r3"), "prepared with another tokenizer.json", f"--init-from {hf}")
    assert not any((tmp_path / r).exists() and any((tmp_path / r).iterdir()) for r in ("r1", "r2", "r3"))


def test_train_takes_a_prepared_folder_s_vocabulary_and_refuses_an_unversioned_one(llama3, tmp_path):
    from meshtrain.cli import config as C
    from meshtrain.cli.validate import validate
    _, text, _, _ = llama3
    meta = prepare_folder(str(text), tmp_path / "p", 300, log=lambda m: None)
    flags = {("train", "data"): str(tmp_path / "p"), ("model", "name"): "gpt-test", ("layout", "dp"): 1,
             ("train", "seq_len"): 32}
    cfg = C.load(None, flags)
    validate(cfg)
    assert cfg.train.vocab_size == meta["vocab_size"] != C.TrainConfig.vocab_size
    with pytest.raises(C.ConfigError, match="--vocab-size 512 with --data .*drop --vocab-size"):
        validate(C.load(None, {**flags, ("train", "vocab_size"): 512}))
    old = tmp_path / "old"  # the cache of meshtrain before the format: meta.json and tokens.bin, no "format"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"vocab_size": 256, "n_tokens": 0, "dtype": "uint16"}))
    (old / "tokens.bin").write_bytes(b"")
    with pytest.raises(C.ConfigError, match="older meshtrain .*prepare"):
        validate(C.load(None, {**flags, ("train", "data"): str(old)}))
    text_folder = tmp_path / "text"  # a folder of text with a meta.json of its own stays text
    shutil.copytree(text, text_folder)
    (text_folder / "meta.json").write_text("{}")
    cfg = C.load(None, {**flags, ("train", "data"): str(text_folder)})
    validate(cfg)
    assert cfg.train.vocab_size == C.TrainConfig.vocab_size


def test_a_prompt_is_encoded_as_transformers_encodes_it(llama3):
    """`meshtrain generate` starts from the ids `tokenizer(prompt)` gives in transformers:
    with the post-processor's BOS, as every training document began."""
    _, _, hf, tok = llama3
    ours = BPETokenizer.load(hf / "tokenizer.json").encode_prompt("ROMEO.\n\nWhat light")
    assert ours == tok.encode("ROMEO.\n\nWhat light", add_special_tokens=True).ids
    assert ours[0] == tok.token_to_id(BOS)


@pytest.mark.parametrize("where", ["dot-dot", "absolute"])
def test_a_meta_json_naming_a_file_outside_its_folder_is_refused_before_any_rank_starts(llama3, tmp_path, where):
    """A prepared folder's shards are its own files: a meta.json naming `../x` or an absolute
    path (a file of the right size there) is refused in one line, exit 2, as a checkpoint's
    index naming a path is, and that file is never read as tokens."""
    _, text, _, _ = llama3
    prepare_folder(str(text), tmp_path / "p", 256, log=lambda m: None)
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    outside = tmp_path / "outside.bin"
    shutil.copy(tmp_path / "p" / meta["shards"][0]["tokens"], outside)
    name = "../outside.bin" if where == "dot-dot" else str(outside)
    meta["shards"][0]["tokens"] = name
    (tmp_path / "p" / "meta.json").write_text(json.dumps(meta))
    r = run_main("train", "--data", tmp_path / "p", "--model", "gpt-test", "--seq-len", "16", "--batch-size", "2",
                 "--steps", "1", "--device", "cpu", "--dp", "1", "--out", tmp_path / "run")
    _one_line_refusal(r, f"meta.json names {name!r}, which is not a file in the folder", "prepare it again")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
