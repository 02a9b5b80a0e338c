"""`meshtrain plan`: the planner against the trainer (its `torch` accounting of memory and its
traffic, per rank), against the papers (`paper` accounting, FLOPs), its closed forms
against the simulator, its search against brute force, and its command line."""

import itertools
import resource
import time
from dataclasses import replace

import pytest
from helpers import last_json, run_cli, small_config

from meshtrain.cli.config import LayoutConfig
from meshtrain.plan import traffic
from meshtrain.plan.cluster import GPU_PRESETS, GpuRates
from meshtrain.plan.cost import hardware_flops, model_flops
from meshtrain.plan.planner import Device, PlanError, Workload, bubble_fraction, plan
from meshtrain.plan.search import search
from meshtrain.plan.shapes import Shape
from meshtrain.recipes import published_shapes, shape_of

CONTRACT = ("n_params", "model_state_bytes", "activation_bytes", "activation_bytes_per_layer", "total_bytes", "fits",
            "flops_per_step", "bubble_fraction", "comm_bytes_per_step", "predicted_step_time_s", "mfu")
H100 = GPU_PRESETS["h100-80g"]


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 4)])
def test_bubble_closed_forms_are_the_simulators(name, chunks):
    from meshtrain.parallel.pipeline.schedules import schedule
    from meshtrain.parallel.pipeline.simulate import simulate

    for p, m in [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 16)]:
        simulated = simulate(schedule(name, p, m, chunks), chunks).bubble_fraction
        assert bubble_fraction(name, p, m, chunks) == pytest.approx(float(simulated), abs=1e-12), (p, m)


def test_model_flops_are_megatrons_and_hardware_flops_narayanans_eq_3():
    """Narayanan et al. (2021): model FLOPs 72·B·s·l·h²(1 + s/6h + V/12lh); with full
    recompute the executed FLOPs are eq. 3's 96·B·s·l·h²(1 + s/6h + V/16lh)."""
    gpt3 = published_shapes()["gpt3-175b"]
    B, s, l, h, V = 1536, 2048, gpt3.layers, gpt3.hidden, gpt3.vocab
    assert model_flops(gpt3, B, s) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))
    assert hardware_flops(gpt3, B, s, "full") == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))
    from meshtrain.recipes import PRESETS
    from meshtrain.recipes.gpt import flops_per_step
    assert model_flops(shape_of("gpt-small", 2048), 8, 128) == pytest.approx(
        flops_per_step(PRESETS["gpt-small"], 2048, 8, 128))


def test_paper_accounting_of_a_plan_is_korthikantis_table_2():
    """paper accounting: GPT-3 175B at t = 8 with SP and selective recompute keeps
    34·s·b·h/t per layer (Korthikanti et al. 2022, Table 2); under full recompute 2·s·b·h/t."""
    gpt3 = published_shapes()["gpt3-175b"]
    work = Workload(gpt3, 64, 2048, attention="math")
    sbh = 2048 * 1 * gpt3.hidden
    for recompute, per_layer in (("selective", 34 * sbh / 8), ("full", 2 * sbh / 8)):
        lay = LayoutConfig(dp=1, tp=8, pp=8, sp=True, microbatches=64, recompute=recompute, precision="bf16")
        assert Device(work, lay, "paper").activation_per_layer() == pytest.approx(per_layer)


def _measured(mesh, cfgs):
    from meshtrain.comm import Comm
    from meshtrain.train import train

    out = []
    for cfg in cfgs:
        r = train(cfg, Comm(mesh))
        gathered = r.model_state.get("gathered", 0) if isinstance(r.model_state, dict) else 0
        out.append((r.model_state["total"], r.activation_bytes, gathered, r.comm_detail_per_step))
    return out


def _by_kind(transfers) -> dict:
    kinds = {x.kind for x in transfers}
    return {k: sum(x.total for x in transfers if x.kind == k) for k in kinds}


