"""ZeRO stages 1-3 on real gloo processes: every stage through verify (alone, with
micro-batches, and inside dp × tp × pp), the model-state bytes and the dp traffic of the
ZeRO paper's formulas, stage 3's prefetch, and a model of the user's own."""

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks
from helpers import small_config, verdict
from presets import GPT_TEST_4

from meshtrain import verifier as verify
from meshtrain.comm import Comm
from meshtrain.cli.config import Config, LayoutConfig, TrainConfig
from meshtrain.mesh import Mesh
from meshtrain.recipes.build import build_model
from meshtrain.optim import adamw
from meshtrain.parallel.compose import mark_full_shapes
from meshtrain.train import parallelize_config as parallelize
from meshtrain.parallel.zero import Zero
from meshtrain.train import train


def zero_config(zero, dp, microbatches=1, tp=1, pp=1, steps=3, batch=8, model=GPT_TEST_4, precision="fp32",
                grad_dtype="fp32") -> Config:
    return small_config(model, steps, batch, dp=dp, tp=tp, pp=pp, zero=zero, microbatches=microbatches,
                        precision=precision, grad_dtype=grad_dtype)


def _scheduled(cfg: Config, schedule: str, chunks: int) -> Config:
    cfg.layout.schedule, cfg.layout.chunks = schedule, chunks
    return cfg


def _records(mesh, cfgs):
    return [verify.record(cfg, Comm(mesh), "layout") for cfg in cfgs]


@pytest.mark.parametrize("world, sizes, cfgs", [
    (2, {}, [zero_config(z, 2, microbatches=2) for z in (1, 2, 3)] + [zero_config(3, 2, model="mlp", batch=16)]),
    (4, {}, [zero_config(z, 4) for z in (1, 2, 3)]),
    (8, {"pp": 2, "tp": 2}, [zero_config(1, 2, 2, tp=2, pp=2), zero_config(3, 2, 2, tp=2, pp=2)]),
    (4, {"pp": 2}, [_scheduled(zero_config(z, 2, 2, pp=2), sched, chunks) for z in (1, 3)
                    for sched, chunks in (("zb", 1), ("interleaved", 2))] + [zero_config(2, 2, 4, pp=2)]),
], ids=["dp2-mb2-every-stage-and-mlp", "dp4-every-stage", "dp2-tp2-pp2-zero1-and-zero3",
        "dp2-pp2-zero1-3-with-zb-and-interleaved-zero2-1f1b"])
def test_zero_layouts_pass_verify(world, sizes, cfgs):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, **sizes)[0]):
        result = verdict(cfg, rec)
        assert result["passed"], (cfg.layout.short(), result["failures"])
        assert not rec["problems"]  # every rank's shard is that part of the full state


def _measure(mesh, cfgs):
    out = []
    for cfg in cfgs:
        r = train(cfg, Comm(mesh))
        zero = getattr(r.parallel.holdings, "zero", None)
        out.append({"comm": r.comm_per_step, "detail": r.comm_detail_per_step, "state": r.model_state,
                    "n_params": r.n_params, "padded": [g.padded for g in zero.groups] if zero else None,
                    "units": zero.n_units if zero else 0})
    return out


@pytest.fixture(scope="module")
def dp4_figures():
    """gpt-test on dp = 4, two steps: stages 0-3 with one micro-batch, 1-3 with two, and
    stages 0-3 in bf16, with bf16 and with fp32 gradients."""
    cfgs = ([zero_config(z, 4, steps=2) for z in (0, 1, 2, 3)] + [zero_config(z, 4, 2, steps=2) for z in (1, 2, 3)]
            + [zero_config(z, 4, steps=2, precision="bf16", grad_dtype="compute") for z in (0, 1, 2, 3)]
            + [zero_config(z, 4, steps=2, precision="bf16") for z in (0, 1, 2, 3)])
    return run_ranks(_measure, 4, cfgs)


N = 4
FORMULAS = {  # bytes per parameter at stages 0-3
    "bf16": [16, 2 + 2 + 12 / N, 2 + 14 / N, 16 / N],  # --grad-dtype compute: the ZeRO paper's 16
    "bf16, fp32 gradients": [18, 2 + 4 + 12 / N, 2 + 16 / N, 18 / N],  # the default: 2 more, sharded with them
    "fp32": [16, 4 + 4 + 8 / N, 4 + 12 / N, 16 / N],  # no master copy
}
RUNS = {"fp32": slice(0, 4), "bf16": slice(7, 11), "bf16, fp32 gradients": slice(11, 15)}


