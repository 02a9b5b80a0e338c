"""`--compile` / `parallelize(compile=True)`: each block's forward compiled, verified against
one uncompiled process in every layout family (the suite runs dynamo with the `aot_eager`
backend, which traces forward and backward graphs as inductor does but generates no code;
inductor runs under `slow`), a user's own model against a plain PyTorch loop, names
unchanged, and the refusals: a model compiled before `parallelize`, an unknown backend, a
torch that cannot compile."""

import json

import pytest
import torch
from distributed import run_ranks
from helpers import cli_config, on_the_layout, run_cli, verify_in_ranks
from test_api import OPTIMIZERS, PIPELINE, PLAN, SCHEDULER, batches, make_model, plain_loop

import meshtrain
from meshtrain import verifier

SMALL = ("--seq-len", "32", "--vocab-size", "256", "--batch-size", "8", "--steps", "3")

# The acceptance matrix: ZeRO-3, TP + SP, PP 1F1B and zero-bubble, the CP ring, full
# recompute (with dropout), bf16 with ZeRO-1; GPT and Llama alternate.
LAYOUTS = {
    "zero3": ("gpt-test", "--dp", "2", "--zero", "3"),
    "tp2-sp": ("llama-test", "--tp", "2", "--sp"),
    "pp2-1f1b": ("gpt-test", "--pp", "2", "--microbatches", "2"),
    "pp2-zb": ("llama-test", "--pp", "2", "--microbatches", "2", "--schedule", "zb"),
    "cp2-ring": ("llama-test", "--cp", "2"),
    "recompute-full-dropout": ("gpt-test", "--dp", "2", "--recompute", "full", "--dropout", "0.1"),
    "zero1-bf16": ("llama-test", "--dp", "2", "--zero", "1", "--precision", "bf16"),
}


# The layout verified as users run it, `meshtrain verify ... --compile` in its own processes;
# the others through the same calls in ranks forked from the preloaded server (helpers).
THROUGH_THE_SHELL = "zero3"


