"""`meshtrain plan`: the command line of the planner — what the flags mean, and the report.

The model, layout and batch flags are `train`'s (the same flags describe the same run), plus
the published architectures, explicit dimensions or `--params` alone, `--micro-batch-size`,
and the cluster. No processes are started (except by `--calibrate` and `--measure`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import meshtrain.cli.config as C
from meshtrain.cli.validate import adopt_imported_model
from meshtrain.cli.workload import checked_workload, preset_workload
from meshtrain.search_plan import SearchStore, binary_unit, layout_record, layout_table
from meshtrain.plan.cluster import GIB, GPU_PRESETS, Cluster, GpuRates, cluster_from
from meshtrain.plan.planner import ACCOUNTINGS, PlanError, Workload, plan
from meshtrain.plan.shapes import Shape
from meshtrain.recipes import PUBLISHED, family_of, is_preset, is_published
from meshtrain.plan.profile import MachineProfile, ProfileRates
from meshtrain.plan.model_states import model_state_bytes
from meshtrain.parallel.options import low_bit_bytes_per_element
from meshtrain.plan.search import search

EXPLICIT = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
CLUSTER_FLAGS = ("gpu_mem_gib", "gpus_per_node", "peak_tflops", "intra_node_gbps", "inter_node_gbps")
# What a device's memory holds besides the plan's tensors: the CUDA context (a few hundred MiB
# to ~1 GiB with cuBLAS and NCCL loaded), NCCL's buffers, and the caching allocator's reserve
# and fragmentation (a few % of a step's peak). `fits` means the plan's total fits the rest.
DEFAULT_HEADROOM = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (instead of --model)")
    g.add_argument("--layers", type=int, help="explicit GPT: blocks")
    g.add_argument("--hidden", type=int, help="explicit GPT: hidden size")
    g.add_argument("--heads", type=int, help="explicit GPT: attention heads")
    g.add_argument("--kv-heads", type=int, help="explicit GPT: key/value heads (grouped-query; default --heads)")
    g.add_argument("--ffn", type=int, help="explicit GPT: MLP width (default 4·hidden)")
    g.add_argument("--vocab", type=int, help="explicit GPT: vocabulary")
    g.add_argument("--params", type=float, help="only a parameter count (e.g. 7.5e9): model states, no activations")
    g = p.add_argument_group("batch and cluster")
    g.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (sets --microbatches)")
    g.add_argument("--gpus", type=int, help="devices (default dp×tp×pp)")
    g.add_argument("--gpu", help=f"GPU preset: {' | '.join(GPU_PRESETS)} (default h100-80g)")
    g.add_argument("--gpu-mem-gib", type=float, help="memory per device, GiB (the device's whole memory)")
    g.add_argument("--mem-headroom", type=float, metavar="FRACTION", help="the fraction of each device's memory "
                   "kept free for the CUDA context and the allocator's cache and fragmentation: a layout fits when "
                   f"its total is at most the rest (default {DEFAULT_HEADROOM:g}: 8 GiB of 80; 0 plans to the last "
                   "byte)")
    g.add_argument("--gpus-per-node", type=int, help="devices per node (tensor parallelism stays inside one)")
    g.add_argument("--peak-tflops", type=float, help="dense peak per device in the compute precision, TFLOP/s")
    g.add_argument("--intra-node-gbps", type=float, help="link per device inside a node, Gbit/s")
    g.add_argument("--inter-node-gbps", type=float, help="link per device across nodes, Gbit/s")
    g.add_argument("--machine", metavar="FILE", help="rates measured by --calibrate instead of a GPU preset")
    g = p.add_argument_group("planning")
    g.add_argument("--accounting", default="torch", help="torch (what meshtrain keeps; matches measurement) | "
                   "paper (the published tables: 16-bit activations, 1-byte dropout masks)")
    g.add_argument("--search", action="store_true", help="rank every valid layout of --gpus that fits")
    g.add_argument("--top", type=int, default=10, help="layouts shown by --search (default 10)")
    g.add_argument("--calibrate", action="store_true", help="measure this machine (under a minute) into "
                   "--machine FILE (default machine.json)")
    g.add_argument("--measure", action="store_true", help="run the layout here for a few steps and print the "
                   "prediction beside the measurement, per rank")


def _given(args, names) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def workload_of(args, cfg: C.Config) -> Workload:
    """The model and batch the flags describe (`--params` alone is handled by the caller)."""
    explicit = _given(args, EXPLICIT)
    tr = cfg.train
    if not explicit:
        return preset_workload(cfg, seq_given=args.seq_len is not None)
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "hidden", "heads", "vocab") if n not in explicit]
    if missing:
        raise PlanError(f"an explicit model needs {', '.join(missing)} too (or use --model)")
    if min(explicit.values()) < 1:
        raise PlanError("explicit model dimensions must be positive integers")
    if explicit["hidden"] % explicit["heads"] or explicit["heads"] % explicit.get("kv_heads", explicit["heads"]):
        raise PlanError("--hidden must divide by --heads, and --heads by --kv-heads")
    shape = Shape(explicit["layers"], explicit["hidden"], explicit["heads"], explicit["vocab"], tr.seq_len,
                  kv_heads=explicit.get("kv_heads"), ffn=explicit.get("ffn"))
    return checked_workload(cfg, shape, tr.seq_len)


def layout_of(args, cfg: C.Config, batch: int) -> tuple[C.LayoutConfig, int]:
    """The layout (dp filled from --gpus, micro-batches from --micro-batch-size) and the GPU count."""
    lay = replace(cfg.layout)
    if lay.precision not in C.PRECISIONS:
        raise PlanError(f"unknown precision '{lay.precision}'; use --precision {' | '.join(C.PRECISIONS)}")
    if lay.dp is None:
        if args.gpus is not None:
            if args.gpus < 1 or args.gpus % (lay.tp * lay.pp * lay.cp):
                raise PlanError(f"--gpus {args.gpus} is not a multiple of tp×pp×cp = {lay.tp}×{lay.pp}×{lay.cp}; "
                                "change --gpus, --tp, --pp or --cp")
            lay.dp = args.gpus // (lay.tp * lay.pp * lay.cp)
        else:
            C.fill_dp(lay, None)
    if args.micro_batch_size is not None:
        b = args.micro_batch_size
        if b < 1 or batch % (lay.dp * b):
            raise PlanError(f"--micro-batch-size {b} does not divide the {batch // lay.dp} sequences of each of the "
                            f"{lay.dp} data-parallel replicas")
        if args.microbatches is not None and args.microbatches != batch // (lay.dp * b):
            raise PlanError("--microbatches and --micro-batch-size disagree; give one of them")
        lay.microbatches = batch // (lay.dp * b)
    return lay, args.gpus or lay.world_size


def machine_of(args, cluster: Cluster, precision: str, world: int):
    """The rates: a measured profile (--machine) or the cluster's roofline."""
    if not args.machine:
        return GpuRates(cluster, precision), cluster.peak_flops(precision)
    try:
        profile = MachineProfile.load(args.machine)
    except ValueError as e:
        raise PlanError(str(e)) from None
    rates = ProfileRates(profile, world)
    return rates, rates.peak_flops(precision)


