import time
from pathlib import Path

import pytest
from helpers import run_cli, run_main

from meshtrain.cli import config as C
from meshtrain.cli.validate import validate


def cfg(**sections):
    c = C.Config()
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(c, section), k, v)
    return c


@pytest.mark.parametrize("sections, world, fix", [
    ({"layout": {"dp": 2}}, 3, "--dp/--cp/--tp/--pp"),
    ({"layout": {"cp": 0}}, None, "--cp 0"),
    ({"layout": {"dp": 1, "cp": 2}}, 3, "dp×cp×tp×pp = 1×2×1×1 = 2"),
    ({"layout": {"dp": 1, "cp": 2}, "train": {"seq_len": 30}}, None, "--seq-len 30 does not split into 2·cp = 4"),
    ({"model": {"name": "gpt-test"}, "layout": {"dp": 1, "cp": 8, "cp_mode": "ulysses"}, "train": {"seq_len": 32}},
     None, "the 4 heads of gpt-test do not split over --cp 8"),
    ({"model": {"name": "llama-test"}, "layout": {"dp": 1, "cp": 4, "cp_mode": "ulysses"}, "train": {"seq_len": 32}},
     None, "the 2 kv heads of llama-test do not split over --cp 4"),
    ({"layout": {"dp": 1, "cp": 2, "cp_mode": "zigzag"}}, None, "use --cp-mode ring | ulysses"),
    ({"model": {"name": "mlp"}, "train": {"data": "digits"}, "layout": {"dp": 1, "cp": 2}}, None,
     "mlp has none (meshtrain's GPT and Llama presets do): drop --cp"),
    ({"model": {"dropout": 0.1, "attention": "math"}, "layout": {"dp": 1, "cp": 2}}, None,
     "--dropout 0.1 with --cp and --attention math"),
    ({"model": {"name": "llama-test"}, "layout": {"dp": 1, "cp": 2, "tp": 2, "cp_mode": "ulysses"},
      "train": {"seq_len": 32}}, None, "the 2 kv heads of llama-test (1 per tp rank) do not split over --cp 2"),
    ({"model": {"name": "gpt-test"}, "layout": {"dp": 1, "cp": 2, "tp": 4, "sp": True}, "train": {"seq_len": 36}},
     None, "a rank's 18 tokens do not split over --tp 4"),
    ({"model": {"name": "gpt-huge"}}, None, "--model"),
    ({"layout": {"schedule": "zigzag"}}, None, "--schedule"),
    ({"train": {"data": "/no/such/file.txt"}}, None, "--data"),
    ({"train": {"batch_size": 10}, "layout": {"dp": 2, "microbatches": 4}}, None, "multiple of 8"),
    ({"layout": {"dp": 0}}, None, "--dp 0"),
    ({"train": {"steps": -1}}, None, "--steps -1"),
    ({"train": {"seq_len": 0}}, None, "--seq-len 0"),
    ({"train": {"lr": 0.0}}, None, "--lr"),
    ({"layout": {"zero": 4}}, None, "--zero"),
    ({"model": {"name": "mlp"}}, None, "--data digits"),
    ({"train": {"seq_len": 4096}}, None, "--seq-len 4096"),
    ({"layout": {"tp": 3, "dp": 1}}, None, "use --tp 1, 2, 4, 8"),
    ({"train": {"resume": True, "resume_from": "x"}}, None, "give one"),
    ({"train": {"overwrite": True, "resume_from": "x"}}, None, "--overwrite starts a fresh run (moving another run's "
     "checkpoints aside) and --resume-from continues one; give one"),
    ({"train": {"overwrite": True, "resume": True}}, None, "and --resume continues one; give one"),
    ({"layout": {"compile_backend": "aot_eager"}}, None, "--compile-backend aot_eager chooses how --compile compiles; "
     "add --compile, or drop --compile-backend"),
    ({"layout": {"recompute": "segments:0"}}, None, "use --recompute none | full | selective | segments[:K]"),
    ({"layout": {"dp_linear_sync": "sometimes"}}, None, "use --dp-linear-sync allreduce | allgather | auto"),
    ({"layout": {"zero": -1}}, None, "use --zero 0, 1, 2 or 3"),
    ({"layout": {"precision": "fp16"}}, None, "use --precision fp32 | bf16"),
    ({"layout": {"grad_dtype": "fp16"}}, None, "use --grad-dtype compute | fp32"),
    ({"layout": {"zero": 2, "keep_gathered": True}}, None, "--keep-gathered applies to --zero 3"),
    ({"model": {"name": "gpt-tiny"}, "layout": {"pp": 4, "dp": 1, "microbatches": 4}}, None,
     "fewer than pp×chunks = 4×1"),
    ({"layout": {"pp": 2, "dp": 1, "microbatches": 2, "chunks": 2}}, None, "needs --schedule interleaved"),
    ({"train": {"batch_size": 12}, "layout": {"pp": 2, "dp": 1, "microbatches": 3, "schedule": "interleaved"}}, None,
     "use --microbatches a multiple of 2"),
    ({"layout": {"pp": 2, "dp": 1, "microbatches": 2, "stage_layers": "1,1,1"}}, None, "give pp×chunks = 2"),
    ({"layout": {"pp": 2, "dp": 1, "microbatches": 2, "stage_layers": "a,b"}}, None, "comma-separated"),
    ({"model": {"name": "gpt-test"}, "layout": {"tp": 8, "dp": 1}}, None, "the 4 heads of gpt-test; use --tp 1, 2, 4"),
    ({"model": {"name": "gpt-tiny"}, "train": {"vocab_size": 301}, "layout": {"tp": 2, "dp": 1}}, None,
     "does not divide the 301 vocabulary"),
    ({"model": {"name": "mlp"}, "train": {"data": "digits"}, "layout": {"tp": 3, "dp": 1}}, None,
     "does not divide the 128 hidden width"),
    ({"layout": {"sp": True}}, None, "use --tp 2 or more with --sp"),
    ({"model": {"name": "gpt-tiny"}, "train": {"seq_len": 30}, "layout": {"tp": 4, "dp": 1, "sp": True}}, None,
     "--seq-len 30 is not divisible by --tp 4"),
    ({"model": {"name": "mlp"}, "train": {"data": "digits"}, "layout": {"tp": 2, "dp": 1, "sp": True}}, None,
     "has none: drop --sp"),
    ({"model": {"dropout": 1.0}}, None, "--dropout 1.0"),
    ({"model": {"dropout": -0.1}}, None, "--dropout -0.1"),
    ({"model": {"attention": "flash"}}, None, "--attention sdpa | math"),
    ({"train": {"seed": -1}}, None, "--seed -1"),
    ({"train": {"timeout": 0}}, None, "--timeout 0"),
    ({"train": {"device": "tpu"}}, None, "--device auto | cpu | cuda"),
    ({"layout": {"tp": 2}}, 3, "not a multiple of tp×pp"),
])
def test_validation_names_the_flag(sections, world, fix):
    with pytest.raises(C.ConfigError) as e:
        validate(cfg(**sections), world_size=world)
    assert fix in str(e.value)
    assert "\n" not in str(e.value)