@pytest.mark.parametrize("world, sizes, layouts", [
    (2, {}, [dict(dp=2, zero=z, microbatches=2) for z in range(4)] + [dict(dp=2, zero=3, keep_gathered=True)]
     + [dict(dp=2, recompute="full"), dict(dp=2, recompute="segments", microbatches=2), dict(dp=2, zero=3, recompute="full")]),
    (2, {"tp": 2}, [dict(dp=1, tp=2, microbatches=2), dict(dp=1, tp=2, sp=True, microbatches=2),
                    dict(dp=1, tp=2, recompute="full"), dict(dp=1, tp=2, sp=True, recompute="full"),
                    dict(dp=1, tp=2, recompute="segments"), dict(dp=1, tp=2, sp=True, recompute="selective")]),
    (2, {"pp": 2}, [dict(dp=1, pp=2, microbatches=4), dict(dp=1, pp=2, microbatches=4, recompute="selective"),
                    dict(dp=1, pp=2, microbatches=4, schedule="interleaved", chunks=2)]),
], ids=["dp2-zero0-3", "tp2-sp-recompute", "pp2"])
def test_the_plan_is_what_each_rank_of_the_trainer_holds_and_sends(world, sizes, layouts):
    """torch accounting: per rank of a real run (gpt-test, fp32, one step), the plan's model
    states within 5 % (ZeRO pads each flat group), its activations within 5 % (measured:
    exact to a few bytes), and its bytes sent per axis and collective exactly. Under ZeRO-3
    the meter also sees some of the parameter buffers gathered during the step (the plan
    counts them all as model states): the measurement lies between the plan's activations
    and those plus the gathered peak. Interleaved activations are not measured here."""
    from distributed import run_ranks

    cfgs = [small_config("gpt-test", 1, 8, **layout) for layout in layouts]
    for rank, per in enumerate(run_ranks(_measured, world, cfgs, **sizes)):
        for cfg, (state, act, gathered, sent) in zip(cfgs, per):
            lay = cfg.layout
            stage = rank // (lay.dp * lay.tp)
            d = Device(Workload(shape_of("gpt-test", 256), cfg.train.batch_size, cfg.train.seq_len), lay)
            where = (lay.short(), lay.recompute, rank)
            assert abs(d.model_states(stage)["total"] - state) <= 0.05 * state, where
            planned_act = d.activations(stage)
            if gathered:  # the meter also sees the parameter buffers ZeRO-3 gathers during the step
                assert planned_act <= act * 1.001 and act <= (planned_act + gathered) * 1.001, (where, planned_act, act)
            elif lay.schedule != "interleaved":
                assert abs(planned_act - act) <= 0.05 * act, (where, planned_act, act)
            planned = {axis: _by_kind(xs) for axis, xs in traffic.transfers(d, stage).items()}
            assert planned == {axis: sent.get(axis, {}) for axis in planned}, where


