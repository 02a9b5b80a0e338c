"""What `--init-from DIR` decides is checked against the flags before any rank starts: the
vocabulary is the folder's (a --vocab-size the user gave, by flag or TOML, that differs is
refused), --seq-len stays within its max_position_embeddings (rope scaling included), and
the preset is named after the folder once (`hf-tiny`, not `hf-hf-tiny`). The folders are
written by hand — config.json, an empty weights file, a tokenizer file — since nothing
here reads the weights: no torch, no transformers."""

import json

import pytest

from helpers import run_cli
from meshtrain.cli import config as C
from meshtrain.cli.validate import validate
from meshtrain.recipes import PRESETS

VOCAB = 384


def _folder(path, max_positions=64, rope=None):
    path.mkdir(parents=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    if rope is not None:
        config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def _config(folder, *flags, toml=None):
    """The configuration `train FLAGS --init-from FOLDER` makes (the command line's own parse)."""
    from meshtrain.cli import build_parser
    args = ["train", "--init-from", str(folder), "--device", "cpu", "--seq-len", "32", *map(str, flags)]
    if toml is not None:
        args += ["--config", str(toml)]
    return C.from_args(build_parser(plan_flags=False).parse_args(args))


def _stated(folder, how: str, flag: str, section: str, key: str, value, tmp_path):
    """The configuration of `train --init-from FOLDER` with `value` given by the flag, or
    (`how` "toml") by a TOML file's [section] key."""
    if how == "flag":
        return _config(folder, flag, value)
    toml = tmp_path / f"run-{value}.toml"
    toml.write_text(f"[{section}]\n{key} = {json.dumps(value)}\n")
    return _config(folder, toml=toml)


def test_the_preset_is_named_after_the_folder_once(tmp_path):
    for folder, name in (("a/hf-tiny", "hf-tiny"), ("b/HF_Small", "hf-Small"), ("c/tiny", "hf-tiny")):
        cfg = _config(_folder(tmp_path / folder))
        validate(cfg)
        assert cfg.model.name == name and cfg.model.name in PRESETS, cfg.model.name
        assert cfg.train.vocab_size == VOCAB


@pytest.mark.parametrize("how", ["flag", "toml"])
def test_a_vocab_size_the_user_gave_is_refused_unless_it_is_the_folders(how, tmp_path):
    folder = _folder(tmp_path / "hf-tiny")
    for given, refused in ((1000, True), (2048, True), (VOCAB, False)):  # 2048: the default, stated all the same
        cfg = _stated(folder, how, "--vocab-size", "train", "vocab_size", given, tmp_path)
        if refused:
            with pytest.raises(C.ConfigError, match=rf"^--vocab-size {given} with --init-from .*: the vocabulary is "
                                                    rf"the folder's \({VOCAB} tokens, its tokenizer's\); drop "
                                                    rf"--vocab-size$"):
                validate(cfg)
        else:
            validate(cfg)
            assert cfg.train.vocab_size == VOCAB


@pytest.mark.parametrize("how", ["flag", "toml"])
def test_a_model_the_user_named_beside_the_folder_is_refused_unless_it_is_the_folders(how, tmp_path):
    """--model beside --init-from used to be ignored without a word: the folder's model trained."""
    folder = _folder(tmp_path / "hf-tiny")
    for given, refused in (("gpt-test", True), ("llama-test", True), ("hf-tiny", False)):
        cfg = _stated(folder, how, "--model", "model", "name", given, tmp_path)
        if refused:
            with pytest.raises(C.ConfigError, match=rf"^--model {given} with --init-from .*: the model is the "
                                                    rf"folder's \(hf-tiny\); drop --model$"):
                validate(cfg)
        else:
            validate(cfg)
            assert cfg.model.name == "hf-tiny"


def test_a_config_made_in_code_or_saved_by_a_run_is_adopted_as_before(tmp_path):
    """No flag named: the default vocabulary gives way to the folder's; a saved configuration
    (the folder's vocabulary already in it) reads back; validating twice changes nothing."""
    folder = _folder(tmp_path / "tiny")
    cfg = C.Config()
    cfg.model.init_from, cfg.train.seq_len = str(folder), 32
    validate(cfg)
    assert cfg.train.vocab_size == VOCAB
    again = C.Config.from_dict(cfg.to_dict())
    validate(again)
    validate(again)
    assert again.model.name == cfg.model.name == "hf-tiny" and again.train.vocab_size == VOCAB
    cfg = C.Config()
    cfg.model.init_from, cfg.train.seq_len, cfg.train.vocab_size = str(folder), 32, 999
    with pytest.raises(C.ConfigError, match="--vocab-size 999 with --init-from"):
        validate(cfg)


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_a_sequence_beyond_the_folders_positions_is_refused(rope, tmp_path):
    """max_position_embeddings is the length the folder declares, its rope scaling included:
    up to it is fine, one more is refused, scaled or not."""
    folder = _folder(tmp_path / "tiny", max_positions=64, rope=rope)
    validate(_config(folder, "--seq-len", 64))
    scaled = ", its llama3 rope scaling included" if rope else ""
    with pytest.raises(C.ConfigError, match=rf"^--seq-len 65 exceeds the 64 positions of --init-from \S+ \(its "
                                            rf"max_position_embeddings{scaled}\); use --seq-len 64 or less$"):
        validate(_config(folder, "--seq-len", 65))


def test_the_command_line_refuses_them_in_one_line_before_ranks_start(tmp_path):
    folder = _folder(tmp_path / "hf-tiny")
    for flags, message in ((["--vocab-size", "1000"], "--vocab-size 1000 with --init-from"),
                           (["--seq-len", "128"], "--seq-len 128 exceeds the 64 positions of --init-from")):
        r = run_cli("train", "--init-from", folder, "--device", "cpu", "--out", tmp_path / "run", *flags, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()


def test_plan_plans_the_imported_folder_and_checks_it_alike(tmp_path):
    folder = _folder(tmp_path / "hf-tiny")
    r = run_cli("plan", "--init-from", folder, "--seq-len", "32", "--batch-size", "4", "--dp", "2", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hf-tiny: ") and f"meshtrain train --init-from {folder} --dp 2" in r.stdout, r.stdout
    r = run_cli("plan", "--init-from", folder, "--seq-len", "128", timeout=60)
    assert r.returncode == 2 and "--seq-len 128 exceeds the 64 positions of hf-tiny" in r.stderr, r.stderr
    r = run_cli("plan", "--init-from", folder, "--vocab-size", "1000", timeout=60)
    assert r.returncode == 2 and "--vocab-size 1000 with --init-from" in r.stderr, r.stderr