def _trainer_device(args, cfg: C.Config, machine) -> str:
    """Where the planned run trains ("cpu" or "cuda"): the profiled machine's device, here
    under --measure, else a GPU of the cluster."""
    profile = getattr(machine, "profile", None)
    if profile is not None:
        return "cpu" if profile.device == "cpu" else "cuda"
    if args.measure:
        import torch
        device = cfg.train.device
        return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
    return "cuda"


def headroom_of(args) -> float:
    """--mem-headroom: the fraction of each device's memory a plan leaves free."""
    headroom = DEFAULT_HEADROOM if args.mem_headroom is None else args.mem_headroom
    if not 0 <= headroom < 1:
        raise PlanError(f"--mem-headroom {headroom:g}: give the fraction of each device's memory kept free, from 0 "
                        f"to below 1 (default {DEFAULT_HEADROOM:g}, 8 GiB of 80)")
    return headroom


def budget(device_bytes: float | None, headroom: float) -> dict:
    """The memory a plan may fill: the device's less the headroom (None: no device given)."""
    usable = None if device_bytes is None else device_bytes * (1 - headroom)
    return {"device_memory_bytes": device_bytes, "mem_headroom": headroom, "usable_bytes": usable}


def budget_line(result: dict) -> str:
    """What `fits` was judged against, for beside the verdict."""
    device, usable = result["device_memory_bytes"], result["usable_bytes"]
    return (f"in {usable / GIB:,.1f} GiB ({device / GIB:g} less --mem-headroom {result['mem_headroom']:g}, kept "
            f"for the CUDA context and the allocator)")


