"""The planner against this machine: taking a measured profile (`plan --calibrate`) and a
real run beside its prediction (`plan --measure`). The profile as the planner's rates
(`--machine`) is `plan.profile.ProfileRates`."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import meshtrain.cli.config as C
from meshtrain.cli.calibrate import calibrate, stderr_progress
from meshtrain.plan.planner import Device
from meshtrain.recipes import PRESETS, family_of


def calibrate_to(path: str) -> int:
    """`plan --calibrate`: measure, save, say where."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():  # found before a minute of measuring, not after
        print(f"meshtrain plan: error: --machine {path}: {parent} is not a folder", file=sys.stderr)
        return 2
    profile = calibrate(progress=stderr_progress)
    try:
        profile.save(path)
    except OSError as e:
        print(f"meshtrain plan: error: cannot write the machine profile to {path} ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"wrote the machine profile to {path}; use it with: meshtrain plan --machine {path} ...")
    return 0


def train_argv(cfg: C.Config, steps: int, out: str) -> list[str]:
    """`meshtrain train` flags for the run the configuration describes."""
    argv = []
    for flag, section, name, typ, _ in C.FLAGS:
        value = getattr(getattr(cfg, section), name)
        if name in ("steps", "out", "resume") or value is None or value == "":
            continue
        if name == "compile_backend" and not cfg.layout.compile:  # refused without --compile
            continue
        if typ is bool:
            argv.append(flag if value else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(value)]
    return argv + ["--steps", str(steps), "--out", out, "--json"]


MEASURE_STEPS = 8


def measure_beside(cfg: C.Config, work, lay: C.LayoutConfig, predicted: dict, args) -> int:
    """`plan --measure`: train the layout here for a few steps and print each rank's measured
    model states and activations beside the plan's, then the step time and the bubble."""
    if cfg.model.name not in PRESETS or family_of(PRESETS[cfg.model.name]).inputs != "tokens":
        print("meshtrain: error: --measure runs meshtrain's own presets (gpt-tiny, gpt-test, gpt-small, gpt2, "
              "llama-test, llama-small), not a published shape", file=sys.stderr)
        return 2
    cfg.layout = lay
    with tempfile.TemporaryDirectory(prefix="meshtrain-measure-") as tmp:
        argv = train_argv(cfg, MEASURE_STEPS, tmp)
        trace = str(Path(tmp, "trace.json"))
        if lay.pp > 1:
            argv += ["--trace", trace]
        print(f"meshtrain: measuring: meshtrain train {' '.join(argv)}", file=sys.stderr, flush=True)
        run = subprocess.run([sys.executable, "-m", "meshtrain", "train", *argv], capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            print(f"meshtrain: error: the measured run failed (exit {run.returncode})", file=sys.stderr)
            return run.returncode
        got = json.loads(run.stdout.strip().splitlines()[-1])
        bubble = _measured_bubble(trace) if lay.pp > 1 else 0.0
    rows = compare_ranks(work, lay, args.accounting, got)
    out = sys.stderr if args.json else sys.stdout
    print(f"{'rank':>4} {'stage':>5} {'states MiB plan':>16} {'measured':>9} {'act MiB plan':>13} {'measured':>9}",
          file=out)
    for r in rows:
        print(f"{r['rank']:>4} {r['stage']:>5} {r['model_state_plan'] / 2**20:>16.3f} "
              f"{r['model_state_measured'] / 2**20:>9.3f} {r['activation_plan'] / 2**20:>13.3f} "
              f"{r['activation_measured'] / 2**20:>9.3f}", file=out)
    step = got["step_time_median_s"]
    print(f"step time: predicted {predicted['predicted_step_time_s']:.4g} s, measured median {step:.4g} s "
          f"({predicted['predicted_step_time_s'] / step - 1:+.1%}); bubble: predicted "
          f"{predicted['bubble_fraction']:.3f}, measured {bubble:.3f}", file=out)
    if args.json:
        print(json.dumps({**predicted, "measured": {"ranks": rows, "step_time_median_s": step,
                                                    "bubble_fraction": bubble,
                                                    "comm_bytes_per_step": got["comm_bytes_per_step"]}}))
    return 0


def compare_ranks(work, lay: C.LayoutConfig, accounting: str, got: dict) -> list[dict]:
    """Per rank: the plan's model states and activations for its pipeline stage, and the run's."""
    d = Device(work, lay, accounting)
    rows = []
    for rank, (state, act) in enumerate(zip(got["model_state_bytes_per_rank"], got["activation_bytes_per_rank"])):
        stage = rank // (lay.dp * lay.cp * lay.tp)
        measured_state = state["total"] if isinstance(state, dict) else state
        rows.append({"rank": rank, "stage": stage, "model_state_plan": d.model_states(stage)["total"],
                     "model_state_measured": measured_state, "activation_plan": d.activations(stage),
                     "activation_measured": act})
    return rows


def _measured_bubble(trace_path: str) -> float:
    """The median over steps (after the first) of the traced timeline's idle fraction."""
    from meshtrain.parallel.pipeline.trace import measured_simulation
    trace = json.loads(Path(trace_path).read_text())
    steps = range(1, len(trace["steps"])) if len(trace["steps"]) > 1 else range(1)
    return statistics.median(float(measured_simulation(trace, i).bubble_fraction) for i in steps)