def _verify_compiled(layout: str, backend: str) -> dict:
    model, *flags = LAYOUTS[layout]
    args = ("verify", "--model", model, *flags, *SMALL, "--compile", "--compile-backend", backend)
    if layout != THROUGH_THE_SHELL:
        return verify_in_ranks(cli_config(*args), timeout=900)
    r = run_cli(*args, "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_REPORTS: dict[tuple[str, str], dict] = {}


def _verified(layout: str, backend: str) -> dict:
    """Each layout's report, computed once for the tests that read it."""
    if (layout, backend) not in _REPORTS:
        _REPORTS[layout, backend] = _verify_compiled(layout, backend)
    return _REPORTS[layout, backend]


def _check(report: dict) -> None:
    assert report["passed"], report["failures"]
    assert report["layout"]["compile"] is True
    assert report["compile"]["graphs"] >= 1, report["compile"]  # dynamo compiled the blocks, not skipped them
    tol = report["tolerances"]  # unchanged: the same bounds as every other layout
    assert (tol["grad"], tol["update"], tol["step_loss"]) == (verifier.GRAD_TOLERANCE, verifier.UPDATE_TOLERANCE,
                                                              verifier.STEP_LOSS_TOLERANCE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_verify_compiled_aot_eager(layout):
    _check(_verified(layout, "aot_eager"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero3", "tp2-sp", "pp2-zb", "cp2-ring", "recompute-full-dropout"])
def test_verify_compiled_inductor(layout):
    _check(_verify_compiled(layout, "inductor"))


def test_blocks_without_collectives_compile_whole():
    """Under ZeRO-3 a block holds no collective (its gathers are hooks around the call): one
    graph, no break. Under TP each tensor-parallel layer's communication breaks the graph
    (Comm's collectives run eagerly), and the break is named."""
    zero3 = _verified("zero3", "aot_eager")["compile"]
    assert zero3["graph_breaks"] == 0, zero3
    tp = _verified("tp2-sp", "aot_eager")["compile"]
    assert tp["graph_breaks"] > 0 and any("disable" in reason for reason in tp["break_reasons"]), tp


def _graphs_after_each_step(mesh, cfg):
    from meshtrain.comm import Comm
    from meshtrain.parallel.compile import compile_stats
    from meshtrain.report import sample_text
    from meshtrain.train import StepObserver, held_out_loss, train

    class Graphs(StepObserver):
        def __init__(self):
            self.counts = []

        def after_step(self, p, step, loss):
            self.counts.append(compile_stats()["graphs"])
    graphs = Graphs()
    result = train(cfg, Comm(mesh), observer=graphs, measure_memory=False)
    held_out_loss(result.job, result.data, cfg)
    sample_text(cfg, result)
    return graphs.counts + [compile_stats()["graphs"]]


@pytest.mark.parametrize("model, flags", [("gpt-test", ("--dp", "2", "--zero", "3")),
                                         ("llama-test", ("--tp", "2", "--sp"))], ids=["zero3", "tp2-sp"])
def test_training_compiles_its_graphs_once(model, flags):
    """The first step runs under the mode that keys functional dropout (until it shows the
    model makes no such call); compiled blocks keep that mode, so the graphs dynamo traced
    under it at step 1 serve every later step: nothing compiles again at step 2 (which would
    double the compile time, minutes under inductor). Nor does a held-out evaluation or the
    end of a run's text sample (forwards without gradients, which run the blocks eagerly)."""
    cfg = cli_config("train", "--model", model, *flags, *SMALL, "--compile", "--compile-backend", "aot_eager")
    cfg.train.sample_tokens = 4
    for counts in on_the_layout(_graphs_after_each_step, cfg, timeout=600):
        assert counts[0] >= 1 and counts == [counts[0]] * len(counts), counts


# ---- a user's own model through the Python API ---------------------------------------------

API_LAYOUTS = {"dp2-zero3": ({"dp": 2}, {"zero": 3}),
               "tp2-fused-qkv": ({"tp": 2}, {"tp_plan": PLAN}),
               "pp2": ({"pp": 2}, {"pipeline": PIPELINE, "microbatches": 2})}


def _train_compiled(_harness_mesh, names):
    results = {}
    for name in names:
        axes, options = API_LAYOUTS[name]
        mesh = meshtrain.init(**axes)
        model = make_model()
        before = [n for n, _ in model.named_parameters()]
        job = meshtrain.parallelize(model, mesh, optimizer=OPTIMIZERS["adamw"], loss_fn=meshtrain.cross_entropy,
                                    clip_grad_norm=1.0, lr_scheduler=SCHEDULER, compile=True,
                                    compile_backend="aot_eager", **options)
        names_kept = all(n in before for n, _ in job.module.named_parameters())
        losses = [job.step(x, y).loss for x, y in batches()]
        weights = job.state_dict()["model"]
        if mesh.is_main:
            results[name] = (losses, weights, names_kept)
    return results


def test_a_compiled_users_model_trains_what_a_plain_loop_trains():
    results = run_ranks(_train_compiled, 2, list(API_LAYOUTS), timeout=600)[0]
    plain_losses, plain_weights = plain_loop("adamw")
    initial = {n: p.detach() for n, p in make_model().named_parameters()}
    for name, (losses, weights, names_kept) in results.items():
        assert names_kept, name
        assert weights.keys() == plain_weights.keys(), name  # no `_orig_mod.` anywhere
        for a, b in zip(losses, plain_losses):
            assert abs(a - b) / abs(b) < 1e-5, (name, losses, plain_losses)
        for n, w in plain_weights.items():
            update, ref = (weights[n] - initial[n]).double(), (w - initial[n]).double()
            assert (update - ref).norm() / ref.norm() < 1e-3, (name, n)


def _graphs_while_the_normalizer_changes(_harness_mesh, steps):
    """A MoE trained with `loss_reduction="sum"` and a normalizer that returns a different
    number each step (its targets' count, some of them ignored): dynamo's graphs after each
    step."""
    import torch.nn.functional as F

    from meshtrain.parallel.compile import compile_stats
    from meshtrain.recipes.build import build_model

    def summed(logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum", ignore_index=-100)
    job = meshtrain.parallelize(build_model("moe-test", 0, vocab_size=256), meshtrain.init(),
                                optimizer=OPTIMIZERS["adamw"], loss_fn=summed, loss_reduction="sum",
                                normalizer=lambda targets: float((targets != -100).sum()), compile=True,
                                compile_backend="aot_eager")
    g, counts = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
        y[torch.rand(y.shape, generator=g) < 0.3] = -100
        job.step(x, y)
        counts.append(compile_stats()["graphs"])
    return counts


def test_a_moe_keeps_its_graphs_while_the_loss_normalizer_changes():
    """The balancing loss's scale follows the step's normalizer; the blocks read it as a
    device tensor, so a normalizer that changes every step recompiles nothing (as a Python
    number it was a guard: a recompilation each step until dynamo's limit of 8, then that
    frame ran eagerly for the rest of the run)."""
    counts = run_ranks(_graphs_while_the_normalizer_changes, 1, 20, timeout=600)[0]
    assert counts[0] >= 1 and counts == [counts[0]] * len(counts), counts


# ---- refusals --------------------------------------------------------------------------------

def _one_process_job(model, **options):
    return meshtrain.parallelize(model, meshtrain.init(), optimizer=OPTIMIZERS["sgd"], **options)


def test_a_model_compiled_before_parallelize_is_refused_in_one_line():
    with pytest.raises(ValueError, match="compile=True") as caught:
        _one_process_job(torch.compile(make_model(), backend="aot_eager"))
    assert "\n" not in str(caught.value) and "_orig_mod" in str(caught.value)
    model = make_model()
    model.blocks[1] = torch.compile(model.blocks[1], backend="aot_eager")
    with pytest.raises(ValueError, match="blocks.1 was compiled"):
        _one_process_job(model)


def test_compiled_blocks_keep_names_state_dict_and_checkpoints(tmp_path):
    """Only the blocks' forward methods change: names, state dict and a saved checkpoint are
    those of the plain model, and the compiled job loads what it saved."""
    job = _one_process_job(make_model(), compile=True, compile_backend="aot_eager", loss_fn=meshtrain.cross_entropy)
    plain = make_model()
    assert [n for n, _ in job.module.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert job.module.state_dict().keys() == plain.state_dict().keys()
    x, y = batches(1)[0]
    job.step(x, y)
    job.save(tmp_path / "ckpt")
    again = _one_process_job(make_model(), compile=True, compile_backend="aot_eager", loss_fn=meshtrain.cross_entropy)
    again.load(tmp_path / "ckpt")
    for (n, a), (_, b) in zip(job.module.named_parameters(), again.module.named_parameters()):
        assert torch.equal(a, b), n


def test_an_unknown_backend_is_refused_before_any_rank_starts():
    r = run_cli("train", "--compile", "--compile-backend", "tvm", "--steps", "1")
    assert r.returncode == 2 and "--compile-backend" in r.stderr and "aot_eager" in r.stderr, r.stderr
    with pytest.raises(ValueError, match="compile backend 'tvm'"):
        _one_process_job(make_model(), compile=True, compile_backend="tvm")


def test_bench_refuses_compile():
    r = run_cli("bench", "--vs", "ddp", "--compile")
    assert r.returncode == 2 and "eager peer" in r.stderr, r.stderr


def test_a_torch_that_cannot_compile_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match="leave --compile off"):
        _one_process_job(make_model(), compile=True, compile_backend="aot_eager")
