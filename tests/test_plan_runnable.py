"""A plan a user can run: `fits` leaves a stated headroom of the device's memory for the CUDA
context and the allocator (`--mem-headroom`, a fraction, default 0.1), the report prints the
`meshtrain train` line of the layout it planned — which `train` takes and validates to the
same layout — and the published shapes say how they train. In process, no ranks: each plan
takes milliseconds, the small search about a second."""

import json
import shlex
from dataclasses import fields

import pytest

from meshtrain.cli import config as C
from meshtrain.cli.validate import validate
from meshtrain.cli import build_parser, main
from meshtrain.cli.plan import DEFAULT_HEADROOM, train_flags
from meshtrain.plan.planner import Workload
from meshtrain.plan.search import layouts, search
from meshtrain.recipes import shape_of
from meshtrain.plan.cluster import GIB, GPU_PRESETS, GpuRates

# Llama-3 8B on 64 H100s at 8k tokens, dp 64 · ZeRO-2, one sequence per micro-batch: the
# layout the search ranked first before the headroom, at 79.0 GiB on "80 GiB" devices.
DP64 = ["--model", "llama3-8b", "--gpus", "64", "--dp", "64", "--zero", "2", "--micro-batch-size", "1",
        "--batch-size", "256", "--seq-len", "8192", "--precision", "bf16"]