def _brute_force(work, gpus, machine, memory, base):
    """Every combination of the searched choices, checked by the planner itself, no shortcut."""
    best = None
    for tp, cp, mode, pp, zero, sp, rec, b, (sched, v) in itertools.product(
            (1, 2, 4, 8), (1, 2, 4, 8), ("ring", "ulysses"), (1, 2, 4, 8), (0, 1, 2, 3), (False, True),
            ("none", "selective", "full"), (1, 2, 4, 8, 16, 32), (("1f1b", 1), ("zb", 1), ("interleaved", 2))):
        if gpus % (tp * cp * pp) or (gpus // (tp * cp * pp)) * b > work.batch or (cp == 1 and mode != "ring"):
            continue
        dp = gpus // (tp * cp * pp)
        lay = replace(base, dp=dp, cp=cp, cp_mode=mode, tp=tp, pp=pp, zero=zero, sp=sp, recompute=rec,
                      schedule=sched, chunks=v, microbatches=max(1, work.batch // (dp * b)))
        if (work.batch != dp * b * lay.microbatches or (zero and dp * cp == 1) or (pp == 1 and sched != "1f1b")):
            continue
        try:
            result = plan(work, lay, machine, memory_bytes=memory)
        except PlanError:
            continue
        if result["fits"] and (best is None or result["predicted_step_time_s"] < best[0]):
            best = (result["predicted_step_time_s"], lay)
    return best


def test_search_finds_the_best_layout_of_a_brute_force_enumeration():
    """torch accounting: on 8 GPUs of 0.6 GiB, a GPT of 12 blocks, width 1024 and a 32k
    vocabulary (some layouts do not fit), the search's best predicted step time is the least
    of every combination of the choices planned one by one."""
    work = Workload(Shape(12, 1024, 16, 32768, 1024), 32, 1024)
    base, memory = LayoutConfig(precision="bf16"), 0.6 * 2 ** 30  # 17 of 4266 layouts fit (cp 2 among them)
    machine = GpuRates(H100, "bf16")
    found = search(work, 8, machine, memory_bytes=memory, base=base)
    assert 0 < found["fit"] < found["tried"]  # the memory limit matters here
    expected_time, _ = _brute_force(work, 8, machine, memory, base)
    lay, best = found["best"][0]
    assert best["fits"] and best["predicted_step_time_s"] == pytest.approx(expected_time, rel=1e-12)


LLAMA3_8B = shape_of("llama3-8b")


def test_search_splits_a_long_sequence_over_cp():
    """Llama-3 8B on one sequence of 128k tokens, 8 GPUs of 80 GiB: the search covers cp in
    both modes (ulysses only where the 8 key/value heads left by tp divide by cp) and ranks a
    cp layout first; every layout it returns is one `check` accepts."""
    work = Workload(LLAMA3_8B, 1, 131072)
    found = search(work, 8, GpuRates(H100, "bf16"), memory_bytes=80 * 2 ** 30, base=LayoutConfig(precision="bf16"))
    lay, best = found["best"][0]
    assert lay.cp > 1 and best["fits"], lay
    seen = {(lay.cp, lay.cp_mode, lay.tp) for lay, _ in found["best"]}
    assert any(mode == "ulysses" for _, mode, _ in seen) and any(mode == "ring" for _, mode, _ in seen)
    assert all(8 // tp % cp == 0 for cp, mode, tp in seen if mode == "ulysses")


def test_a_profile_without_all_to_all_asks_for_a_recalibration(tmp_path):
    """A profile calibrated before all-to-all was measured: ulysses is refused in one line."""
    import json

    _synthetic_profile(tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text())
    del data["collectives"]["all_to_all"]
    (tmp_path / "m.json").write_text(json.dumps(data))
    r = run_cli("plan", "--model", "llama-test", "--seq-len", "64", "--batch-size", "4", "--dp", "1", "--cp", "2",
                "--cp-mode", "ulysses", "--machine", str(tmp_path / "m.json"))
    assert r.returncode == 2 and "no 'all_to_all' measurement" in r.stderr and "--calibrate" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


class _NoOverlap(GpuRates):
    comm_overlap = 0.0  # as a CPU profile: nothing hides under compute


def test_the_rings_transfers_hide_under_its_attention_blocks_and_all_to_all_does_not():
    """Per micro-batch the ring's hops overlap the attention blocks computed meanwhile: on a
    GPU (comm_overlap 1) its exposed time is what the blocks cannot cover, less than its
    transfers' time, and without overlap it is all of them; all-to-all waits for its data."""
    work = Workload(LLAMA3_8B, 8, 32768)
    for mode in ("ring", "ulysses"):
        lay = LayoutConfig(dp=1, cp=8, cp_mode=mode, precision="bf16", recompute="full", zero=3, microbatches=8)
        sent = {}
        for machine in (GpuRates(H100, "bf16"), _NoOverlap(H100, "bf16")):
            result = plan(work, lay, machine)
            d = Device(work, lay)
            sent[machine.comm_overlap] = (result["time_s"]["cp_exposed"], sum(
                x.calls * machine.collective_time(x.kind, x.nbytes) for x in traffic.transfers(d, 0)["cp"]))
        exposed, whole = sent[0.0]
        assert exposed == pytest.approx(whole, rel=1e-12) and whole > 0, mode
        exposed, whole = sent[1.0]
        if mode == "ring":
            assert 0 <= exposed < whole, (exposed, whole)
        else:
            assert exposed == pytest.approx(whole, rel=1e-12), (exposed, whole)


@pytest.mark.parametrize("lay, work, message", [
    (dict(cp=3), dict(seq=1000), "does not split into 2·cp = 6 equal chunks"),
    (dict(cp=4, cp_mode="ulysses", tp=4), dict(seq=1024), "the 8 key/value heads (2 per tp rank) do not split"),
    (dict(cp=2), dict(seq=1024, attention="math", dropout=0.1), "attention-probability dropout"),
    (dict(cp=2, tp=8, sp=True), dict(seq=1032), "--seq-len 1032 ÷ --cp 2 is not divisible by --tp 8"),
    (dict(cp=2, cp_mode="star"), dict(seq=1024), "unknown --cp-mode 'star'"),
])
def test_the_planner_refuses_what_context_parallelism_cannot_split(lay, work, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(Workload(LLAMA3_8B, 8, **work), LayoutConfig(dp=1, **lay), GpuRates(H100, "fp32"))


def test_plan_command_gives_the_contract_keys_and_says_what_it_planned():
    r = run_cli("plan", "--model", "gpt-small", "--dp", "2", "--tp", "2", "--sp", "--recompute", "selective",
                "--json")
    assert r.returncode == 0, r.stderr
    got = last_json(r.stdout)
    assert all(key in got for key in CONTRACT)
    assert got["fits"] is True and got["predicted_step_time_s"] > 0 and 0 < got["mfu"] < 1
    assert set(got["comm_bytes_per_step"]) == {"dp", "tp", "pp", "cp", "ep", "edp"} and got["comm_bytes_per_step"]["tp"] > 0
    assert "predicted step time" in r.stderr and "activations" in r.stderr


def test_llama3_70b_search_on_64_h100s_is_fast_and_explains_the_best():
    """torch accounting, bf16: the issue's example answers in under 10 s (the search itself
    measured 2.8–3.6 s when it landed, 6.4 s on 2026-12-02's slower machine, where a
    checkout of that landing measures the same); its best layout fits and keeps tp inside a
    node, and is explained."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = run_cli("plan", "--model", "llama3-70b", "--gpus", "64", "--gpu", "h100-80g", "--seq-len", "8192",
                "--batch-size", "256", "--precision", "bf16", "--search", "--json")
    took, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    # The command's CPU seconds: its wall time on an idle core, whatever else the machine runs
    # (make test runs a test file per core).
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert r.returncode == 0, r.stderr
    got = last_json(r.stdout)
    assert cpu < 10 and got["search"]["seconds"] < took, (cpu, took, got["search"]["seconds"])
    assert got["fits"] and got["layout"]["tp"] <= 8 and got["total_bytes"] <= 80 * 2 ** 30
    assert got["layout"]["dp"] * got["layout"]["cp"] * got["layout"]["tp"] * got["layout"]["pp"] == 64
    assert "the best, explained" in r.stderr and "memory per device" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-small", "--gpus", "8", "--dp", "2", "--tp", "2"], "not the 8 GPUs of --gpus"),
    (["--model", "llama3-405b", "--gpus", "8", "--seq-len", "8192", "--batch-size", "8", "--search"],
     "does not fit on 8 devices of 80 GiB in any layout: the smallest needs"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--model", "gpt-small", "--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
    (["--model", "gpt-small", "--accounting", "guess"], "unknown accounting 'guess'"),
    (["--model", "llama3-8b", "--tp", "3", "--dp", "1"], "--tp 3 does not divide the 32 heads"),
    (["--layers", "4", "--hidden", "64"], "an explicit model needs --heads, --vocab too"),
])
def test_impossible_plans_get_one_clear_line(args, message):
    r = run_cli("plan", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _synthetic_profile(path):
    """A machine profile with round numbers: 10 GFLOP/s, 1 GB/s elementwise, 10 µs per
    operator, collectives measured at 1 KB (1 ms) and 1 MB (3 ms)."""
    from meshtrain.plan.profile import KINDS, MachineProfile

    grid = [{"m": m, "k": k, "n": n, "dtype": d, "flops_per_s": 1e10}
            for m in (64, 4096) for k in (32, 4096) for n in (32, 4096) for d in ("fp32", "bf16")]
    points = [{"sent_bytes": 1e3, "time_s": 1e-3}, {"sent_bytes": 1e6, "time_s": 3e-3}]
    profile = MachineProfile("cpu", 2, 1, grid, 1e9, 1e-5, {k: {"latency_s": 1e-3, "bytes_per_s": 5e8,
                                                                 "points": points} for k in KINDS},
                             "2026-11-30T00:00:00Z", "2.13.0", "test")
    profile.save(path)
    return MachineProfile.load(path)


def test_a_measured_profile_gives_the_collectives_measured_times(tmp_path):
    """Between the sizes measured, a collective takes the measured times (log-log between
    them); beyond, the latency + bandwidth fit; more ranks than the profile measured share
    its cores."""
    from meshtrain.plan.profile import ProfileRates

    rates = ProfileRates(_synthetic_profile(tmp_path / "m.json"), world=4)
    assert rates.collective_time("all_reduce", 1e3) == pytest.approx(1e-3)
    assert rates.collective_time("send", 1e6) == pytest.approx(3e-3)
    assert rates.collective_time("all_gather", 10 ** 4.5) == pytest.approx((1e-3 * 3e-3) ** 0.5)
    assert rates.collective_time("reduce_scatter", 1e8) == pytest.approx(1e-3 + 1e8 / 5e8)
    assert rates.shared_cores == 2 and rates.peak_flops("fp32") == 1e10


def test_plan_measure_prints_each_ranks_prediction_beside_the_run(tmp_path):
    """torch accounting: `plan --machine FILE --measure` trains the layout (gpt-test, dp 2,
    8 steps) and reports, per rank, the plan's model states (equal) and activations (within
    5 %) beside what the run measured, and both step times."""
    _synthetic_profile(tmp_path / "m.json")
    r = run_cli("plan", "--model", "gpt-test", "--vocab-size", "256", "--seq-len", "32", "--batch-size", "8",
                "--dp", "2", "--device", "cpu", "--machine", tmp_path / "m.json", "--measure", "--json")
    assert r.returncode == 0, r.stderr
    got = last_json(r.stdout)
    ranks = got["measured"]["ranks"]
    assert [row["rank"] for row in ranks] == [0, 1]
    for row in ranks:
        assert row["model_state_plan"] == row["model_state_measured"]
        assert abs(row["activation_plan"] - row["activation_measured"]) <= 0.05 * row["activation_measured"]
    assert got["predicted_step_time_s"] > 0 and got["measured"]["step_time_median_s"] > 0
    assert "step time: predicted" in r.stderr


def test_a_bad_machine_profile_is_one_line(tmp_path):
    (tmp_path / "m.json").write_text("{}")
    r = run_cli("plan", "--model", "gpt-small", "--machine", tmp_path / "m.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_tensor_parallel_collective_waits_for_the_slower_rank_as_measured(tmp_path):
    """The profile's skew points (extra wait after so much compute) add, per tensor-parallel
    collective, the wait for the compute between two of them; a profile without them adds
    nothing, and data parallelism (its reductions overlap, no compute between) none."""
    from meshtrain.plan.profile import ProfileRates

    base = _synthetic_profile(tmp_path / "m.json")
    skewed = replace(base, collective_skew=[{"compute_s": 1e-3, "extra_s": 0.0}, {"compute_s": 5e-3, "extra_s": 2e-3},
                                            {"compute_s": 2e-2, "extra_s": 3e-3}])
    assert skewed.skew_time(5e-4) == 0 and skewed.skew_time(3e-3) == pytest.approx(1e-3)
    assert skewed.skew_time(1.0) == pytest.approx(3e-3) and base.skew_time(3e-3) == 0
    work = Workload(shape_of("gpt-small"), 8, 128)
    tp = LayoutConfig(dp=1, tp=2)
    before, after = (plan(work, tp, ProfileRates(p, world=2)) for p in (base, skewed))
    d = Device(work, tp)
    calls = sum(x.calls for x in traffic.tp_transfers(d, 0))
    between = sum(d.micro_batch_times(ProfileRates(base, world=2), 0)) / calls
    assert after["predicted_step_time_s"] - before["predicted_step_time_s"] == pytest.approx(
        calls * skewed.skew_time(between))
    dp = LayoutConfig(dp=2)
    assert plan(work, dp, ProfileRates(base))["predicted_step_time_s"] == plan(
        work, dp, ProfileRates(skewed))["predicted_step_time_s"]


def test_the_optimizer_step_costs_what_the_profile_measured_per_parameter_and_tensor(tmp_path):
    """With the profile's per-parameter and per-tensor figures, the optimizer term is
    a·(the parameters the rank steps) + b·(its parameter tensors), times the ranks a core
    runs: gpt-small has 8 blocks of 15 tensors, 2 embedding tables, a final norm's 2 and the
    head; ZeRO steps 1/dp of the parameters, a pipeline stage its own blocks. A profile
    without the figures keeps the memory-bound estimate."""
    from meshtrain.plan.profile import ProfileRates

    base = _synthetic_profile(tmp_path / "m.json")
    a, b = 4e-9, 1e-4
    measured = replace(base, optimizer_step={"s_per_param": a, "s_per_tensor": b})
    shape = shape_of("gpt-small")
    work = Workload(shape, 8, 128)
    n = shape.n_params()
    assert 8 * shape.layer_tensors() + shape.outside_tensors(True, True) == 125  # as GPT(...).parameters()

    def optimizer(lay, profile, world):
        return plan(work, lay, ProfileRates(profile, world=world))["time_s"]["optimizer"]

    assert optimizer(LayoutConfig(dp=2), measured, 2) == pytest.approx(a * n + b * 125)
    assert optimizer(LayoutConfig(dp=2, zero=3), measured, 2) == pytest.approx(a * n / 2 + b * 125)
    assert optimizer(LayoutConfig(dp=4), measured, 4) == pytest.approx(2 * (a * n + b * 125))  # 2 ranks a core
    pp = LayoutConfig(dp=1, pp=2, microbatches=2)
    d = Device(work, pp)
    stages = [(d.params_on(k), 4 * 15 + (2 if k == 0 else 3)) for k in (0, 1)]
    assert optimizer(pp, measured, 2) in [pytest.approx(a * p + b * t) for p, t in stages]
    assert optimizer(LayoutConfig(dp=2), base, 2) != pytest.approx(a * n + b * 125)


def test_each_step_pays_the_latency_of_its_one_number_all_reduces(tmp_path):
    """The gradient norm is summed over every axis of more than one rank and the loss over
    pp and dp: dp 2 makes two such all-reduces, tp 2 one, dp 2 · pp 2 four (four ranks on
    the profile's two cores: each twice as long), one process none."""
    from meshtrain.plan.profile import ProfileRates

    profile = _synthetic_profile(tmp_path / "m.json")
    one = profile.collective_time("all_reduce", 4.0)  # 2·(n−1)/n of 4 bytes at n = 2
    work = Workload(shape_of("gpt-small"), 8, 128)
    for lay, world, expected in [(LayoutConfig(dp=2), 2, 2 * one), (LayoutConfig(dp=1, tp=2), 2, one),
                                 (LayoutConfig(dp=2, pp=2, microbatches=2), 4, 2 * 4 * one),
                                 (LayoutConfig(dp=1), 1, 0.0)]:
        got = plan(work, lay, ProfileRates(profile, world=world))["time_s"]["scalars"]
        assert got == pytest.approx(expected), lay


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)])
def test_a_pipeline_on_shared_cores_is_the_schedule_run_with_each_stages_costs(name, chunks):
    """With cores to spare, `pipeline_time` is the schedule simulator's makespan for equal
    stages (the closed forms' m·(f+b)/(1 − bubble)) and for unequal ones; with ranks
    sharing cores, idle ranks hand theirs over: pp 2, m 2, 1F1B, two ranks a stage on two
    cores takes 12 units (by hand: 1 alone, 2 shared, 2 alone, 2+2 shared, 1 alone, 2
    alone), and never less than all the work over the cores."""
    from fractions import Fraction

    from meshtrain.parallel.pipeline.schedules import schedule
    from meshtrain.parallel.pipeline.simulate import Costs, simulate
    from meshtrain.plan.sharing import pipeline_time

    class Uneven(Costs):
        def of(self, op, chunks, stage=0):
            return super().of(op, chunks, stage) * (1 + Fraction(stage, 2))

    for p, m in [(2, 2), (2, 4), (4, 8)]:
        even, _ = pipeline_time(name, m, chunks, ((1.0, 2.0),) * p, 1, 64)
        assert even == pytest.approx(m * 3 / (1 - bubble_fraction(name, p, m, chunks)))
        uneven, busy = pipeline_time(name, m, chunks, tuple((1 + s / 2, 2 + s) for s in range(p)), 1, 64)
        assert uneven == pytest.approx(float(simulate(schedule(name, p, m, chunks), chunks, Uneven()).makespan))
        assert busy == pytest.approx([m * 3 * (1 + s / 2) for s in range(p)])
        shared, _ = pipeline_time(name, m, chunks, ((1.0, 2.0),) * p, 2, 2)
        assert shared >= p * 2 * m * 3 / 2 - 1e-9 and shared >= even
    if name == "1f1b":
        assert pipeline_time(name, 2, 1, ((1.0, 2.0),) * 2, 2, 2)[0] == pytest.approx(12)


def test_calibrating_into_a_folder_that_is_not_there_is_one_line_before_measuring(tmp_path):
    started = time.time()
    r = run_cli("plan", "--calibrate", "--machine", tmp_path / "missing" / "m.json")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is not a folder" in r.stderr and time.time() - started < 30  # no minute of measuring first


def test_zero_bubble_is_timed_with_the_measured_split_of_its_backward():
    """On a measured machine the zero-bubble schedule runs with each stage's own split: the
    first stage's whole backward in its weight pass (it sends no input gradient), the others'
    by the measured input share; `pipeline_time` with (forward, input, weight) per stage is
    the simulator's makespan with those costs."""
    from fractions import Fraction

    from meshtrain.parallel.pipeline.schedules import schedule
    from meshtrain.parallel.pipeline.simulate import Costs, simulate
    from meshtrain.plan.planner import ZB_INPUT_SHARE, zero_bubble_split
    from meshtrain.plan.sharing import pipeline_time

    assert zero_bubble_split(0, 1.0, 2.0) == (1.0, 0.0, 2.0)
    assert zero_bubble_split(1, 1.0, 2.0) == pytest.approx((1.0, 2 * ZB_INPUT_SHARE, 2 * (1 - ZB_INPUT_SHARE)))
    share = Fraction(ZB_INPUT_SHARE).limit_denominator(100)

    class Split(Costs):
        def of(self, op, chunks, stage=0):
            from meshtrain.parallel.pipeline import schedules as S
            if isinstance(op, (S.BackwardInput, S.BackwardWeight)):
                first = 0 if stage == 0 else share
                return 2 * (first if isinstance(op, S.BackwardInput) else 1 - first)
            return super().of(op, chunks, stage)

    for p, m in [(2, 4), (4, 8)]:
        costs = tuple(zero_bubble_split(s, 1.0, 2.0) for s in range(p))
        got, busy = pipeline_time("zb", m, 1, costs, 1, 64)
        assert got == pytest.approx(float(simulate(schedule("zb", p, m), 1, Split()).makespan))
        assert busy == pytest.approx([m * 3.0] * p)