@pytest.mark.parametrize("precision", list(FORMULAS))
def test_model_state_bytes_follow_the_zero_formulas(dp4_figures, precision):
    """Bytes per parameter within 2 % (shards are padded to a multiple of N), plus, under
    stage 3, the full parameters gathered at the peak: the group outside the blocks and two
    blocks."""
    runs, size = RUNS[precision], 4 if precision == "fp32" else 2
    for rank in dp4_figures:
        psi = rank[0]["n_params"]
        formulas = [f * psi for f in FORMULAS[precision]]
        for stage, (run, formula) in enumerate(zip(rank[runs], formulas)):
            state = run["state"]
            assert state["total"] - state["gathered"] == pytest.approx(formula, rel=0.02), (stage, state)
            assert (state["master"] > 0) == (precision != "fp32")
        stage3 = rank[runs][3]
        rest, block = stage3["padded"][-1], max(stage3["padded"][:-1])
        assert stage3["state"]["gathered"] == size * (rest + 2 * block)  # with prefetch: two blocks at once


def test_dp_traffic_is_dps_for_stages_1_and_2_and_one_and_a_half_times_for_stage_3(dp4_figures):
    n = 4
    for rank in dp4_figures:
        dp_bytes = rank[0]["comm"]["dp"]
        assert dp_bytes == round(2 * (n - 1) / n * 4 * rank[0]["n_params"])  # plain DP: all-reduce
        for stage in (1, 2):
            run = rank[stage]
            padded = 4 * sum(run["padded"])
            assert run["detail"]["dp"] == {"all_gather": round((n - 1) / n * padded),
                                           "reduce_scatter": round((n - 1) / n * padded)}
            assert run["comm"]["dp"] == pytest.approx(dp_bytes, rel=0.005)
        stage3 = rank[3]
        assert stage3["detail"]["dp"]["all_gather"] == 2 * stage3["detail"]["dp"]["reduce_scatter"]
        assert stage3["comm"]["dp"] / dp_bytes == pytest.approx(1.5, rel=0.05)
        # two micro-batches: stage 1 reduces once; stage 2 reduce-scatters after every
        # micro-batch's backward; stage 3 also gathers every micro-batch's forward and backward
        one, two = rank[1:4], rank[4:7]
        assert two[0]["detail"]["dp"] == one[0]["detail"]["dp"]
        assert two[1]["detail"]["dp"]["reduce_scatter"] == 2 * one[1]["detail"]["dp"]["reduce_scatter"]
        assert two[1]["detail"]["dp"]["all_gather"] == one[1]["detail"]["dp"]["all_gather"]
        assert two[2]["comm"]["dp"] == 2 * one[2]["comm"]["dp"]


def test_bf16_halves_the_traffic_and_fp32_gradients_reduce_in_fp32(dp4_figures):
    for rank in dp4_figures:
        for fp32, bf16, fp32_grads in zip(rank[RUNS["fp32"]], rank[RUNS["bf16"]], rank[RUNS["bf16, fp32 gradients"]]):
            assert bf16["comm"]["dp"] == pytest.approx(fp32["comm"]["dp"] / 2, rel=1e-3)
            for kind in ("all_reduce", "reduce_scatter"):  # gradients move in fp32, parameters in bf16
                assert fp32_grads["detail"]["dp"].get(kind) == fp32["detail"]["dp"].get(kind)
            assert fp32_grads["detail"]["dp"].get("all_gather") == bf16["detail"]["dp"].get("all_gather")