def describe(name: str, work: Workload | None, lay: C.LayoutConfig, result: dict, cluster_line: str) -> str:
    """The human report of one plan."""
    lines = [f"{name}: {result['n_params']:,} parameters" + (
        f", seq {work.seq}, global batch {work.batch} (micro-batch {result['micro_batch_size']})" if work else ""),
        f"layout: {lay.short()} recompute={lay.recompute}", f"cluster: {cluster_line}"]
    if result.get("n_active_params") is not None:  # a mixture of experts
        e_unit, e_size = binary_unit(result["expert_state_bytes"])
        lines.insert(1, f"  {result['n_active_params']:,} active per token; the experts: "
                        f"{result['expert_params_per_device']:,} parameters and {result['expert_state_bytes'] / e_size:,.2f} "
                        f"{e_unit} of state per device "
                        + (f"(1/{lay.ep} of them: split over ep)" if lay.ep > 1 else "(whole over tp)"))
    states = result["model_state_bytes"]
    stage = f" (stage {result['worst_stage']}, the fullest)" if lay.pp > 1 else ""
    unit, size = binary_unit(result["total_bytes"])
    lines.append(f"memory per device{stage}, {unit}:")
    for part in ("params", "grads", "master", "optimizer", "gathered"):
        if states.get(part):
            lines.append(f"  {part:<22}{states[part] / size:>12,.2f}")
    if result["activation_bytes"] is not None:
        per_layer_unit, per_layer_size = binary_unit(result["activation_bytes_per_layer"])
        lines.append(f"  {'activations':<22}{(result['total_bytes'] - states['total']) / size:>12,.2f}   "
                     f"({result['activation_bytes_per_layer'] / per_layer_size:,.1f} {per_layer_unit} kept per "
                     f"layer and micro-batch)")
    verdict = {True: "fits", False: "does NOT fit", None: ""}[result["fits"]]
    if result["fits"] is not None and result.get("usable_bytes") is not None:
        verdict += f" {budget_line(result)}"
    lines.append(f"  {'total':<22}{result['total_bytes'] / size:>12,.2f}   {verdict}")
    if result["predicted_step_time_s"] is not None:
        sent = {axis: nbytes for axis, nbytes in result["comm_bytes_per_step"].items() if nbytes}
        comm_unit, comm_size = binary_unit(max(sent.values(), default=0))
        comm = ", ".join(f"{axis} {nbytes / comm_size:,.2f}" for axis, nbytes in sent.items())
        parts = ", ".join(f"{k} {v:.3g}" for k, v in result["time_s"].items() if v > 0)
        mfu = f", MFU {100 * result['mfu']:.1f} %" if result["mfu"] is not None else ""
        lines += [f"model FLOPs per step {result['flops_per_step']:.3e} (executed, with recompute: "
                  f"{result['hardware_flops_per_step']:.3e}); pipeline bubble {100 * result['bubble_fraction']:.1f} %",
                  f"sent per step and device, {comm_unit}: {comm or 'nothing'}",
                  f"predicted step time {result['predicted_step_time_s']:.4g} s ({parts}){mfu}"]
    return "\n".join(lines)


