"""`export --hf` writes a complete Hugging Face folder: a tiny Llama folder with non-default
special ids (bos 380, eos 381, pad 382), llama3 rope scaling and its own tokenizer config,
fine-tuned 2 steps in dp 2 · ZeRO-3 at bf16 and exported, comes back from transformers with
the same ids, rope and special tokens, a generation_config.json, bf16 weights equal to the
run's masters rounded, and `generate` reads the export. Export streams one tensor at a time:
its peak memory is below twice the largest shard it writes. meshtrain's own tokenizers (its
BPE, the bytes) get a tokenizer_config written for them."""

import json
import re
import shutil

import pytest
import torch
from helpers import run_cli, run_main
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _imported_folder(folder):
    """A Llama-3-like folder: a byte-level BPE whose specials sit at 380-382 (after reserved
    tokens, as Llama 3's do), a 384-row embedding, llama3 rope scaling."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshtrain.data.corpus import shakespeare_files
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([shakespeare_files()[0].read_text()[:200_000]], trainer)
    reserved = [f"<|reserved_{i}|>" for i in range(380 - tok.get_vocab_size())]
    tok.add_special_tokens(reserved + [BOS, EOS, PAD])
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [380, 381, 382]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=128, bos_token_id=380, eos_token_id=381,
                                      pad_token_id=382, rope_parameters=dict(LLAMA3))
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": 128, "clean_up_tokenization_spaces": False}))
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the imported folder, the run's --out, its step-2 checkpoint, the --hf export)."""
    root = tmp_path_factory.mktemp("export_hf")
    hf = _imported_folder(root / "hf")
    r = run_cli("train", "--init-from", hf, "--dp", "2", "--zero", "3", "--precision", "bf16", "--steps", "2",
                "--save-every", "2", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-3", "--device", "cpu",
                "--out", root / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("export", "--hf", "--ckpt", root / "run" / "step-2", "--out", root / "export")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 2, r.stderr  # the shard written, the summary
    return hf, root / "run", root / "run" / "step-2", root / "export"


def test_transformers_reads_the_special_ids_rope_and_tokens_of_the_imported_folder(exported):
    hf, _, _, out = exported
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (380, 381, 382)
    assert {k: config.rope_parameters[k] for k in LLAMA3} == LLAMA3
    raw = json.loads((out / "config.json").read_text())  # what transformers 4 reads too
    assert raw["rope_theta"] == 500000.0 and raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["rope_scaling"]["factor"] == 8.0 and raw["dtype"] == "bfloat16"
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (380, 381, 382)
    ours, theirs = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(hf)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (BOS, EOS, PAD)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (380, 381, 382)
    text = "ROMEO.\n\nBut soft, what light through yonder window breaks?"
    assert ours(text).input_ids == theirs(text).input_ids


def test_the_export_is_the_run_s_model_in_its_compute_dtype_and_generate_reads_it(exported):
    from meshtrain.checkpoint.export import weights_of
    from meshtrain.cli.run_model import load_model
    _, _, ckpt, out = exported
    shapes, read = weights_of(ckpt)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {n if n.startswith("lm_head") else f"model.{n}" for n in shapes}
        for name in shapes:  # the fp32 masters, rounded to the run's bf16
            got = f.get_tensor(name if name.startswith("lm_head") else f"model.{name}")
            assert got.dtype == torch.bfloat16 and torch.equal(got, read(name).to(torch.bfloat16)), name
    ours, _, _ = load_model(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval().float()
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(ours.eval()(ids), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    g = run_main("generate", "--ckpt", out, "--prompt", "ROMEO.", "--tokens", "8", "--device", "cpu")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("ROMEO.") and len(g.stdout) > len("ROMEO.\n")


def test_generate_ends_its_text_at_the_end_of_text_token(exported, tmp_path):
    """`meshtrain generate` stops where the model samples an end-of-text id, as transformers'
    `generate` does (it ran on for --tokens): the id read from a Hugging Face folder's
    generation config, and from the folder a run imported."""
    import shutil

    from meshtrain.cli.run_model import end_of_text_ids, load_model
    from meshtrain.generate import sample
    _, _, ckpt, out = exported
    assert end_of_text_ids(out) == end_of_text_ids(ckpt) == {381}
    model, tokenizer, cfg = load_model(out)
    prompt = tokenizer.encode_prompt("ROMEO.")
    free = sample(model, prompt, 8, cfg.train.seq_len)  # generate's defaults: temperature 0.8, top-k 50, seed 0
    end = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    ends = tmp_path / "ends"
    shutil.copytree(out, ends)
    for name in ("config.json", "generation_config.json"):  # this model's texts end at its token `end`
        config = json.loads((ends / name).read_text())
        config["eos_token_id"] = free[end]
        (ends / name).write_text(json.dumps(config))
    assert sample(model, prompt, 8, cfg.train.seq_len, stop=end_of_text_ids(ends)) == free[:end + 1]
    g = run_main("generate", "--ckpt", ends, "--prompt", "ROMEO.", "--tokens", "8", "--device", "cpu")
    assert g.returncode == 0, g.stderr
    assert g.stdout == "ROMEO." + tokenizer.decode(free[:end]) + "\n"  # the text, without its end token


def _peak_bytes(fn) -> int:
    """The most bytes of CPU memory `fn` held at once above what it started with: every
    allocation and free the profiler saw (its raw records: the event list folds those made
    inside an op into that op), in time order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak


def _data_bytes(path) -> int:
    header = int.from_bytes(path.read_bytes()[:8], "little")
    return path.stat().st_size - 8 - header


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_holds_one_tensor_at_a_time_below_twice_the_largest_shard(dtype, exported, tmp_path):
    """Each tensor is read (its saved boxes converted as they are copied in) and streamed
    into its file: the peak is one tensor in the export's dtype and one saved box, whatever
    the shard or model size (the export used to build a second full model beside the
    consolidated weights)."""
    from meshtrain.checkpoint.export import DTYPES, weight_shapes
    from meshtrain.cli.hf_export import export_hf
    _, _, ckpt, _ = exported
    saved = weight_shapes(ckpt)
    model_bytes = sum(s.numel() * DTYPES[dtype].itemsize for s, _ in saved.values())
    peak = _peak_bytes(lambda: export_hf(ckpt, tmp_path, dtype=DTYPES[dtype], max_shard_bytes=model_bytes // 2))
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) >= 2
    largest_shard = max(_data_bytes(f) for f in files)
    largest = max(s.numel() for s, _ in saved.values())
    assert 0 < peak < 2 * largest_shard, (peak, largest_shard)
    assert peak <= largest * (DTYPES[dtype].itemsize + 4), (peak, largest)  # one tensor, one fp32 box
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == DTYPES[dtype]


def test_the_run_s_out_keeps_the_imported_configs_so_the_folder_may_go(exported, tmp_path):
    """The run's --out records the --init-from folder's configs: with the folder gone, its
    export is as complete, and generate reads the run. A step-N checkpoint keeps them when
    the run saves them into its meta (`run_model.imported_record`); else it is refused in one
    line naming the folder."""
    from meshtrain.cli.hf_export import export_hf
    from meshtrain.checkpoint.sharded import read_meta
    from meshtrain.cli.run_model import load_model
    hf, run, ckpt, first = exported
    moved = tmp_path / "moved"
    shutil.move(hf, moved)
    try:
        export_hf(run, tmp_path / "from-run")
        config = transformers.AutoConfig.from_pretrained(tmp_path / "from-run")
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (380, 381, 382)
        assert config.rope_parameters["rope_type"] == "llama3"
        assert transformers.AutoTokenizer.from_pretrained(tmp_path / "from-run").pad_token == PAD
        model, tokenizer, _ = load_model(run)  # what `generate --ckpt RUN` samples from
        assert model.vocab_size == 384 and tokenizer.decode(tokenizer.encode("ROMEO.")) == "ROMEO."
        if "imported" in read_meta(ckpt):
            export_hf(ckpt, tmp_path / "from-ckpt")
            assert (tmp_path / "from-ckpt" / "config.json").read_text() == (first / "config.json").read_text()
        else:
            with pytest.raises(ValueError, match=re.escape(f"fine-tuned {hf} (--init-from), which is gone")) as e:
                export_hf(ckpt, tmp_path / "from-ckpt")
            assert "\n" not in str(e.value)
    finally:
        shutil.move(moved, hf)


def test_an_unknown_dtype_is_refused_in_one_line(tmp_path):
    r = run_main("export", "--hf", "--ckpt", tmp_path, "--out", tmp_path / "x", "--dtype", "fp16")
    assert r.returncode == 2 and "unknown dtype 'fp16'; use --dtype bf16 | fp32" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists(), r.stderr


def _tiny_llama(vocab):
    from meshtrain.models.llama import Llama
    from meshtrain.models.specs import LlamaSpec
    torch.manual_seed(0)
    return Llama(LlamaSpec(n_layers=1, n_heads=2, d_model=16, ffn_dim=24, max_seq_len=64), vocab)


def test_meshtrain_s_own_bpe_gets_its_end_of_text_as_eos_and_pad(tmp_path):
    from meshtrain.data.tokenizer import EOS_TEXT, BPETokenizer
    from meshtrain.hf import save_hf
    bpe = BPETokenizer.train_documents(["ROMEO.\nBut soft, what light through yonder window breaks?"] * 20, 300)
    bpe.save(tmp_path / "tokenizer.json")
    eos = bpe.token_to_id(EOS_TEXT)
    save_hf(_tiny_llama(bpe.vocab_size), tmp_path / "hf", dtype=torch.bfloat16, tokenizer=tmp_path / "tokenizer.json")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, eos, eos)
    assert config.rope_parameters["rope_type"] == "default" and json.loads(
        (tmp_path / "hf" / "config.json").read_text())["rope_scaling"] is None
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (EOS_TEXT, EOS_TEXT, None)
    assert tok("ROMEO. But soft").input_ids == bpe.encode("ROMEO. But soft").tolist()
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == eos


def test_the_byte_tokenizer_is_written_as_a_byte_level_tokenizer_json(tmp_path):
    from meshtrain.data.tokenizer import ByteTokenizer
    from meshtrain.hf import save_hf
    save_hf(_tiny_llama(256), tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "ROMEO. Ça va?\n\tnaïve — 東京 \x00\x7f"
    ids = tok(text).input_ids
    assert ids == ByteTokenizer().encode(text).tolist()
    assert tok.decode(ids) == text and tok.decode(list(range(256))) == ByteTokenizer().decode(range(256))


# ---- where an export writes: never over a model unless asked, never over a run or its sources ----

def _files(folder):
    """Every file under `folder` by its path there, with its bytes (the lease aside: each job
    that holds the folder, refused or not, takes the next one)."""
    from meshtrain.checkpoint.lock import is_lock_file
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and not is_lock_file(p.name)}


def test_a_non_empty_out_is_refused_unless_overwrite_moves_its_files_aside(exported, tmp_path):
    """A sharded export is refused as --out in one line with nothing written; with
    --overwrite its shards, index and run.json are renamed into OUT/replaced-<time>/, and
    the folder holds the new export's files alone."""
    _, _, ckpt, first = exported
    out = tmp_path / "model"
    r = run_main("export", "--ckpt", ckpt, "--out", out, "--max-shard-gb", "0.0001")  # 100 kB shards
    assert r.returncode == 0, r.stderr
    old = _files(out)
    assert "model.safetensors.index.json" in old and sum(n.endswith(".safetensors") for n in old) > 1
    r = run_main("export", "--hf", "--ckpt", ckpt, "--out", out)
    assert r.returncode == 2 and f"--out {out} is not empty" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and _files(out) == old, r.stderr
    r = run_main("export", "--hf", "--ckpt", ckpt, "--out", out, "--overwrite")
    assert r.returncode == 0, r.stderr
    aside, = out.glob("replaced-*")
    assert _files(aside) == old  # every old file, renamed: nothing lost
    assert {p.name for p in out.iterdir()} - {aside.name} == {p.name for p in first.iterdir()}
    assert _files(out).keys() - {f"{aside.name}/{n}" for n in old} == _files(first).keys()


@pytest.mark.parametrize("case", ["init-from", "the-run", "another-run", "ckpt", "locked"])
def test_an_export_never_writes_over_its_sources_a_run_or_a_live_job_s_folder_even_with_overwrite(case, exported,
                                                                                                 tmp_path):
    """The --init-from folder the run fine-tuned, the run's --out that holds --ckpt, another
    run's --out (its checkpoints and lineage), the --ckpt folder itself, and a folder a live
    job holds: refused in one line, exit 2, not a byte changed there."""
    from meshtrain.checkpoint.lock import OutLock
    hf, run, ckpt, first = exported
    if case == "another-run":
        shutil.copytree(run, tmp_path / "run")
    out, says = {"init-from": (hf, "fine-tuned"), "the-run": (run, "holds --ckpt"),
                 "another-run": (tmp_path / "run", "holds a training run's checkpoints (step-2)"),
                 "ckpt": (ckpt, "is --ckpt"), "locked": (first, "in use by another meshtrain job")}[case]
    before = _files(out)
    lock = OutLock(out, log=print).acquire() if case == "locked" else None
    try:
        r = run_main("export", "--hf", "--ckpt", ckpt, "--out", out, "--overwrite")
    finally:
        if lock:
            lock.release()
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _files(out) == before
