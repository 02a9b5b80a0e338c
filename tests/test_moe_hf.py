"""meshtrain's MoE against transformers' Mixtral, Qwen3-MoE and OLMoE: a tiny random model of
each (built from its config class, no download) loaded with `load_hf` gives transformers'
logits, and saved back with `save_hf` it is the same files, which transformers loads as is;
a moe-test run's checkpoint exported with `export --hf` is the run's model in transformers,
its stacked experts read once each; `train --init-from` a Qwen3-MoE folder starts at that
model's loss; what the formats cannot hold is refused in one line."""

import json
import re

import pytest
import torch
from helpers import cli_config, last_json, run_cli, run_main, train_in_ranks
from safetensors import safe_open
from safetensors.torch import load_file

from meshtrain.hf import HFError, byte_tokenizer, load_hf, save_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 40
SHAPE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attn_implementation="eager")
CASES = {  # name: (config class, its arguments, an expert's on-disk key in layer 1, what meshtrain reads)
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                                      num_experts_per_tok=2, head_dim=12, tie_word_embeddings=True),
                "model.layers.1.block_sparse_moe.experts.3.w2.weight", dict(qk_norm="none", dense_layers=())),
    # layer 0 dense by mlp_only_layers, layer 2 by decoder_sparse_step 2 (layers 1 and 3 sparse)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2, head_dim=12, mlp_only_layers=[0],
                                         decoder_sparse_step=2, norm_topk_prob=True),
                  "model.layers.1.mlp.experts.3.down_proj.weight",
                  dict(qk_norm="head", dense_layers=(0, 2), norm_topk=True)),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=2, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                  norm_topk_prob=False, eos_token_id=None, pad_token_id=None),
              "model.layers.1.mlp.experts.3.gate_proj.weight", dict(qk_norm="projection", norm_topk=False)),
}


