"""meshtrain's Llama (`llama-test`: GQA with 4 query heads over 2 key/value heads, a head
size other than d/h, RoPE) through the strategies, each layout checked by `meshtrain.verify`
against one process: data, tensor (+ sequence), pipeline parallelism, ZeRO, recomputation.
Mutants for what is new (rotary positions, key/value head groups) must fail it."""

import pytest
import torch
from distributed import run_ranks

import meshtrain
from meshtrain.recipes.build import build_model
from meshtrain.recipes.llama import TP_PLAN as LLAMA_PLAN
from meshtrain.recipes.llama import pipeline_plan as llama_plan

V, T, ROWS = 256, 32, 8
PIPELINE = llama_plan(32)


def make_model():
    return build_model("llama-test", 0, vocab_size=V)


def adamw(named):
    return torch.optim.AdamW((p for _, p in named), lr=1e-2)


def batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, V, (ROWS, T), generator=g), torch.randint(0, V, (ROWS, T), generator=g))
            for _ in range(n)]


LAYOUTS = {  # name: (axes, parallelize options)
    "dp2": ({"dp": 2}, {}),
    "tp2": ({"tp": 2}, {"tp_plan": LLAMA_PLAN}),
    "tp2-sp": ({"tp": 2}, {"tp_plan": LLAMA_PLAN, "sp": True}),
    "pp2-1f1b": ({"pp": 2}, {"pipeline": PIPELINE, "microbatches": 2}),
    "dp2-zero3": ({"dp": 2}, {"zero": 3}),
    "dp2-full-recompute": ({"dp": 2}, {"recompute": "full"}),
    "tp2-selective": ({"tp": 2}, {"tp_plan": LLAMA_PLAN, "recompute": "selective"}),
}


def _verify(_mesh, names):
    reports = {}
    for name in names:
        axes, options = LAYOUTS[name]
        mesh = meshtrain.init(**axes)
        reports[name] = meshtrain.verify(make_model, batches(), optimizer=adamw, mesh=mesh, **options)
    return reports


def test_llama_passes_verify_in_every_two_rank_layout():
    reports = run_ranks(_verify, 2, list(LAYOUTS), timeout=600)[0]
    for name, report in reports.items():
        assert report.passed, (name, report)


