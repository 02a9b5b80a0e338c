"""`--fp8`: the blocks' linear layers' matmuls in float8 on torchao's recipes
(`parallel/fp8.py`), emulated on the CPU.

- One process: `Fp8Linear` is torchao's own `Float8Linear`, bit for bit (forward and every
  gradient, both recipes, fp32 and bf16), on torchao's matmul (nothing split) and on
  meshtrain's own (`_Fp8Matmul`, what a split layer runs); and it really quantizes.
- Tensor parallelism in two real ranks: a column layer then a row layer, each scale reduced
  over tp, equal to the one-process pair within rounding; the scale audit stays silent on
  the real code, and speaks once the amax reduction is skipped.
- `meshtrain verify` PASSes in data, ZeRO-3, tensor + sequence, pipeline and expert layouts,
  and FAILs naming a cast when the amax reduction over tp is skipped inside the ranks.
- The command line's refusals, one line each with the fix; `meshtrain train --fp8` runs.
- Known bugs, as strict xfails (at the end)."""

import copy
import dataclasses
import json
import math
import re
from contextlib import nullcontext
from unittest import mock

import pytest

pytest.importorskip("torchao")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from distributed import run_ranks  # noqa: E402
from helpers import TINY, cli_config, last_json, on_the_layout, run_cli, run_main, verdict  # noqa: E402
from presets import GPT_TEST_4  # noqa: E402

from meshtrain import verifier  # noqa: E402
from meshtrain.parallel.fp8 import Fp8Casts, Fp8Linear, Split  # noqa: E402
from meshtrain.parallel.options import Fp8Options  # noqa: E402