def test_defaults_are_valid():
    validate(C.Config())
    validate(C.Config(), world_size=2)


def test_compile_backend_is_refused_without_compile_even_at_its_default():
    with pytest.raises(C.ConfigError, match="add --compile, or drop --compile-backend"):
        validate(C.load(None, {("layout", "compile_backend"): "inductor"}))
    validate(C.load(None, {("layout", "compile_backend"): "aot_eager", ("layout", "compile"): True}))


@pytest.mark.parametrize("layout, world, dp", [({}, None, 2), ({"pp": 2}, None, 1), ({"tp": 4}, None, 1),
                                               ({}, 8, 8), ({"tp": 2, "pp": 2}, 8, 2), ({"dp": 3}, None, 3)])
def test_unset_dp_fills_the_world(layout, world, dp):
    """Under a launcher world ÷ (tp·pp); from a shell 2 for the default job, else 1."""
    lay = C.LayoutConfig(**layout)
    C.fill_dp(lay, world)
    assert lay.dp == dp


def _cli_config(*argv):
    from meshtrain.cli import build_parser
    return C.from_args(build_parser().parse_args([str(a) for a in argv]))


def test_flags_switch_off_what_the_toml_switched_on(tmp_path):
    f = tmp_path / "on.toml"
    f.write_text("[layout]\nsp = true\n[train]\nresume = true\n")
    on = _cli_config("train", "--config", f)
    off = _cli_config("train", "--config", f, "--no-sp", "--no-resume")
    assert (on.layout.sp, on.train.resume) == (True, True)
    assert (off.layout.sp, off.train.resume) == (False, False)


def test_verify_and_bench_take_steps_from_toml_unless_the_flag_is_given(tmp_path):
    f = tmp_path / "steps.toml"
    f.write_text("[train]\nsteps = 7\n")
    assert _cli_config("verify").train.steps == 10  # the command's own default
    assert _cli_config("verify", "--config", f).train.steps == 7
    assert _cli_config("bench", "--vs", "ddp", "--config", f).train.steps == 7
    assert _cli_config("verify", "--config", f, "--steps", "3").train.steps == 3


def test_toml_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[layout]\ndp = 4\nmicrobatches = 2\n[train]\nsteps = 7\nlr = 3e-4\n[model]\nname = "gpt-tiny"\n')
    c = C.load(str(f), {("train", "steps"): 9})
    assert (c.layout.dp, c.layout.microbatches, c.train.steps, c.train.lr, c.model.name) == (4, 2, 9, 3e-4, "gpt-tiny")