def _positions_wrong_on_rank_1():
    """Rotary positions wrong on rank 1 alone (the reference runs on rank 0): numbered from 0
    again at the middle of the sequence — what positions computed per sequence chunk give
    under SP, or a later pipeline stage numbering its part of a sequence. (A uniform shift
    of every position would be no error: RoPE's scores depend on differences of positions.)"""
    import torch.distributed as dist

    from meshtrain.models import llama
    table = llama.Rotary._table

    def wrong(self, positions, dtype):
        if dist.get_rank() == 1:
            positions = positions % (len(positions) // 2)
        return table(self, positions, dtype)
    llama.Rotary._table = wrong


def _kv_heads_left_whole():
    """q split by heads but k and v left whole: rank r's query heads pair with key/value heads
    0, 1, ... instead of their own group's."""
    import meshtrain.parallel.tensor as tensor
    styles = {k: v for k, v in LLAMA_PLAN.styles.items() if k != "layers.*.self_attn.[qkv]_proj"}
    styles["layers.*.self_attn.q_proj"] = tensor.COLUMN
    return tensor.TensorPlan(styles, vocab_parallel_loss=True)


def _mutant(_mesh, mutant):
    axes, options = {"rope-sp": LAYOUTS["tp2-sp"], "rope-pp": LAYOUTS["pp2-1f1b"], "kv-groups": LAYOUTS["tp2"]}[mutant]
    options = dict(options)
    if mutant == "kv-groups":
        options["tp_plan"] = _kv_heads_left_whole()
    else:
        _positions_wrong_on_rank_1()
    return meshtrain.verify(make_model, batches(), optimizer=adamw, mesh=meshtrain.init(**axes), **options)


@pytest.mark.parametrize("mutant", ["rope-sp", "rope-pp", "kv-groups"])
def test_llama_mutants_fail_verify(mutant):
    report = run_ranks(_mutant, 2, mutant, timeout=300)[0]
    assert not report.passed, report
    assert report.worst["grad"][0] > 1e-3, report.worst


def _refused(_mesh):
    with pytest.raises(ValueError, match="n_kv_heads=2 heads do not split over tp=4"):
        meshtrain.parallelize(make_model(), meshtrain.init(tp=4), optimizer=adamw, tp_plan=LLAMA_PLAN)
    return True


def test_kv_heads_not_divisible_by_tp_are_refused_in_one_line():
    assert run_ranks(_refused, 4, timeout=300) == [True] * 4


def _tied_refused(_mesh):
    import dataclasses

    from meshtrain.models.llama import Llama
    from meshtrain.recipes import PRESETS

    tied = Llama(dataclasses.replace(PRESETS["llama-test"], tie_embeddings=True), 256)
    with pytest.raises(ValueError, match="lm_head.weight is the same parameter as embed_tokens.weight"):
        meshtrain.parallelize(tied, meshtrain.init(pp=2), optimizer=adamw, pipeline=llama_plan(32), microbatches=2)
    return True


def test_a_head_tied_to_the_embedding_is_refused_across_pipeline_stages():
    """Its two uses would sit on the first and the last stage: the API refuses in one line
    (the command line before any rank starts)."""
    assert run_ranks(_tied_refused, 2, timeout=300) == [True] * 2


LLAMA_TINY = ["--model", "llama-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8", "--device", "cpu"]


@pytest.mark.parametrize("layout", [
    ["--tp", "2", "--sp", "--recompute", "selective"],
    ["--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "zb", "--microbatches", "2"],
    pytest.param(["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"], marks=pytest.mark.slow),
], ids=["tp2-sp-selective", "pp2-interleaved", "pp2-zb", "dp2-tp2-pp2-zero1"])
def test_llama_verify_through_the_command_line(layout):
    """`meshtrain verify` as a user runs it for tensor parallelism; the pipelines' reports
    from the same calls in ranks forked from the preloaded server (helpers.verify_in_ranks)."""
    from helpers import cli_config, run_cli, verify_in_ranks
    args = ("verify", *LLAMA_TINY, "--steps", "3", *layout)
    if layout[0] != "--tp":
        cfg = cli_config(*args)
        j = verify_in_ranks(cfg)
        assert j["passed"] and cfg.model.name == "llama-test", j["failures"]
        return
    r = run_cli(*args)
    assert r.returncode == 0 and "PASS: llama-test" in r.stdout, r.stdout[-1500:] + r.stderr[-1500:]


def test_a_checkpoint_trained_in_zero3_exports_for_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    """The ZeRO-3 ranks' training (helpers.train_in_ranks: the command's ranks, forked) and a
    one-process run through the command line's `main`, exported in this process."""
    from helpers import cli_config, run_main, train_in_ranks

    from meshtrain.cli.run_model import load_model
    train_in_ranks(cli_config("train", *LLAMA_TINY, "--dp", "2", "--zero", "3", "--steps", "3", "--save-every", "3",
                              "--out", tmp_path / "run"))
    r = run_main("export", "--hf", "--ckpt", tmp_path / "run" / "step-3", "--out", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    ours, _, _ = load_model(tmp_path / "run" / "step-3")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, V, (2, T))
    with torch.no_grad():
        want = ours.eval()(ids)
        torch.testing.assert_close(theirs(ids).logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    gpt = run_main("train", "--model", "gpt-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8",
                   "--dp", "1", "--steps", "1", "--save-every", "1", "--out", tmp_path / "gpt")
    assert gpt.returncode == 0, gpt.stderr
    r = run_main("export", "--hf", "--ckpt", tmp_path / "gpt" / "step-1", "--out", tmp_path / "y")
    assert r.returncode == 2 and "holds gpt-test: export it without --hf" in r.stderr


def test_the_planners_published_llamas_build_on_meta_with_its_parameter_counts():
    from meshtrain.models import count_params
    from meshtrain.recipes import published_shapes
    from meshtrain.recipes.llama import published_llamas
    assert set(published_llamas()) == {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b"}
    for name in published_llamas():
        model = build_model(name, 0, device="meta")
        assert count_params(model) == published_shapes()[name].n_params(), name
    assert count_params(build_model("llama3-8b", 0, device="meta")) == 8_030_261_248  # Meta's 8.03B