RECIPES = ("tensorwise", "rowwise")
FP8 = ("--fp8-emulate", "--fp8-min-features", "16")
SMALL = ("--seq-len", "32", "--vocab-size", "256", "--batch-size", "8", "--steps", "3", "--device", "cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---- one process: Fp8Linear is torchao's Float8Linear -----------------------------------------

def _mlp(dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(dtype)


def _converted(mlp: nn.Sequential, recipe: str, comm=None, split: Split = Split()) -> nn.Sequential:
    """`mlp` with its linear layers made `Fp8Linear`s as `apply_fp8` makes them (on meta, the
    same parameters assigned)."""
    out = copy.deepcopy(mlp)
    for i, m in enumerate(out):
        if type(m) is nn.Linear:
            with torch.device("meta"):
                new = Fp8Linear(m.in_features, m.out_features, bias=False)
            new.weight, new.bias = m.weight, m.bias
            new.fp8 = Fp8Casts(Fp8Options(recipe, emulate=True), comm, split, f"{i}")
            out[i] = new
    return out


def _torchao(mlp: nn.Sequential, recipe: str) -> nn.Sequential:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    out = copy.deepcopy(mlp)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(out, config=config)
    assert [type(m) for m in out] == [Float8Linear, nn.GELU, Float8Linear]
    return out


def _run(model: nn.Module, x: torch.Tensor):
    """The output, the input's gradient and every parameter's gradient of sum(y²)."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("path", ["whole", "split"])
def test_fp8_linear_is_torchaos_float8_linear_bit_for_bit(recipe, dtype, path):
    """Path "whole": nothing split, torchao's own matmul; "split": a split declared over an
    axis of size 1, so meshtrain's `_Fp8Matmul` runs its own casts (what tensor parallelism
    runs)."""
    from meshtrain.comm import Comm
    from meshtrain.mesh import Mesh
    mlp = _mlp(dtype)
    if path == "whole":
        ours = _converted(mlp, recipe)
    else:
        ours = _converted(mlp, recipe, Comm(Mesh.single(torch.device("cpu"))), Split(outputs=("tp",)))
    assert all(m.fp8.whole == (path == "whole") for m in ours if isinstance(m, Fp8Linear))
    torch.manual_seed(1)
    x = torch.randn(4, 16, 64, dtype=dtype)
    y, gx, grads = _run(ours, x)
    y_ao, gx_ao, grads_ao = _run(_torchao(mlp, recipe), x)
    assert y.dtype == dtype and torch.equal(y, y_ao)
    assert torch.equal(gx, gx_ao)
    assert grads.keys() == grads_ao.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name in grads:
        assert torch.equal(grads[name], grads_ao[name]), name
    # and it quantizes: the plain MLP's output (same dtype) is percents away (e4m3 keeps 3 mantissa bits)
    assert _rel(y, _run(mlp, x)[0]) > 1e-2


# ---- two ranks, tp = 2: a column layer then a row layer ---------------------------------------

def _skipping_the_amax_reduction():
    """A patch of `Comm.all_reduce` that skips the fp8 amax reductions (`PURPOSE`): each rank
    scales by its own part's amax. Applied inside ranks only."""
    import torch.distributed as dist

    from meshtrain.comm import Comm
    from meshtrain.parallel.fp8 import PURPOSE
    real = Comm.all_reduce

    def all_reduce(self, tensor, axis, *, op=dist.ReduceOp.SUM, purpose=None, **kw):
        return None if purpose == PURPOSE else real(self, tensor, axis, op=op, purpose=purpose, **kw)
    return mock.patch.object(Comm, "all_reduce", all_reduce)


def _tp_pair(mesh, recipe: str, skip_amax_reduce: bool):
    """On each rank: the column → row pair with this rank's shards and the scales reduced
    over tp, and the one-process Fp8Linear pair on the same weights and input; both
    outputs, input gradients and this rank's weight-gradient shards (with the full layers'
    rows/columns that belong to it), and the audit's findings."""
    from meshtrain.comm import Comm
    from meshtrain.parallel.fp8 import PURPOSE
    from meshtrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear, _CopyToRegion

    comm = Comm(mesh)
    torch.manual_seed(0)
    full_col, full_row = nn.Linear(64, 128), nn.Linear(128, 32)
    x = torch.randn(2, 16, 64)
    options = Fp8Options(recipe, emulate=True)

    col, row = ColumnParallelLinear(full_col, comm), RowParallelLinear(full_row, comm, sp=False)
    col.fp8 = Fp8Casts(options, comm, Split(outputs=("tp",)), "col")
    row.fp8 = Fp8Casts(options, comm, Split(inputs=("tp",)), "row")
    col.fp8.audit, row.fp8.audit = [], []

    with _skipping_the_amax_reduction() if skip_amax_reduce else nullcontext():
        xi = x.clone().requires_grad_()
        y = row(nn.functional.gelu(col(_CopyToRegion.apply(xi, comm))))
        y.square().sum().backward()
    audit = {"col": col.fp8.audit, "row": row.fp8.audit}
    reduced = comm.totals().get(PURPOSE, 0)  # the bytes of the amax all-reduces (and the audit's gathers)

    ref = _converted(nn.Sequential(full_col, nn.GELU(), full_row), recipe)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.square().sum().backward()
    tp, r = mesh.size("tp"), mesh.coord("tp")
    out_rows = slice(r * 128 // tp, (r + 1) * 128 // tp)
    return {"y": (y.detach(), yr.detach()), "grad_x": (xi.grad, xr.grad),
            "col.weight": (col.weight.grad, ref[0].weight.grad[out_rows]),
            "col.bias": (col.bias.grad, ref[0].bias.grad[out_rows]),
            "row.weight": (row.weight.grad, ref[2].weight.grad[:, out_rows]),
            "row.bias": (row.bias.grad, ref[2].bias.grad), "audit": audit, "reduced": reduced}


@pytest.mark.parametrize("recipe", RECIPES)
def test_tensor_parallel_pair_equals_one_process_and_audits_clean(recipe):
    ranks = run_ranks(_tp_pair, 2, recipe, False, tp=2)
    for rank, out in enumerate(ranks):
        assert out["audit"] == {"col": [], "row": []}, (rank, out["audit"])
        assert out["reduced"] > 0
        for name in ("y", "grad_x", "col.weight", "col.bias", "row.weight", "row.bias"):
            got, expected = out[name]
            assert got.shape == expected.shape, (rank, name)
            assert _rel(got, expected) <= 1e-6, (rank, name, _rel(got, expected))


@pytest.mark.parametrize("recipe", RECIPES)
def test_skipped_amax_reduction_is_reported_by_the_audit(recipe):
    """Each rank scales by its own shard's amax: some rank's audit names a cast. Tensorwise
    the layers then differ from the one-process pair (the mutant is real); rowwise scales are
    powers of two, which move a value's fp8 rounding only near the subnormals, so there the
    audit is what sees it."""
    ranks = run_ranks(_tp_pair, 2, recipe, True, tp=2)
    found = [(rank, layer, entry) for rank, out in enumerate(ranks) for layer, entries in out["audit"].items()
             for entry in entries]
    assert found, "the audit did not see per-shard scales"
    for rank, layer, (name, cast, diff) in found:
        assert name == layer and cast in ("input", "weight", "grad_output", "weight_for_grad_input",
                                          "grad_output_for_grad_weight", "input_for_grad_weight"), (name, cast)
        assert diff > 0
    if recipe == "tensorwise":
        assert max(_rel(*out[name]) for out in ranks for name in ("y", "grad_x", "col.weight", "row.weight")) > 1e-3


# ---- meshtrain verify ----------------------------------------------------------------------

# layout -> (model, flags), each verified in both recipes
VERIFY = {
    "dp2-microbatches2": (GPT_TEST_4, ("--dp", "2", "--microbatches", "2")),
    "dp2-zero3": (GPT_TEST_4, ("--dp", "2", "--zero", "3")),
    "tp2-sp": (GPT_TEST_4, ("--dp", "1", "--tp", "2", "--sp")),
    "pp2-microbatches2": (GPT_TEST_4, ("--dp", "1", "--pp", "2", "--microbatches", "2")),
    "dp2-ep2": ("moe-test", ("--dp", "2", "--ep", "2")),
}
# As users run it, in processes of its own, with a preset of the command line's own (the
# tests' gpt-test-4 is registered in pytest's process only); the others in forked ranks.
THROUGH_THE_SHELL = ("dp2-microbatches2", "tensorwise")


def _verify_args(layout: str, recipe: str, model: str | None = None) -> tuple:
    preset, flags = VERIFY[layout]
    return ("verify", "--model", model or preset, *flags, *SMALL, "--fp8", recipe, *FP8)


def _record(mesh, cfg, mutant: bool):
    """verify's record of the layout in its ranks (this module's function, so that a rank
    unpickling it imports the tests' presets, gpt-test-4), the mutant's patch applied there;
    and (the layers `fp8_layer_names` chose, how many this rank converted)."""
    from meshtrain.comm import Comm
    from meshtrain.parallel import compose
    real, converted = compose.apply_fp8, []

    def apply_fp8(model, names, *args, **kwargs):
        n = real(model, names, *args, **kwargs)
        converted.append((len(names), n))
        return n
    with mock.patch.object(compose, "apply_fp8", apply_fp8), \
            _skipping_the_amax_reduction() if mutant else nullcontext():
        record = verifier.record(cfg, Comm(mesh), "mutant" if mutant else "layout")
    return record, converted


def _verify_in_ranks(cfg, mutant: bool = False) -> dict:
    """`helpers.verify_in_ranks`, with `_record` in the ranks: the verdict, with the report's
    `layout` key. Every rank converted its stage's share of the chosen layers; a lockstep
    layout recorded the held-out loss after each sampled step (which `compare` checks)."""
    ranks = on_the_layout(_record, cfg, mutant, timeout=300)
    for rank, (_, converted) in enumerate(ranks):
        assert len(converted) == 1, (rank, converted)
        chosen, n = converted[0]
        assert chosen > 0 and n == chosen // cfg.layout.pp, (rank, converted)
    steps = ranks[0][0]["steps"]
    assert verifier.curve_only(cfg) or (steps and all("val" in rec for rec in steps.values())), steps.keys()
    return {"layout": cfg.layout.summary(), **verdict(cfg, ranks[0][0])}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("layout", VERIFY)
def test_verify_passes(layout, recipe):
    if (layout, recipe) == THROUGH_THE_SHELL:
        r = run_cli(*_verify_args(layout, recipe, "gpt-test"), "--json", timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "PASS" in r.stderr
        j = last_json(r.stdout)
    else:
        j = _verify_in_ranks(cli_config(*_verify_args(layout, recipe)))
    assert j["passed"], j["failures"]
    assert j["layout"]["fp8"] == recipe
    tp_or_cp = j["layout"]["tp"] > 1 or j["layout"]["cp"] > 1
    assert j["curve_only"] == tp_or_cp
    if not tp_or_cp:  # lockstep, with the held-out loss after each sampled step
        assert j["lockstep_steps"] == [1, 2, 3]
        assert j["max_grad_rel_diff"] <= j["tolerances"]["grad"]
        assert j["max_eval_rel_diff"] <= j["tolerances"]["eval"]
    assert len(j["losses"]["layout"]) == 3 and all(math.isfinite(v) for v in j["losses"]["layout"])


def test_verify_fails_on_per_shard_scales_naming_the_cast():
    """Tensor + sequence parallelism with the amax reductions over tp skipped inside the
    ranks (the parent's one-process reference is the real code): the loss curve may well stay
    within 2 %, but the scale audit names a cast at the first audited step."""
    v = _verify_in_ranks(cli_config(*_verify_args("tp2-sp", "tensorwise")), mutant=True)
    assert not v["passed"], "per-shard fp8 scales slipped through verify"
    pattern = r"step 1: rank \d: blocks\.\d+\.[\w.]+'s \w+ cast did not scale by the whole tensor's amax"
    assert re.match(pattern, v["first_failure"]), v["first_failure"]


# ---- the command line's refusals -----------------------------------------------------------

@pytest.mark.parametrize("flags, fix", [
    (("--fp8", "tensorwise"), "add --fp8-emulate"),
    (("--fp8", "tensorwise", *FP8, "--pp", "2", "--dp", "1", "--microbatches", "2", "--schedule", "zb"),
     "use --schedule 1f1b, gpipe or interleaved"),
    (("--fp8", "tensorwise", *FP8, "--dp-linear-sync", "allgather"), "use --dp-linear-sync allreduce"),
    (("--fp8", "rowwise", "--fp8-emulate"), "lower --fp8-min-features"),
    (("--fp8-emulate",), "add --fp8 tensorwise or rowwise, or drop --fp8-emulate"),
    (("--fp8-min-features", "16"), "add --fp8 tensorwise or rowwise, or drop --fp8-min-features"),
    (("--fp8", "blockwise", "--fp8-emulate"), "use --fp8 none | tensorwise | rowwise"),
], ids=["cpu-without-emulate", "zero-bubble", "allgather", "no-linear-large-enough", "emulate-alone",
        "min-features-alone", "unknown-recipe"])
def test_refused_with_one_line_naming_the_fix(flags, fix, tmp_path):
    r = run_main("train", *TINY, "--steps", "2", "--out", tmp_path / "run", *flags)
    err = r.stderr.strip()
    assert r.returncode == 2, r.stderr
    assert err.startswith("meshtrain: error: ") and "\n" not in err and fix in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---- meshtrain train --fp8 ---------------------------------------------------------------------

def test_train_with_fp8_writes_its_steps(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", *TINY, "--fp8", "rowwise", *FP8, "--steps", "2", "--dp", "1", "--out", out, "--json",
                timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert last_json(r.stdout)["layout"]["fp8"] == "rowwise"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2]
    assert all(math.isfinite(rec["loss"]) for rec in records), records


# ---- fp8 with zero-bubble at pp 1, and across a resume ------------------------------------------

def test_zero_bubble_is_refused_in_one_line_at_any_pp(tmp_path):
    """zb's split backward would form the linear layers' weight gradients in high precision:
    refused before any rank starts, with or without a pipeline."""
    r = run_cli("train", *TINY, "--fp8", "tensorwise", *FP8, "--dp", "1", "--schedule", "zb", "--steps", "1",
                "--out", tmp_path / "run", timeout=300)
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and err.startswith("meshtrain: error: ") and "--schedule" in err, \
        (r.returncode, err[-2000:])


RESUME = ("verify", *TINY, "--steps", "4", "--dp", "2", "--fp8", "tensorwise", *FP8, "--resume-at", "2")


def test_a_resume_layout_keeps_the_first_layouts_fp8():
    """--resume-layout that does not name fp8 keeps it (as precision), and the resume passes."""
    r = run_cli(*RESUME, "--resume-layout", "dp=2 zero=3", "--json", timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    j = last_json(r.stdout)
    assert j["passed"] and j["max_resume_rel_diff"] == 0.0 and {3, 4} <= set(j["lockstep_steps"])


@pytest.mark.parametrize("layout, says", [("dp=2 fp8=rowwise", "fp8=rowwise"), ("dp=1", "dp×microbatches")])
def test_a_resume_that_changes_the_scales_is_refused(layout, says):
    """Another recipe, or other micro-batches (fp8's scales are each micro-batch's), would make
    the one-process reference another run: one line, exit 2."""
    r = run_cli(*RESUME, "--resume-layout", layout, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("meshtrain: error: ") and says in err[0], \
        (r.returncode, r.stderr[-2000:])


def test_the_steps_resumed_in_a_curve_only_layout_are_judged_by_the_curve():
    """dp 2 resumed in tp 2 (fp8 over reordered sums: curve-only): the whole run is judged by
    its curve, the first part's lockstep steps too."""
    r = run_cli(*RESUME, "--resume-layout", "dp=1 tp=2 microbatches=2", "--json", timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    j = last_json(r.stdout)
    assert j["curve_only"] and j["passed"] and j["max_loss_rel_diff"] < 0.02