@pytest.mark.parametrize("world, sizes, cfgs", [
    (2, {}, [zero_config(z, 2, steps=50, precision="bf16") for z in (0, 3)]
     + [zero_config(3, 2, 2, steps=50, precision="bf16", grad_dtype="compute")]),
    pytest.param(2, {}, [zero_config(z, 2, steps=50, precision="bf16") for z in (1, 2)]
                 + [zero_config(z, 2, 2, steps=50, precision="bf16", grad_dtype="compute") for z in (0, 1, 2)],
                 marks=pytest.mark.slow),
    pytest.param(8, {"pp": 2, "tp": 2}, [zero_config(z, 2, 2, tp=2, pp=2, steps=50, precision="bf16") for z in (1, 3)],
                 marks=pytest.mark.slow),
], ids=["dp2-zero0-zero3-and-bf16-grads", "dp2-the-other-stages", "dp2-tp2-pp2-zero1-and-zero3"])
def test_bf16_loss_curves_stay_within_2_percent_of_fp32_one_process(world, sizes, cfgs):
    for cfg, rec in zip(cfgs, run_ranks(_records, world, cfgs, **sizes)[0]):
        result = verdict(cfg, rec)
        assert result["curve_only"] and result["passed"], (cfg.layout.short(), result["failures"])
        assert result["max_loss_rel_diff"] > 0  # bf16 compute really differs from fp32


def _gather_order(mesh, keep_gathered):
    model = build_model("gpt-tiny", 0, vocab_size=256)
    events = []
    zero = Zero(model, Comm(mesh), 3, blocks="blocks", reshard_after_forward=not keep_gathered,
                on_event=lambda kind, i: events.append((kind, i)))
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(mesh.rank))
    model(x).square().mean().backward()
    zero.finish_grad_sync()
    return {"events": events, "units": zero.n_units, "groups": len(zero.groups)}


def test_stage_3_prefetches_the_next_block_while_the_current_one_computes():
    both = run_ranks(_gather_order, 2, False)[0], run_ranks(_gather_order, 2, True)[0]
    resharding, kept = both
    events, units = resharding["events"], resharding["units"]
    for i in range(units - 1):  # block i+1's all-gather is launched before block i's forward ends
        assert events.index(("gather", i + 1)) < events.index(("forward", i)), events
    # each group gathered for forward and again for backward; kept gathered, once
    assert sum(kind == "gather" for kind, _ in events) == 2 * resharding["groups"]
    assert sum(kind == "gather" for kind, _ in kept["events"]) == kept["groups"]