def params_only(args, cfg: C.Config, lay: C.LayoutConfig, limits: dict) -> dict:
    """`--params N`: model states only, the parameters split evenly over tp·pp, judged
    against the usable memory of `limits` (`budget`)."""
    if args.params < 1:
        raise PlanError(f"--params {args.params:g}: give a positive parameter count")
    optimizer = cfg.train.optimizer  # a low-bit one: every parameter at its bytes (no shape says which are vectors)
    states = model_state_bytes(args.params / (lay.tp * lay.pp), lay.zero, lay.dp * lay.cp, precision=lay.precision,
                               grad_dtype=lay.grad_dtype, accounting=args.accounting,
                               optimizer_bytes=low_bit_bytes_per_element(optimizer) if optimizer != "adamw" else 8)
    return {"n_params": int(args.params), "model_state_bytes": states, "activation_bytes": None,
            "activation_bytes_per_layer": None, "total_bytes": states["total"],
            "fits": states["total"] <= limits["usable_bytes"], "flops_per_step": None, "bubble_fraction": None,
            "comm_bytes_per_step": None, "predicted_step_time_s": None, "mfu": None, "micro_batch_size": None,
            "worst_stage": 0, **limits}


def run(args, cfg: C.Config) -> int:
    try:
        return _run(args, cfg)
    except (PlanError, C.ConfigError) as e:
        print(f"meshtrain: error: {e}", file=sys.stderr)
        return 2


def _run(args, cfg: C.Config) -> int:
    if ":" in cfg.model.name:
        raise PlanError(f"plan models the presets and shapes; --model {cfg.model.name} is your own: give the planner "
                        f"a preset of its shape (--model NAME)")
    if args.calibrate:
        from meshtrain.cli.measured import calibrate_to
        return calibrate_to(args.machine or "machine.json")
    if args.top < 1:
        raise PlanError(f"--top {args.top}: show at least one layout")
    if args.accounting not in ACCOUNTINGS:
        raise PlanError(f"unknown accounting '{args.accounting}'; use --accounting paper | torch")
    out = sys.stderr if args.json else sys.stdout
    headroom = headroom_of(args)
    adopt_imported_model(cfg)  # --init-from DIR: plan that folder's model (a preset named after it)
    work = None if args.params is not None else workload_of(args, cfg)
    lay, gpus = layout_of(args, cfg, cfg.train.batch_size)
    try:
        cluster = cluster_from(args.gpu, gpus=gpus, **_given(args, CLUSTER_FLAGS))
    except ValueError as e:
        raise PlanError(str(e)) from None
    if cluster.gpus_per_node < 1:
        raise PlanError("--gpus-per-node must be positive")
    cluster_line = f"{gpus} × {cluster.name}, {cluster.gpu_mem_gib:g} GiB each, {cluster.gpus_per_node} per node"
    name = cfg.model.name if work is None or not _given(args, EXPLICIT) else "explicit GPT"
    if work is None:
        if args.search or args.measure:
            raise PlanError("--search and --measure need a model (--model or explicit dimensions), not --params")
        result = params_only(args, cfg, lay, budget(cluster.memory_bytes, headroom))
        print(describe(f"{args.params:g} parameters", None, lay, result, cluster_line), file=out)
        return _emit(args, dict(result, train_command=None))
    machine, peak = machine_of(args, cluster, lay.precision, gpus)
    work = replace(work, device=_trainer_device(args, cfg, machine))
    if args.machine:
        cluster_line = f"{gpus} ranks on the machine profiled in {args.machine}"
    options = dict(gpus_per_node=cluster.gpus_per_node, peak_flops=peak, accounting=args.accounting)
    limits = budget(None if args.machine and args.gpu_mem_gib is None else cluster.memory_bytes, headroom)
    memory = limits["usable_bytes"]
    if args.search:
        return _search(args, cfg, work, lay, gpus, machine, limits, options, name, cluster_line, out)
    if lay.world_size != gpus:
        raise PlanError(f"dp×cp×tp×pp = {lay.dp}×{lay.cp}×{lay.tp}×{lay.pp} = {lay.world_size}, not the {gpus} "
                        f"GPUs of --gpus; change --dp/--cp/--tp/--pp so that their product is {gpus}")
    result = dict(plan(work, lay, machine, memory_bytes=memory, **options), **limits)
    print(describe(name, work, lay, result, cluster_line), file=out)
    if args.measure:
        from meshtrain.cli.measured import measure_beside
        return measure_beside(cfg, work, lay, result, args)
    command = train_command(args, cfg, work, lay, gpus, cluster.gpus_per_node, out)
    return _emit(args, dict(result, train_command=command))