def _plan(capsys, *args):
    """`meshtrain plan ARGS --json`: (exit code, the JSON or None, standard error)."""
    code = main(["plan", *map(str, args), "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out.strip().splitlines()[-1]) if code == 0 else None), out.err


def test_fits_leaves_the_headroom_and_says_so(capsys):
    code, got, err = _plan(capsys, *DP64)
    assert code == 0, err
    assert 78.5 * GIB < got["total_bytes"] < 79.5 * GIB
    assert got["mem_headroom"] == DEFAULT_HEADROOM == 0.1
    assert got["device_memory_bytes"] == 80 * GIB and got["usable_bytes"] == pytest.approx(72 * GIB)
    assert got["fits"] is False and "does NOT fit in 72.0 GiB (80 less --mem-headroom 0.1" in err, err
    code, got, err = _plan(capsys, *DP64, "--mem-headroom", "0")  # the old meaning: the whole device
    assert got["fits"] is True and "fits in 80.0 GiB (80 less --mem-headroom 0" in err, err
    code, got, err = _plan(capsys, *DP64, "--gpu-mem-gib", "90")  # still the device's whole memory
    assert got["fits"] is True and got["usable_bytes"] == pytest.approx(81 * GIB)


@pytest.mark.parametrize("value", ["1", "-0.1", "8"])
def test_a_headroom_that_is_not_a_fraction_is_refused_in_one_line(value, capsys):
    code, _, err = _plan(capsys, "--model", "gpt-small", "--mem-headroom", value)
    assert code == 2 and f"--mem-headroom {float(value):g}: give the fraction of each device's memory" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_search_keeps_only_layouts_within_the_headroom(capsys):
    """gpt-small on 8 devices so small that the fastest layout fills 95 % of one: without
    headroom it leads; with the default 10 % every layout shown fits 90 %, and it is gone."""
    base = ["--model", "gpt-small", "--gpus", "8", "--batch-size", "16", "--search", "--top", "5"]
    _, whole, _ = _plan(capsys, *base, "--mem-headroom", "0")
    fastest = whole["search"]["top"][0]
    device_gib = fastest["total_bytes"] / 0.95 / GIB
    _, tight, err = _plan(capsys, *base, "--mem-headroom", "0", "--gpu-mem-gib", device_gib)
    assert tight["search"]["top"][0] == fastest
    _, kept, err = _plan(capsys, *base, "--gpu-mem-gib", device_gib)
    assert kept["search"]["fit"] < tight["search"]["fit"]
    assert all(row["total_bytes"] <= 0.9 * device_gib * GIB for row in kept["search"]["top"])
    assert kept["fits"] and kept["search"]["top"][0] != fastest
    assert "fit in " in err and "less --mem-headroom 0.1" in err, err


def _as_train(flags: list[str], world: int) -> C.Config:
    """The configuration `meshtrain train FLAGS` makes and validates under a launcher of `world`."""
    cfg = C.from_args(build_parser(plan_flags=False).parse_args(["train", *flags]))
    validate(cfg, world_size=world)
    return cfg


def _same_layout(cfg: C.Config, lay: C.LayoutConfig, work: Workload):
    for f in fields(C.LayoutConfig):
        assert getattr(cfg.layout, f.name) == getattr(lay, f.name), (f.name, getattr(cfg.layout, f.name), lay)
    assert (cfg.train.seq_len, cfg.train.batch_size) == (work.seq, work.batch)


def test_every_searched_layouts_train_line_validates_to_that_layout():
    """Every layout the search considers for llama-small on 8 devices (every 13th of 3,108,
    240 of them: ZeRO 0-3, tp with and without SP, pp with each schedule and chunks, cp in
    both modes, recompute, micro-batches) — and the search's best: each one's train flags,
    parsed and validated as `train` does under a launcher of 8, give back exactly its layout
    and batch."""
    cfg = C.Config()
    cfg.model.name, cfg.train.seq_len, cfg.train.batch_size = "llama-small", 256, 16
    work = Workload(shape_of("llama-small", 2048), 16, 256)
    best = search(work, 8, GpuRates(GPU_PRESETS["h100-80g"], "fp32"), memory_bytes=72 * GIB, top=1)["best"][0][0]
    every = list(layouts(work, 8, 8, C.LayoutConfig()))
    seen = set()
    for lay in every[::13] + [best]:
        flags, note = train_flags(cfg, work, lay)
        assert note is None and flags[:2] == ["--model", "llama-small"]
        _same_layout(_as_train(flags, 8), lay, work)
        seen |= {("cp", lay.cp_mode, lay.cp), ("zero", lay.zero), ("tp", lay.tp, lay.sp), ("pp", lay.pp, lay.schedule,
                 lay.chunks), ("recompute", lay.recompute)}
    assert {("cp", "ulysses", 2), ("tp", 4, True), ("pp", 2, "interleaved", 2), ("pp", 4, "zb", 1), ("zero", 3),
            ("recompute", "full")} <= seen, seen


@pytest.mark.parametrize("args", [
    ["--model", "llama-small", "--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--microbatches", "4",
     "--recompute", "segments:2", "--precision", "bf16", "--grad-dtype", "compute", "--stage-layers", "1,3,2,2"],
    ["--model", "gpt-test", "--vocab-size", "256", "--seq-len", "64", "--dp", "2", "--zero", "3", "--keep-gathered",
     "--dropout", "0.1", "--attention", "math"],
    ["--model", "llama-small", "--dp", "1", "--cp", "2", "--cp-mode", "ulysses", "--tp", "2", "--sp",
     "--seq-len", "512", "--micro-batch-size", "2"],
])
def test_a_single_plans_train_line_is_the_planned_run(args, capsys):
    code, got, err = _plan(capsys, *args)
    assert code == 0, err
    command = got["train_command"]
    assert f"to train this layout:\n  {command}\n" in err, err
    words = shlex.split(command)
    assert words[:2] == ["meshtrain", "train"]
    cfg = _as_train(words[2:], None)  # as from a shell: its dp is given
    want = C.from_args(build_parser().parse_args(["plan", *args]))
    validate(want)
    if "--micro-batch-size" in args:  # plan's own flag: train takes the micro-batches it makes
        want.layout.microbatches = want.train.batch_size // (want.layout.dp * 2)
    assert cfg.layout == want.layout and cfg.model == want.model
    assert (cfg.train.seq_len, cfg.train.batch_size, cfg.train.vocab_size) == (
        want.train.seq_len, want.train.batch_size, want.train.vocab_size)


def test_published_shapes_say_how_they_train(capsys):
    """A Llama shape's line reads --init-from a folder to fill in; GPT-3 175B and explicit
    dimensions get no line, and say why; `train --model llama3-8b` is refused in one line."""
    code, got, err = _plan(capsys, "--model", "llama3-8b", "--gpus", "8", "--dp", "8", "--zero", "3",
                           "--batch-size", "8", "--precision", "bf16", "--recompute", "full")
    assert code == 0 and got["train_command"].startswith("meshtrain train --init-from LLAMA3_8B_DIR --dp 8 "), err
    assert "LLAMA3_8B_DIR: a Hugging Face folder of llama3-8b's architecture" in err
    code, got, err = _plan(capsys, "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8", "--dp", "16",
                           "--batch-size", "1536", "--micro-batch-size", "1", "--precision", "bf16")
    assert code == 0 and got["train_command"] is None and "no train command: gpt3-175b is the paper's shape" in err
    code, got, err = _plan(capsys, "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256")
    assert code == 0 and got["train_command"] is None and "explicit dimensions are a shape" in err
    cfg = C.Config()
    cfg.model.name = "llama3-8b"
    with pytest.raises(C.ConfigError, match=r"^--model llama3-8b is a published shape for `meshtrain plan`, not a "
                                            r"model train builds; .*--init-from DIR$"):
        validate(cfg)


def test_beyond_a_node_the_line_says_how_to_start_the_ranks(capsys):
    code, got, err = _plan(capsys, "--model", "gpt-small", "--gpus", "16", "--dp", "16", "--batch-size", "16")
    assert code == 0 and got["train_command"].startswith("meshtrain train --model gpt-small --dp 16 ")
    assert "16 ranks on 2 nodes" in err and "torchrun --nnodes 2 --nproc-per-node 8" in err, err


@pytest.mark.parametrize("command", ["train", "plan", "verify"])
def test_help_shows_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    raw = capsys.readouterr().out
    text = " ".join(raw.split())
    assert "(default )" not in text
    entries = {" ".join(e.split()).split(" ", 1)[0]: " ".join(e.split()) for e in raw.split("\n  --")[1:]}
    for flag in ("eval-batches", "timeout", "mlp-hidden", "stage-layers"):
        assert entries[flag].count("(default") == 1, (flag, entries[flag])
    if command == "plan":
        assert "--mem-headroom FRACTION" in text and "(default 0.1: 8 GiB of 80;" in text