class _UsersModel(nn.Module):
    """Not one of ours: its layers sit in some nn.ModuleList, with parameters beside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16)) for _ in range(3))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_stage_3_takes_any_model_with_a_block_list_and_trains_it_as_the_plain_one():
    """One process (the dp group of one still gathers, frees and reduces): the same losses
    and weights as the plain model after three steps."""
    comm = Comm(Mesh.single(torch.device("cpu")))
    train_cfg = TrainConfig(lr=1e-2, warmup=0)
    runs = {}
    for zero in (0, 3):
        model = _UsersModel()
        if zero:
            sync = z = Zero(model, comm, 3)
            mark_full_shapes(model, [(n, v) for n, v, _, _ in z.pieces], comm)  # as parallelize does
            opt = adamw(train_cfg.lr, train_cfg.weight_decay)([(n, v) for n, v, _, _ in z.pieces])
        else:
            plain = parallelize(model, comm, LayoutConfig(dp=1), train_cfg)
            sync, opt = plain.grad_sync, plain.optimizer
        losses = []
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            sync.finish_grad_sync()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.item())
        runs[zero] = (losses, z.groups if zero else None)
    assert runs[3][0] == pytest.approx(runs[0][0], rel=1e-6)
    assert [g.label for g in runs[3][1]] == ["layers.0", "layers.1", "layers.2", "the parameters outside the blocks"]


def _bench_both(mesh):
    from meshtrain.bench import run_bench
    from meshtrain.cli.bench import bench_options
    return [run_bench(bench_options(zero_config(stage, 2, steps=2), peer), Comm(mesh), peer)
            for stage, peer in ((1, "zero1"), (3, "fsdp2"))]


def test_bench_against_zero_redundancy_optimizer_and_fsdp2_trains_the_same_model():
    """Only that both peers run beside ours on the same batches and hold what ours holds;
    timing claims live in benchmarks/."""
    for result in run_ranks(_bench_both, 2)[0]:
        assert result["max_loss_rel_diff"] < 1e-5, result
        assert result["model_state_ratio"] == pytest.approx(1.0, abs=0.01), result  # shards padded differently
        assert result["ratio"] > 0


def _with_torchs_zero_grad(mesh, cfgs):
    """Each layout trained twice: with the step's own zeroing, and with the loop calling the
    optimizer's `zero_grad()` as a plain PyTorch loop does (torch's default set_to_none=True)."""
    from contextlib import nullcontext
    from unittest import mock

    from meshtrain.parallel.compose import Parallelized
    out = []
    for cfg in cfgs:
        runs = []
        for loop_zeroes in (False, True):
            with mock.patch.object(Parallelized, "zero_grad", lambda self: self.optimizer.zero_grad()) \
                    if loop_zeroes else nullcontext():
                r = train(cfg, Comm(mesh))
            runs.append({"losses": r.losses, "weights": r.parallel.full_state_dict()["model"]})
        out.append(runs)
    return out


def test_the_optimizers_own_zero_grad_keeps_zero_stepping():
    """torch's `optimizer.zero_grad()` sets gradients to None; under ZeRO that cut the
    pieces from their shard buffers, and AdamW skipped every piece from then on. Now the
    same run follows the same trajectory, under ZeRO 1-3 in fp32 and bf16."""
    cfgs = [zero_config(z, 2, steps=3, precision=p) for p in ("fp32", "bf16") for z in (1, 2, 3)]
    for cfg, (own, loops) in zip(cfgs, run_ranks(_with_torchs_zero_grad, 2, cfgs)[0]):
        assert own["losses"] == loops["losses"], cfg.layout.short()
        assert own["losses"][-1] < own["losses"][0], cfg.layout.short()  # it trains
        for name, value in own["weights"].items():
            assert torch.equal(value, loops["weights"][name]), (cfg.layout.short(), name)


class _Branchy(nn.Module):
    """A user's model whose batch chooses a branch: block 1 runs only on the rows whose
    first feature is positive, and is not called at all when no row of the batch has one —
    so on some data-parallel ranks it is skipped, on others not. Per row it is the same
    function on every layout, so one process on the whole batch trains the same model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for i, block in enumerate(self.blocks):
            if i == 1:
                chosen = x[:, :1] > 0
                if chosen.any():
                    h = torch.where(chosen, h + torch.tanh(block(h)), h)
                continue
            h = h + torch.tanh(block(h))
        return self.out(h)