def _search(args, cfg, work, base, gpus, machine, limits, options, name, cluster_line, out) -> int:
    import time

    memory = limits["usable_bytes"]
    if memory is None:
        raise PlanError("--search needs the device memory: give --gpu-mem-gib (or a --gpu preset)")
    t0 = time.perf_counter()
    found = search(work, gpus, machine, memory_bytes=memory, base=base, top=args.top, **options)
    took = time.perf_counter() - t0
    if not found["best"]:
        if not found["tried"]:
            raise PlanError(f"no layout of {gpus} devices can run this model and batch (tp must divide the heads, "
                            "pp the blocks, dp the batch); change --gpus or --batch-size")
        least, device = found["least_bytes"], limits["device_memory_bytes"]
        raise PlanError(f"{name} does not fit on {gpus} devices of {device / GIB:g} GiB in any layout: the smallest "
                        f"needs {least / GIB:,.1f} GiB per device, {(least - memory) / GIB:,.1f} GiB more than the "
                        f"{memory / GIB:,.1f} usable (--mem-headroom {limits['mem_headroom']:g}); use more devices "
                        "or larger ones")
    print(f"searched {found['tried']} layouts of {gpus} devices in {took:.2f} s; {found['fit']} fit in "
          f"{memory / GIB:,.1f} GiB ({limits['device_memory_bytes'] / GIB:g} GiB less --mem-headroom "
          f"{limits['mem_headroom']:g}). Fastest first:", file=out)
    measured = measured_here(cfg, gpus, found["best"], args.machine)
    print(search_table(found["best"], measured), file=out)
    best_lay, best = found["best"][0]
    best = dict(best, **limits)
    print("\nthe best, explained:", file=out)
    print(describe(name, work, best_lay, best, cluster_line), file=out)
    command = train_command(args, cfg, work, best_lay, gpus, options["gpus_per_node"], out)
    result = dict(best, layout=best_lay.summary() | {"chunks": best_lay.chunks}, train_command=command,
                  search={"tried": found["tried"], "fit": found["fit"], "seconds": round(took, 3),
                          "top": [{"layout": lay.summary() | {"chunks": lay.chunks},
                                   "micro_batch_size": r["micro_batch_size"], "total_bytes": r["total_bytes"],
                                   "predicted_step_time_s": r["predicted_step_time_s"], "mfu": r["mfu"], **m}
                                  for (lay, r), m in zip(found["best"], measured)]})
    return _emit(args, result)


def measured_here(cfg: C.Config, gpus: int, best: list, machine: str | None) -> list[dict]:
    """For each ranked layout, what this machine measured of it (`measured_step_s`,
    `measured_peak_bytes`; empty where nothing was) in a layout search of the same model,
    batch and world with the same --machine profile (`search_plan.SearchStore`)."""
    from meshtrain.cli.layout_search import search_key

    stored = SearchStore().measured(search_key(cfg, gpus, f"the profile {machine}")) if machine else {}
    keys = ("measured_step_s", "measured_peak_bytes")
    return [{k: v for k, v in stored.get(json.dumps(layout_record(lay), sort_keys=True), {}).items() if k in keys}
            for lay, _ in best]


def search_table(best: list, measured: list[dict]) -> str:
    """The ranked layouts in `train --layout-search`'s table, with what this machine measured
    beside the predictions, and each one's MFU."""
    rows = []
    for (lay, r), m in zip(best, measured):
        mfu = f"MFU {100 * r['mfu']:.1f} %" if r["mfu"] is not None else ""
        rows.append((lay, r["micro_batch_size"], r["total_bytes"], r["predicted_step_time_s"],
                     m.get("measured_peak_bytes"), m.get("measured_step_s"), mfu))
    return layout_table(rows)