@pytest.mark.parametrize("text, fix", [("[layout]\ndpp = 2\n", "unknown key 'dpp'"),
                                       ("[trian]\nsteps = 2\n", "unknown section"),
                                       ("[layout]\ndp = 'two'\n", "must be int"),
                                       ("[layout\n", "not valid TOML")])
def test_bad_toml(tmp_path, text, fix):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(C.ConfigError, match=fix):
        C.load(str(f), {})


def test_lr_schedule_warms_up_then_decays():
    tr = C.TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [C.lr_at(s, tr) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


def _bad_inputs(tmp: Path) -> list[tuple[list, str]]:
    (tmp / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (tmp / "binary.toml").write_bytes(b"\xff\xfe[layout]\x00\x81")
    (tmp / "a-file").write_text("not a folder")
    cases = [
        (["train", "--dp", "0"], "--dp 0"),
        (["train", "--model", "gpt-huge"], "unknown model"),
        (["train", "--schedule", "zigzag"], "unknown schedule"),
        (["train", "--data", "/no/such/path"], "no such file"),
        (["verify", "--dp", "3", "--batch-size", "8"], "not divisible"),
        (["bench", "--vs", "horovod"], "unknown peer"),
        (["train", "--seed", "-1"], "--seed -1"),
        (["train", "--timeout", "-5"], "--timeout -5.0: must be a positive number of seconds"),
        (["train", "--model", "mlp", "--data", "digits", "--mlp-hidden", "200000,200000", "--dp", "1"],
         "building its part takes 4 bytes × 40.02 B parameters"),
        (["train", "--device", "tpu"], "unknown device 'tpu'"),
        (["train", "--model", "gpt-tiny", "--vocab-size", "256", "--device", "cpu", "--data", tmp / "binary.txt"],
         "not UTF-8 text"),
        (["train", "--config", tmp / "binary.toml"], "--config"),
        (["train", "--model", "gpt-tiny", "--out", tmp / "a-file" / "run"], "--out"),
        (["generate", "--ckpt", tmp, "--top-k", "-1"], "--top-k -1"),
        (["generate", "--ckpt", tmp, "--device", "tpu"], "unknown device"),
        (["train", "--trace", tmp / "t.json"], "use --pp 2 or more"),
        (["bench", "--vs", "torch-pp", "--dp", "2"], "use --pp 2 or more, --dp 1 and --tp 1"),
        (["bench", "--vs", "fsdp2", "--dp", "2"], "use --zero 3, --dp 2 or more"),
        (["bench", "--vs", "zero1", "--zero", "1", "--dp", "2", "--precision", "bf16"], "runs in fp32 only"),
        (["schedule"], "give --pp and --microbatches"),
        (["schedule", "--trace", tmp / "no-such.json"], "cannot read it"),
        (["schedule", "--trace", tmp / "binary.toml"], "not a trace written by `meshtrain train --trace`"),
    ]
    import torch
    if not torch.cuda.is_available():
        cases.append((["train", "--device", "cuda"], "no CUDA device"))
    return cases


def _refused_in_one_line(args, fix, r, seconds):
    assert r.returncode == 2, (args, r.stderr)
    assert "Traceback" not in r.stderr, (args, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtrain: error:") and fix in lines[0], (args, r.stderr)
    assert "starting" not in r.stderr  # rejected before any rank starts
    assert seconds < 30


def test_cli_rejects_bad_input_in_one_line(tmp_path):
    """Each refusal through the command line's `main`, in this process (the same code as
    `python -m meshtrain`; the next test runs two of them as real processes)."""
    for args, fix in _bad_inputs(tmp_path):
        t0 = time.perf_counter()
        r = run_main(*args)
        _refused_in_one_line(args, fix, r, time.perf_counter() - t0)


def test_a_refusal_from_a_shell_is_one_line_and_exit_code_2(tmp_path):
    """From a fresh interpreter: one refusal found by the flags alone, one found by reading
    the data (the interpreter's exit code and its whole stderr)."""
    cases = [case for case in _bad_inputs(tmp_path) if case[1] in ("--dp 0", "not UTF-8 text")]
    assert len(cases) == 2
    for args, fix in cases:
        t0 = time.perf_counter()
        r = run_cli(*args, timeout=60)
        _refused_in_one_line(args, fix, r, time.perf_counter() - t0)


def test_world_size_mismatch_under_torchrun():
    r = run_cli("--nproc-per-node", "2", "-m", "meshtrain", "train", "--dp", "4", "--model", "gpt-tiny",
                launcher=("-m", "torch.distributed.run"), timeout=120)
    assert r.returncode != 0
    assert "the launcher started 2 processes but dp×cp×tp×pp" in r.stderr


def test_cli_rejects_text_too_short_for_the_sequence(tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    r = run_cli("train", "--data", tmp_path / "short.txt", "--model", "gpt-tiny", "--vocab-size", "256", "--device", "cpu",
                timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("meshtrain: error: the text has 9 tokens")