def _branchy_batch(step: int) -> torch.Tensor:
    """8 rows; the first half never takes the branch, the second half on even steps only."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
    x[:, 0] = -x[:, 0].abs()
    if step % 2 == 0:
        x[5, 0] = 1.0
    return x


def _train_branchy(mesh, zero, steps=4):
    """Losses and final weights of `_Branchy` trained on this mesh's dp ranks (each on its
    rows of the global batch), and the order of its dp reduce-scatters on each step."""
    comm = Comm(mesh)
    job = parallelize(_Branchy(), comm, LayoutConfig(dp=mesh.size("dp"), zero=zero, bucket_mb=0.001),
                      TrainConfig(lr=1e-2, warmup=0))
    rows = slice(mesh.coord("dp") * 8 // mesh.size("dp"), (mesh.coord("dp") + 1) * 8 // mesh.size("dp"))
    losses = []
    for step in range(steps):
        x = _branchy_batch(step)
        loss = job.module(x[rows]).square().sum() / (8 * 4)
        loss.backward()
        job.grad_sync.finish_grad_sync()
        job.optimizer.step()
        job.zero_grad()
        total = loss.detach().clone()
        comm.all_reduce(total, "dp")
        losses.append(total.item())
    return {"losses": losses, "weights": job.full_state_dict()["model"]}


def _branchy_under(mesh, zero, mutant):
    if mutant:  # the old launch: each reduce-scatter as soon as backward completes its group
        from unittest import mock

        def as_completed(self, everything=False):
            for g in self._order:
                if not g.reduced and (g.complete() or everything):
                    self._reduce(g)
        with mock.patch.object(Zero, "_reduce_in_order", as_completed):
            return _train_branchy(mesh, zero)
    return _train_branchy(mesh, zero)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_block_the_batch_skips_on_one_rank_trains_as_on_one_process(zero):
    """Rank 0's rows never take the branch: under ZeRO its block gets no gradient there, and
    (stage 3) is never called. Its collectives still go in the fixed order — gathered anyway,
    zeros reduced — and the run matches one process on the whole batch. The old launch, in
    the order gradients complete, mixes two equal-sized reduce-scatters and does not."""
    reference = _train_branchy(Mesh.single(torch.device("cpu")), 0)

    def same_as_reference(got):
        return (all(torch.allclose(got["weights"][n], w, rtol=1e-5, atol=1e-6) for n, w in reference["weights"].items())
                and got["losses"] == pytest.approx(reference["losses"], rel=1e-5))
    assert same_as_reference(run_ranks(_branchy_under, 2, zero, False)[0])
    try:  # collectives of different sizes crash gloo; of equal sizes they mix data silently
        mutant = run_ranks(_branchy_under, 2, zero, True, timeout=60)[0]
    except AssertionError as e:
        assert "mismatch" in str(e) or "Connection" in str(e) or "exit codes" in str(e), e
    else:
        assert not same_as_reference(mutant), "the completion-order mutant trained the same model"


def _gathered_peak(mesh, cfg, across_chunks):
    """Stage 3's peak of gathered bytes; `across_chunks`: the old prefetch, index ± 1
    whatever chunk the next unit belongs to."""
    from contextlib import nullcontext
    from unittest import mock
    real = Zero.__init__

    def one_run(self, *args, runs=None, **kwargs):
        real(self, *args, **kwargs)
    with mock.patch.object(Zero, "__init__", one_run) if across_chunks else nullcontext():
        return train(cfg, Comm(mesh)).model_state["gathered"]


def _gathers_around_instructions(mesh, cfg):
    """One step of a ZeRO-3 pipeline stage: the events of its `Zero` (gathers launched, unit
    forwards done) with a marker at each instruction's start; its instructions and units."""
    from meshtrain.train import setup, train_step
    events = []
    data, job = setup(cfg, Comm(mesh), on_event=lambda kind, i: events.append((kind, i)))
    runner, hear = job.parallel.runner, job.parallel.runner.upcoming
    marks = iter(range(len(runner.instructions)))
    runner.upcoming = lambda nxt: (events.append(("op", next(marks))), hear(nxt))
    train_step(job, data, 0, cfg)
    first_units, start = [], 0
    for ids in runner.stage.block_ids:
        first_units.append(start)
        start += len(ids)
    return {"events": events, "ops": [(type(op).__name__, getattr(op, "chunk", None)) for op in runner.instructions],
            "first_units": first_units}


def test_stage_3_prefetches_the_block_the_next_instruction_runs_first():
    """Under interleaving a forward is often followed by the other chunk's forward: the
    gather of that chunk's first block goes out during the instruction before, not when the
    forward starts (the prefetch follows the instruction list, not the block index)."""
    cfg = _scheduled(zero_config(3, 2, 4, pp=2, steps=1, model="gpt-test"), "interleaved", 2)  # 2 blocks a chunk
    checked = 0
    for r in run_ranks(_gathers_around_instructions, 4, cfg, pp=2):
        events, ops = r["events"], r["ops"]
        forwards = [i for i, (kind, _) in enumerate(ops) if kind in ("Forward", "Backward")]
        for before, i in zip(forwards, forwards[1:]):
            if ops[before][0] != "Forward" or ops[i][0] != "Forward":
                continue
            unit = r["first_units"][ops[i][1]]
            mark = events.index(("op", i))
            ran = events.index(("forward", unit), mark)
            launched = max(j for j in range(ran) if events[j] == ("gather", unit))
            assert launched < mark, (i, ops[i], events[mark - 3:ran + 1])
            checked += ops[before][1] != ops[i][1]
    assert checked > 0  # forwards of one chunk followed by the other's were there to check


def test_stage_3_under_interleaving_does_not_prefetch_by_index():
    """The next unit by index may be the next chunk's first, which does not run next: the
    prefetch follows the instruction list instead, and each stage holds less gathered at
    its peak."""
    cfg = _scheduled(zero_config(3, 2, 4, pp=2, steps=1, model="gpt-test"), "interleaved", 2)  # 2 blocks a chunk
    within = run_ranks(_gathered_peak, 4, cfg, False, pp=2)
    across = run_ranks(_gathered_peak, 4, cfg, True, pp=2)
    assert all(w < a for w, a in zip(within, across)), (within, across)