def train_flags(cfg: C.Config, work: Workload, lay: C.LayoutConfig) -> tuple[list[str] | None, str | None]:
    """`meshtrain train`'s flags for this plan's model, layout and batch (None where `train`
    cannot build the model), and a note on what to fill in or why there are none."""
    name, m, note = cfg.model.name, cfg.model, None
    if m.init_from:
        model = ["--init-from", m.init_from]
    elif is_published(name) and family_of(PUBLISHED[name][0]).hf_folders:
        folder = name.upper().replace("-", "_") + "_DIR"
        model = ["--init-from", folder]
        note = (f"{folder}: a Hugging Face folder of {name}'s architecture (config.json, safetensors, "
                f"tokenizer.json); --model {name} is a shape the planner knows, not a model train builds")
    elif name in PUBLISHED or not is_preset(name):
        what = "the paper's shape (biases, a tied head)" if name in PUBLISHED else "a shape, not a model"
        return None, f"no train command: {name} is {what}, which meshtrain does not build"
    else:
        model = ["--model", name]
        if cfg.train.vocab_size != C.TrainConfig.vocab_size:
            model += ["--vocab-size", str(cfg.train.vocab_size)]
    flags = model + ["--dp", str(lay.dp), "--tp", str(lay.tp), "--pp", str(lay.pp)]
    if lay.cp > 1:
        flags += ["--cp", str(lay.cp), "--cp-mode", lay.cp_mode]
    if lay.ep > 1:
        flags += ["--ep", str(lay.ep)]
    if lay.zero:
        flags += ["--zero", str(lay.zero)] + (["--keep-gathered"] if lay.keep_gathered else [])
    if lay.sp:
        flags.append("--sp")
    if lay.pp > 1:
        flags += ["--schedule", lay.schedule] + (["--chunks", str(lay.chunks)] if lay.chunks > 1 else [])
        flags += ["--stage-layers", lay.stage_layers] if lay.stage_layers else []
    if lay.microbatches > 1:
        flags += ["--microbatches", str(lay.microbatches)]
    if lay.recompute != "none":
        flags += ["--recompute", lay.recompute]
    if lay.precision != "fp32":
        flags += ["--precision", lay.precision]
    if lay.grad_dtype != "fp32":
        flags += ["--grad-dtype", lay.grad_dtype]
    if lay.dp_linear_sync != "allreduce":
        flags += ["--dp-linear-sync", lay.dp_linear_sync]
    if work.dropout:
        flags += ["--dropout", f"{work.dropout:g}"]
    if work.attention != "sdpa":
        flags += ["--attention", work.attention]
    return flags + ["--seq-len", str(work.seq), "--batch-size", str(work.batch)], note


def train_command(args, cfg: C.Config, work: Workload, lay: C.LayoutConfig, gpus: int, per_node: int,
                  out) -> str | None:
    """Print (and return) the `meshtrain train` line of the planned layout, to copy."""
    import shlex
    if _given(args, EXPLICIT):
        flags, note = None, "no train command: explicit dimensions are a shape, not a model meshtrain builds"
    else:
        flags, note = train_flags(cfg, work, lay)
    command = shlex.join(["meshtrain", "train", *flags]) if flags else None
    if command:
        print(f"\nto train this layout:\n  {command}", file=out)
        if gpus > per_node:
            nodes = -(-gpus // per_node)
            print(f"  ({gpus} ranks on {nodes} nodes: from a shell meshtrain starts ranks on its own machine "
                  f"only; start them with a launcher, the same flags: torchrun --nnodes {nodes} --nproc-per-node "
                  f"{per_node} --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m meshtrain train ..., srun or "
                  f"mpirun)", file=out)
    if note:
        print(("  " if command else "\n") + note, file=out)
    return command


def _emit(args, result: dict) -> int:
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
