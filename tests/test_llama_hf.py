"""The Llama model against Hugging Face's: a tiny random `LlamaForCausalLM` (no download)
loaded into meshtrain gives the same logits, meshtrain's weights saved for transformers load
as is and give meshtrain's logits, the round trip is bitwise, and what meshtrain cannot
represent is refused in one line."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtrain.hf import HFError, load_hf, save_hf

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {  # name: LlamaConfig arguments
    "gqa-untied-headdim-llama3": dict(num_key_value_heads=2, head_dim=12, rope_parameters=LLAMA3),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "gqa-tied-linear": dict(num_key_value_heads=1, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mha-headdim-theta": dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
}
VOCAB, SEQ = 96, 40


def _hf_model(**kwargs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5,
                                      attn_implementation="eager", **kwargs)
    return transformers.LlamaForCausalLM(config).eval()


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("case", CASES)
def test_hugging_face_weights_give_hugging_face_logits(case, tmp_path):
    hf = _hf_model(**CASES[case])
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(ours(ids), hf(ids).logits)
    assert ours.spec.tie_embeddings == bool(CASES[case].get("tie_word_embeddings", False))
    if ours.spec.tie_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight


def test_the_older_rope_spelling_and_a_sharded_index(tmp_path):
    hf = _hf_model(num_key_value_heads=2, rope_parameters=LLAMA3)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # transformers 4's keys
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        _close(load_hf(tmp_path).eval()(ids), hf(ids).logits)


@pytest.mark.parametrize("case", ["gqa-untied-headdim-llama3", "mha-tied"])
def test_saved_for_transformers_it_loads_as_is_and_the_round_trip_is_bitwise(case, tmp_path):
    hf = _hf_model(**CASES[case])
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        _close(back(ids).logits, ours(ids))
    original, saved = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert original.keys() == saved.keys()
    for name, t in original.items():
        assert torch.equal(t, saved[name]), name


def _folder(tmp_path, edit_config=None, edit_weights=None):
    hf = _hf_model(num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    if edit_config:
        config = json.loads((tmp_path / "config.json").read_text())
        edit_config(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    if edit_weights:
        weights = load_file(tmp_path / "model.safetensors")
        edit_weights(weights)
        save_file(weights, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("edit,message", [
    (dict(edit_config=lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])), "model_type 'gpt2'"),
    (dict(edit_config=lambda c: c.update(attention_bias=True)), "attention_bias is true"),
    (dict(edit_config=lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})),
     "rope_type 'yarn'"),
    (dict(edit_config=lambda c: c.update(num_key_value_heads=3)), "num_key_value_heads 3 does not divide"),
    (dict(edit_config=lambda c: c.update(hidden_size=48)), "but config.json makes it"),
    (dict(edit_weights=lambda w: w.pop("model.norm.weight")), "model.norm.weight is missing"),
    (dict(edit_weights=lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})),
     "is not a weight of this Llama"),
], ids=["architecture", "bias", "yarn", "kv-heads", "shape", "missing", "extra"])
def test_what_meshtrain_cannot_represent_is_refused_in_one_line(edit, message, tmp_path):
    folder = _folder(tmp_path, **edit)
    with pytest.raises(HFError, match=message) as e:
        load_hf(folder)
    assert "\n" not in str(e.value)


def test_no_config_and_meta_s_original_format_are_refused(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "params.json").write_text("{}")
    (tmp_path / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(HFError, match="Meta's original format"):
        load_hf(tmp_path)


def test_fine_tuning_from_the_command_line_starts_at_the_imported_model_s_loss(tmp_path):
    """A Hugging Face folder (a tiny random LlamaForCausalLM whose tokenizer.json is a BPE
    trained here) fine-tuned with `train --init-from` in tp 2: its loss at step 0 is the
    imported model's loss on that batch, on text tokenized by the folder's tokenizer."""
    from helpers import last_json, run_cli

    from meshtrain.data.corpus import shakespeare_files
    from meshtrain.data.datasets import TextData, prepare_text
    from meshtrain.data.tokenizer import BPETokenizer
    hf_dir = tmp_path / "hf"
    bpe = BPETokenizer.train(shakespeare_files()[:2], 320)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(hf_dir)
    bpe.save(hf_dir / "tokenizer.json")
    r = run_cli("train", "--init-from", hf_dir, "--tp", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "32",
                "--lr", "1e-4", "--device", "cpu", "--out", tmp_path / "run", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    j = last_json(r.stdout)
    data = TextData(prepare_text("shakespeare", 384, tokenizer=hf_dir / "tokenizer.json"), 32, 0)
    x, y = data.batch(0, 4, slice(0, 4))
    assert int(x.max()) < bpe.vocab_size  # the folder's tokenizer's ids
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.reshape(-1)).item()
    assert abs(j["losses"][0] - want) / want < 1e-5, (j["losses"][0], want)
    assert j["n_params"] == sum(p.numel() for p in hf.parameters())


def test_init_from_a_folder_meshtrain_cannot_use_is_refused_before_ranks_start(tmp_path):
    """Through the command line's `main` in this process (the fine-tuning above runs the command)."""
    from helpers import run_main
    r = run_main("train", "--init-from", tmp_path, "--out", tmp_path / "run")
    assert r.returncode == 2 and "--init-from" in r.stderr and "no config.json" in r.stderr, r.stderr
    _hf_model().save_pretrained(tmp_path / "hf")
    r = run_main("train", "--init-from", tmp_path / "hf", "--out", tmp_path / "run")
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr, r.stderr


def test_each_rank_reads_only_its_slices_of_an_imported_weight(tmp_path):
    from meshtrain.hf import HFWeights
    hf = _hf_model(num_key_value_heads=2)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    weights = HFWeights(tmp_path, ours)
    full = weights.full_value("layers.0.self_attn.o_proj.weight")
    for index in [(slice(0, 16),), (slice(None), slice(16, 32)), None]:  # column, row, whole
        assert torch.equal(weights.piece("layers.0.self_attn.o_proj.weight", index),
                           full if index is None else full[index])
    assert torch.equal(weights.piece("layers.1.mlp.up_proj.weight", (slice(None), [0, 5, 9])),
                       weights.full_value("layers.1.mlp.up_proj.weight")[:, [0, 5, 9]])