def _hf_model(case: str, vocab: int = VOCAB):
    """A tiny random model of `case`, its routers' weights spread (N(0, 0.5)) so that no
    token's experts are decided by a near tie that rounding could flip."""
    cls, kwargs, _, _ = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(
        vocab_size=vocab, **SHAPE, **kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def _close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("case", CASES)
def test_transformers_folders_give_its_logits_and_save_back_as_the_same_files(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    _, _, expert_key, read = CASES[case]
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert expert_key in f.keys()  # transformers 5 writes the experts one by one
    ours = load_hf(tmp_path / "hf").eval()
    assert {k: getattr(ours.spec, k) for k in read} == read
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        _close(ours(ids), want)
    save_hf(ours, tmp_path / "ours")
    original = load_file(tmp_path / "hf" / "model.safetensors")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert original.keys() == saved.keys()
    for name, t in original.items():
        assert torch.equal(t, saved[name]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        _close(back(ids).logits, want)


@pytest.fixture(scope="module", params=[("--dp", "2"), ("--dp", "2", "--ep", "2")], ids=["dp2", "dp2-ep2"])
def moe_run(tmp_path_factory, request):
    """(the step-2 checkpoint of moe-test trained in dp 2, or dp 2 with the experts split over
    ep 2, its `export --hf`): the command's ranks forked (helpers.train_in_ranks), the export
    through the command line's `main` in this process (`init_run` trains from a shell)."""
    root = tmp_path_factory.mktemp("moe_run")
    train_in_ranks(cli_config("train", "--model", "moe-test", "--vocab-size", "256", "--seq-len", "32",
                              "--batch-size", "4", "--data", "benchmarks/data/hamlet.txt", *request.param,
                              "--steps", "2", "--save-every", "2", "--device", "cpu", "--out", root / "run"))
    r = run_main("export", "--hf", "--ckpt", root / "run" / "step-2", "--out", root / "export")
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "run" / "step-2", root / "export"


def test_export_hf_of_a_run_is_the_run_s_model_in_transformers(moe_run):
    from meshtrain.cli.run_model import load_model
    ckpt, out = moe_run
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["mlp_only_layers"] == [0]
    assert config["router_aux_loss_coef"] == pytest.approx(1e-3 * 3 / 2)  # aux_coef · MoE layers / top_k
    ours, _, _ = load_model(ckpt)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _close(ours(ids), theirs(ids).logits)


def test_export_reads_each_stacked_tensor_once(moe_run, tmp_path, monkeypatch):
    from meshtrain.cli import hf_export
    ckpt, first = moe_run
    reads = []
    real = hf_export.weights_of

    def counted(folder):
        shapes, read = real(folder)
        return shapes, lambda name, dtype=None: reads.append(name) or read(name, dtype)
    monkeypatch.setattr(hf_export, "weights_of", counted)
    hf_export.export_hf(ckpt, tmp_path)
    assert len(reads) == len(set(reads)) and "layers.1.mlp.experts.gate_up_proj" in reads
    assert load_file(tmp_path / "model.safetensors").keys() == load_file(first / "model.safetensors").keys()


@pytest.fixture(scope="module")
def init_run(tmp_path_factory):
    """A tiny Qwen3-MoE folder (byte tokenizer) fine-tuned one step by `train --init-from`,
    balancing by the router's bias, which the step moves off zero."""
    root = tmp_path_factory.mktemp("moe_init")
    hf = _hf_model("qwen3_moe", vocab=256)
    hf.save_pretrained(root / "hf")
    byte_tokenizer().save(str(root / "hf" / "tokenizer.json"))
    r = run_cli("train", "--init-from", root / "hf", "--moe-balance", "bias", "--dp", "2", "--steps", "1",
                "--save-every", "1", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-4", "--device", "cpu",
                "--out", root / "run", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    return hf, root / "hf", root / "run", last_json(r.stdout)


def test_init_from_a_qwen3_moe_folder_starts_at_its_loss(init_run):
    from meshtrain.data.datasets import TextData, prepare_text
    hf, folder, _, j = init_run
    data = TextData(prepare_text("shakespeare", 256, tokenizer=folder / "tokenizer.json"), 32, 0)
    x, y = data.batch(0, 4, slice(0, 4))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.reshape(-1)).item()
    assert abs(j["losses"][0] - want) / want < 1e-5, (j["losses"][0], want)
    assert j["n_params"] == sum(p.numel() for p in hf.parameters())


def test_export_of_a_nonzero_router_bias_is_refused_in_one_line(init_run, tmp_path):
    _, _, run, _ = init_run
    r = run_main("export", "--hf", "--ckpt", run / "step-1", "--out", tmp_path / "x")
    assert r.returncode == 2, r.stderr
    assert re.search(r"layers\.\d\.mlp\.gate\.expert_bias is nonzero .*; export it without --hf", r.stderr), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x" / "model.safetensors").exists()


def test_a_zero_bias_is_left_out(tmp_path):
    from meshtrain.recipes.build import build_model
    model = build_model("moe-test", 0, moe={"balance": "bias"})
    save_hf(model, tmp_path / "zero")
    assert not any("expert_bias" in k for k in load_file(tmp_path / "zero" / "model.safetensors"))
    model.layers[1].mlp.gate.expert_bias[0] = 0.5
    with pytest.raises(HFError, match=r"^save_hf: layers\.1\.mlp\.gate\.expert_bias is nonzero") as e:
        save_hf(model, tmp_path / "bias")
    assert "\n" not in str(e.value) and not (tmp_path / "bias").exists()


@pytest.mark.parametrize("change,message", [
    (dict(score="sigmoid"), "this MoE has sigmoid router scores"),
    (dict(shared_ffn_dim=16), "this MoE has shared experts (shared_ffn_dim 16)"),
    (dict(qk_norm="none"), "this MoE has dense layers [0] with qk_norm 'none'"),
    (dict(qk_norm="none", dense_layers=(), norm_topk=False), "top-k weights left unnormalised"),
])
def test_a_spec_none_of_the_three_can_hold_is_refused_before_anything_is_written(change, message, tmp_path):
    import dataclasses

    from meshtrain.models.moe import MoEModel
    from meshtrain.recipes.moe import PRESETS
    model = MoEModel(dataclasses.replace(PRESETS["moe-test"], **change), 256)
    with pytest.raises(HFError, match=re.escape(message)) as e:
        save_hf(model, tmp_path / "x")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


def _config(case: str, tmp_path, **edit):
    """A folder holding only the config.json of `case`, edited: what is refused is refused
    before any weight is read."""
    config = json.loads(getattr(transformers, CASES[case][0])(vocab_size=VOCAB, **SHAPE, **CASES[case][1])
                        .to_json_string())
    config.update(edit)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("case,edit,message", [
    ("qwen3_moe", dict(n_group=2, topk_group=1), "n_group 2 (DeepSeek's grouped routing)"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv 8.0"),
    ("mixtral", dict(sliding_window=16), "sliding_window 16 is enabled"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=16), "sliding_window 16 is enabled"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias is true"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "fp8"}), "quantization_config (fp8)"),
    ("qwen3_moe", dict(model_type="qwen2_moe", shared_expert_intermediate_size=32), "shared_expert_gate"),
    ("olmoe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("qwen3_moe", dict(model_type="deepseek_v3"), "model_type 'deepseek_v3'"),
], ids=["n_group", "jitter", "clip_qkv", "mixtral-window", "qwen-window", "bias", "fp8", "shared-gate", "gelu",
        "deepseek"])
def test_what_meshtrain_cannot_represent_is_refused_in_one_line(case, edit, message, tmp_path):
    with pytest.raises(HFError, match=re.escape(message)) as e:
        load_hf(_config(case, tmp_path, **edit))
    assert "\n" not in str(e.value)


def test_the_balancing_coefficient_exports_as_the_folder_stated_it():
    """router_aux_loss_coef → meshtrain's per-layer weight (× top_k / MoE layers) → back: the
    folder's own number, not one that rounding moved by an ulp (0.03 came back as
    0.030000000000000002 for 7 MoE layers)."""
    import dataclasses

    from meshtrain.recipes import PRESETS
    from meshtrain.recipes.moe_hf import aux_coef_from_hf, config_from_spec
    for coef in (0.03, 0.001, 0.01, 0.02, 0.07, 0.0001):
        for top_k in (1, 2, 3, 4):
            for moe_layers in (3, 4, 7, 48):
                spec = dataclasses.replace(PRESETS["moe-test"], n_layers=moe_layers + 1, top_k=top_k,
                                           aux_coef=aux_coef_from_hf(coef, top_k, moe_layers))
                assert config_from_spec(spec, 256, "float32")["router_aux_loss_coef"] == coef, (coef, top_k,
                                                                                                moe_layers)


@pytest.mark.parametrize("case", CASES)
def test_the_balancing_loss_is_on_where_transformers_adds_it_and_exports_so(case, tmp_path):
    """transformers adds the balancing loss to `.loss` only with `output_router_logits` (off by
    default): meshtrain balances by the loss exactly then, keeps the weight either way, and
    writes both back as the folder had them (it wrote false, and balanced regardless)."""
    from meshtrain.hf import config_from_spec, spec_from_config
    for routed in (True, False, None):
        edit = {"router_aux_loss_coef": 0.02} | ({} if routed is None else {"output_router_logits": routed})
        config = json.loads((_config(case, tmp_path / str(routed), **edit) / "config.json").read_text())
        spec, vocab = spec_from_config(config)
        assert spec.balance == ("sequence" if routed else "none") and spec.aux_coef > 0, (routed, spec)
        back = config_from_spec(spec, vocab, "float32")
        assert back["output_router_logits"] is bool(routed) and back["router_aux_loss_coef"] == 0.02, back


def test_a_window_that_is_off_is_read(tmp_path):
    """Qwen3-MoE's sliding_window counts only with use_sliding_window."""
    from meshtrain.hf import spec_from_config
    folder = _config("qwen3_moe", tmp_path, use_sliding_window=False, sliding_window=16)
    spec, vocab = spec_from_config(json.loads((folder / "config.json").read_text()))
    assert vocab == VOCAB and spec.dense_layers == (0, 2)
