"""Sharded checkpoints: the boxes a rank's pieces become, resuming bitwise in the same
layout and within verify's tolerances in another (another world size too), and the folders
a save leaves: atomic, checksummed, pruned, and skipped when damaged."""

import json
import math
import os

import pytest
import torch
from distributed import run_ranks
from helpers import TINY, last_json, run_cli, run_main, start_cli
from presets import GPT_TEST_4

from meshtrain.checkpoint import folders
from meshtrain.checkpoint.boxes import boxes, flat_boxes
from meshtrain.checkpoint.sharded import CheckpointError
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.faults import FAULT_ENV
from meshtrain.mesh import Mesh
from meshtrain.parallel.state import Where, shard_positions
from meshtrain.train import NonFinite, Preempted, StepObserver, setup, train
from meshtrain.verifier import STEP_LOSS_TOLERANCE, UPDATE_TOLERANCE

CPU = torch.device("cpu")
STEPS, SAVED_AT = 8, 4


# ---- boxes ---------------------------------------------------------------------------------

def _pieces(shape, tp, dim, sections, zero):
    """Every rank's Where of a tensor cut by tp (along `dim`, fused `sections` or not) and
    then ZeRO (`zero` flat ranges of each tp part, as FlatGroup cuts a lone parameter)."""
    out = []
    for t in range(tp):
        if tp == 1:
            index, n_part = None, math.prod(shape)
        else:
            spec = ("tp", dim) if sections is None else ("tp", dim, sections)
            index = (slice(None),) * dim + (shard_positions(spec, shape[dim] // tp, t, tp),)
            n_part = math.prod(shape) // tp
        size = -(-n_part // zero)
        for z in range(zero):
            lo, hi = z * size, min((z + 1) * size, n_part)
            if lo < hi:
                out.append(Where(index, (lo, hi) if zero > 1 else None))
    return out


@pytest.mark.parametrize("shape,tp,dim,sections,zero", [
    ((7,), 1, 0, None, 3), ((6, 5), 2, 0, None, 3), ((6, 4), 2, 1, None, 4), ((12, 4), 2, 0, (4, 4, 4), 3),
    ((3, 4, 5), 1, 0, None, 7), ((2, 4, 3, 5), 2, 1, None, 5), ((12,), 2, 0, (4, 4, 4), 2), ((4, 6), 1, 0, None, 1),
])
def test_boxes_tile_the_full_tensor_with_views_of_each_piece(shape, tp, dim, sections, zero):
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    covered = torch.zeros(shape, dtype=torch.int64)
    for where in _pieces(shape, tp, dim, sections, zero):
        piece = where.take(full).clone()
        if where.flat is None and where.index is not None:
            piece = full[where.index].clone()  # a tensor-parallel shard keeps its shape
        found = boxes(piece, where, shape)
        segments = 1 if sections is None or tp == 1 else len(sections)
        assert len(found) <= (2 * (len(shape) - 1) + 1) * segments
        for b in found:
            region = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
            assert torch.equal(b.view, full[region])  # the box's view holds that block
            covered[region] += 1
            b.view.add_(0.5)  # a view: writing into it reaches the piece
        assert torch.equal(piece.reshape(-1) % 1, torch.full((piece.numel(),), 0.5, dtype=torch.float64))
    assert torch.equal(covered, torch.ones_like(covered))  # every element once, padding never


def test_flat_boxes_are_row_major_runs():
    assert flat_boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    assert flat_boxes((3, 4), 0, 12) == [((0, 0), (3, 4))]
    assert flat_boxes((2, 3, 4), 5, 19) == [((0, 1, 1), (1, 1, 3)), ((0, 2, 0), (1, 1, 4)),
                                            ((1, 0, 0), (1, 1, 4)), ((1, 1, 0), (1, 1, 3))]
    assert flat_boxes((), 0, 1) == [((), ())]


# ---- resuming --------------------------------------------------------------------------------

def _cfg(layout: dict, out=None) -> Config:
    c = Config()
    c.model.name, c.model.dropout = GPT_TEST_4, 0.1
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = STEPS, 8, 32, 256, "cpu"
    c.train.warmup, c.train.out = 2, str(out or "unused")
    for k, v in layout.items():
        setattr(c.layout, k, v)
    c.layout.dp = c.layout.dp or 1
    return c


class _Stop(Exception):
    pass


class _StopBefore(StepObserver):
    def __init__(self, step):
        self.step = step

    def before_step(self, p, step):
        if step == self.step:
            raise _Stop


def _mesh(layout: dict) -> Mesh:
    return Mesh.build(layout.get("pp", 1), layout.get("dp", 1), layout.get("tp", 1), CPU)


def _run(cfg: Config, mesh: Mesh):
    """(losses, the full weights on rank 0) of a run of `cfg` on `mesh`."""
    result = train(cfg, Comm(mesh))
    return result.losses, result.parallel.full_state_dict(with_optimizer=False)["model"]


def _initial(cfg: Config, mesh: Mesh):
    _, job = setup(cfg, Comm(mesh))
    return job.parallel.full_state_dict(with_optimizer=False)["model"]


def _interrupted(mesh0, layout, folder):
    """The uninterrupted run, its initial weights, and the same run stopped after saving at
    SAVED_AT."""
    mesh = _mesh(layout)
    cfg = _cfg(layout, folder)
    whole = _run(cfg, mesh)
    start = _initial(cfg, mesh)
    cfg.train.save_every = SAVED_AT
    with pytest.raises(_Stop):
        train(cfg, Comm(mesh), observer=_StopBefore(SAVED_AT + 1))
    return whole, start


def _resumed(mesh0, layout, folder):
    cfg = _cfg(layout, folder)
    cfg.train.resume, cfg.train.save_every = True, SAVED_AT
    return _run(cfg, _mesh(layout))


def _same_layout(mesh0, layout, folder):
    return _interrupted(mesh0, layout, folder), _resumed(mesh0, layout, folder)


@pytest.mark.parametrize("layout", [{"dp": 2}, {"tp": 2, "sp": True}, {"pp": 2, "schedule": "1f1b", "microbatches": 2},
                                    {"dp": 2, "zero": 3}], ids=["dp2", "tp2-sp", "pp2-1f1b", "dp2-zero3"])
def test_resume_in_the_same_layout_is_bitwise(layout, tmp_path):
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    ((losses, weights), _), (resumed_losses, resumed_weights) = run_ranks(
        _same_layout, world, layout, str(tmp_path), pp=layout.get("pp", 1), tp=layout.get("tp", 1), timeout=300)[0]
    assert len(losses) == STEPS and resumed_losses == losses[SAVED_AT:]  # every loss, bit for bit
    assert weights.keys() == resumed_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, resumed_weights[name]), name
    assert folders.steps_in_local(tmp_path) == [STEPS, SAVED_AT]  # saved at 4 and at the end


def _check_close(whole, start, resumed):
    (losses, weights), (resumed_losses, resumed_weights) = whole, resumed
    for a, b in zip(resumed_losses, losses[SAVED_AT:], strict=True):
        assert abs(a - b) / abs(b) <= STEP_LOSS_TOLERANCE, (a, b)
    assert weights.keys() == resumed_weights.keys()
    for name, w in weights.items():
        update, got = w - start[name], resumed_weights[name] - start[name]
        rel = (got - update).norm() / max(update.norm(), 1e-30)
        assert rel <= UPDATE_TOLERANCE, (name, float(rel))


def _world(layout):
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)


@pytest.mark.parametrize("saved,resumed", [
    ({"dp": 2}, {"tp": 2}),
    ({"dp": 2, "zero": 3}, {"pp": 2, "schedule": "1f1b", "microbatches": 2}),
    ({"tp": 2, "sp": True}, {"dp": 4, "zero": 2}),
    ({"pp": 2, "schedule": "interleaved", "chunks": 2, "microbatches": 2}, {"dp": 2, "tp": 2}),
    ({"dp": 2, "zero": 1}, {}),
], ids=["dp2-to-tp2", "zero3-to-pp2", "tp2sp-to-dp4zero2", "interleaved-to-dp2tp2", "zero1-to-one-process"])
def test_resume_in_another_layout_within_verify_tolerances(saved, resumed, tmp_path):
    whole, start = run_ranks(_interrupted, _world(saved), saved, str(tmp_path), pp=saved.get("pp", 1),
                             tp=saved.get("tp", 1), timeout=300)[0]
    if _world(resumed) == 1:
        cfg = _cfg(resumed, tmp_path)
        cfg.train.resume = True
        got = _run(cfg, Mesh.single(CPU))
    else:
        got = run_ranks(_resumed, _world(resumed), resumed, str(tmp_path), pp=resumed.get("pp", 1),
                        tp=resumed.get("tp", 1), timeout=300)[0]
    _check_close(whole, start, got)


# ---- folders and bad input ----------------------------------------------------------------------

def _one_process(tmp_path, steps=4, **train):
    cfg = _cfg({}, tmp_path)
    cfg.train.steps = steps
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg, train_run(cfg)


def train_run(cfg):
    return train(cfg, Comm(Mesh.single(CPU)))


def test_keep_prunes_and_a_damaged_checkpoint_is_passed_by_naming_the_file(tmp_path, capsys):
    cfg, _ = _one_process(tmp_path, steps=6, save_every=2, keep=2)
    assert folders.steps_in_local(tmp_path) == [6, 4]
    assert not list(tmp_path.glob("*.tmp"))
    newest = folders.step_dir(tmp_path, 6)
    marker = json.loads((newest / folders.COMPLETE).read_text())
    victim = next(n for n in marker["files"] if n.endswith(".distcp"))
    raw = bytearray((newest / victim).read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit
    (newest / victim).write_bytes(bytes(raw))
    cfg.train.steps, cfg.train.save_every, cfg.train.resume = 8, None, True
    result = train_run(cfg)
    err = capsys.readouterr().err
    assert f"{victim} fails its checksum" in err and "resumed from" in err and "step-4" in err
    assert result.first_step == 5 and len(result.losses) == 4
    (folders.step_dir(tmp_path, 4) / victim).write_bytes(b"")  # truncated too: nothing good is left
    with pytest.raises(CheckpointError, match="no good checkpoint"):
        train_run(cfg)


def test_another_model_or_global_batch_is_refused_in_one_line(tmp_path):
    cfg, _ = _one_process(tmp_path, steps=2, save_every=2)
    other = _cfg({}, tmp_path)
    other.train.steps, other.train.resume, other.train.batch_size = 4, True, 4
    with pytest.raises(CheckpointError, match="batch_size 8, not 4"):
        train_run(other)
    other.train.batch_size, other.model.name = 8, "gpt-small"
    with pytest.raises(CheckpointError, match="model"):
        train_run(other)


def test_a_save_that_died_leaves_nothing_that_loads(tmp_path):
    cfg, _ = _one_process(tmp_path, steps=2, save_every=2)
    half = tmp_path / "step-4.tmp"  # what a kill during a save leaves
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    no_marker = tmp_path / "step-6"  # or a folder renamed without its marker
    no_marker.mkdir()
    comm = Comm(Mesh.single(CPU))
    assert folders.steps_in(tmp_path, comm) == [2]
    assert "no COMPLETE marker" in folders.check(no_marker, comm)
    cfg.train.resume, cfg.train.steps = True, 3
    assert train_run(cfg).first_step == 3  # resumed from step-2, past the unfinished and unmarked ones


class _Poison(StepObserver):
    def after_step(self, p, step, loss):
        if step == 1:
            with torch.no_grad():
                dict(p.module.named_parameters())["blocks.0.mlp.fc.weight"][0, 0] = float("inf")


def test_a_non_finite_step_stops_the_run_naming_it_or_is_skipped(tmp_path):
    cfg = _cfg({}, tmp_path)
    cfg.train.steps = 3
    with pytest.raises(NonFinite, match=r"step 2: the loss is nan.*weight blocks\.0\.mlp\.fc\.weight"):
        train(cfg, Comm(Mesh.single(CPU)), observer=_Poison())
    cfg.train.skip_nonfinite = True
    result = train(cfg, Comm(Mesh.single(CPU)), observer=_Poison())
    assert result.skipped_steps == [2, 3]


# ---- preemption and restarts ------------------------------------------------------------------

def _preempted(mesh0, folder):
    os.environ[FAULT_ENV] = "term:1:3"  # rank 1 alone receives SIGTERM, at the end of step 3
    cfg = _cfg({"dp": 2}, folder)
    cfg.train.save_every = 100
    try:
        train(cfg, Comm(_mesh({"dp": 2})))
    except Preempted as e:
        return e.step
    return None


def test_sigterm_on_one_rank_saves_the_current_step_on_every_rank(tmp_path):
    assert run_ranks(_preempted, 2, str(tmp_path), timeout=300) == [3, 3]
    comm = Comm(Mesh.single(CPU))
    assert folders.steps_in(tmp_path, comm) == [3] and folders.check(folders.step_dir(tmp_path, 3), comm) is None
    cfg = _cfg({}, tmp_path)
    cfg.train.resume = True
    result = train_run(cfg)  # loadable, here in one process
    assert result.first_step == 4 and len(result.losses) == STEPS - 3


def _cli_run(out, *extra, env=None):
    r = run_cli("train", *TINY, "--dp", "2", "--steps", "6", "--warmup", "2", "--out", out, "--json", *extra, env=env)
    assert r.returncode == 0, r.stderr
    return last_json(r.stdout), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fault,resumed_from", [("kill:1:3", 2), ("kill-in-save:1:4", 2)],
                         ids=["kill-9-at-step-3", "kill-9-during-the-save-of-step-4"])
def test_a_killed_rank_restarts_and_ends_bitwise_as_an_uninterrupted_run(fault, resumed_from, tmp_path):
    whole, _ = _cli_run(tmp_path / "whole")
    got, err = _cli_run(tmp_path / "killed", "--save-every", "2", "--max-restarts", "1", env={FAULT_ENV: fault})
    assert "rank 1 failed (signal 9, SIGKILL); restart 1 of 1" in err
    assert f"resumed from {tmp_path / 'killed'}/step-{resumed_from} (step {resumed_from}" in err
    assert got["final_loss"] == whole["final_loss"] and got["losses"] == whole["losses"][resumed_from:]


# ---- export -------------------------------------------------------------------------------------

def _zero3_saved(mesh0, folder):
    cfg = _cfg({"dp": 2, "zero": 3}, folder)
    cfg.train.steps, cfg.train.save_every = SAVED_AT, SAVED_AT
    return _run(cfg, _mesh({"dp": 2}))[1]


def test_export_of_a_zero3_checkpoint_is_the_one_process_state_in_shards(tmp_path):
    from meshtrain.checkpoint.export import SHARD_INDEX, export
    from meshtrain.checkpoint.weights import _read_weights
    from meshtrain.cli.run_model import load_model
    weights = run_ranks(_zero3_saved, 2, str(tmp_path), timeout=300)[0]
    ckpt = folders.step_dir(tmp_path, SAVED_AT)
    files = export(ckpt, tmp_path / "exported", max_shard_bytes=200_000)
    assert len(files) > 1 and (tmp_path / "exported" / SHARD_INDEX).is_file()
    assert all(f.stat().st_size <= 200_000 + 10_000 for f in files)  # a shard's tensors, and its header
    exported = _read_weights(tmp_path / "exported")
    assert exported.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(exported[name], w), name
    model, _, cfg = load_model(ckpt)  # `generate` reads the checkpoint itself too
    assert cfg.model.name == GPT_TEST_4
    for name, w in model.state_dict().items():
        assert torch.equal(w, weights[name]), name


@pytest.mark.parametrize("args,message", [
    (["train", "--save-every", "0"], "--save-every 0: must be a positive integer"),
    (["train", "--keep", "0"], "--keep 0: must be a positive integer"),
    (["train", "--resume"], "holds no checkpoint"),
    (["train", "--resume-from", "{tmp}"], "has no COMPLETE marker"),
    (["train", "--resume", "--resume-from", "{tmp}"], "give one"),
    (["export", "--ckpt", "{tmp}", "--out", "{tmp}/x"], "not a sharded checkpoint"),
    (["export", "--hf", "--ckpt", "{tmp}", "--out", "{tmp}/x"], "no model.safetensors and run.json there"),
    (["train", "--save-every", "2", "--async-save", "--keep", "1"], "--async-save with --keep 1"),
    (["train", "--async-save"], "--async-save without --save-every"),
    (["train", "--save-every", "2", "--async-save-pageable"], "--async-save-pageable without --async-save"),
], ids=["save-every-0", "keep-0", "resume-nothing", "resume-from-not-a-checkpoint", "both", "export-not-a-checkpoint",
        "export-hf", "async-keep-1", "async-without-save-every", "pageable-without-async"])
def test_bad_checkpoint_flags_are_refused_in_one_line_before_ranks_start(args, message, tmp_path):
    """Through the command line's `main` in this process (test_config runs refusals from a shell)."""
    out = ["--out", tmp_path] if args[0] == "train" else []
    r = run_main(*[a.format(tmp=tmp_path) for a in args], *out)
    assert r.returncode == 2 and message in r.stderr and "starting" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- the API's own models: fused tensor-parallel layers, bf16 masters ------------------------------

def _api_saved(mesh0, folder):
    import meshtrain
    from test_api import OPTIMIZERS, PLAN, batches, make_model
    out = {}
    for precision in ("fp32", "bf16"):
        mesh = meshtrain.init(tp=2)
        job = meshtrain.parallelize(make_model(), mesh, optimizer=OPTIMIZERS["adamw"], tp_plan=PLAN,
                                    precision=precision)
        for x, y in batches(2):
            job.step(x, y)
        job.save(f"{folder}/{precision}", note="kept beside the state")
        out[precision] = job.state_dict()
    return out


def test_a_command_line_checkpoint_loads_into_the_api_with_meshtrain_adamw(tmp_path):
    """`job.load` of a `meshtrain train` checkpoint needs the command line's optimizer groups
    (docs/api.md): `meshtrain.adamw` builds them and the saved weights come back; one group
    of everything is refused in one line."""
    import meshtrain
    from meshtrain.checkpoint.export import consolidated
    from meshtrain.recipes.build import build_model
    cfg = _cfg({}, tmp_path)
    cfg.train.steps = cfg.train.save_every = 2
    train(cfg, Comm(Mesh.single(CPU)))
    ckpt, mesh = folders.step_dir(tmp_path, 2), meshtrain.init(device="cpu")

    def job(optimizer):
        model = build_model(cfg.model.name, cfg.train.seed, vocab_size=256, dropout=cfg.model.dropout)
        return meshtrain.parallelize(model, mesh, optimizer=optimizer, loss_fn=meshtrain.cross_entropy)
    loaded = job(meshtrain.adamw(cfg.train.lr, cfg.train.weight_decay))
    loaded.load(ckpt)
    state = loaded.module.state_dict()
    assert all(torch.equal(state[name], t) for name, t in consolidated(ckpt).items())
    with pytest.raises(CheckpointError, match="saved with different hyper-parameters") as e:
        job(lambda named: torch.optim.AdamW((p for _, p in named), lr=cfg.train.lr)).load(ckpt)
    assert "\n" not in str(e.value)


def test_a_fused_tensor_parallel_job_and_its_bf16_masters_load_in_one_process(tmp_path):
    import meshtrain
    from test_api import OPTIMIZERS, make_model
    saved = run_ranks(_api_saved, 2, str(tmp_path), timeout=300)[0]
    for precision, want in saved.items():
        job = meshtrain.parallelize(make_model(), meshtrain.init(), optimizer=OPTIMIZERS["adamw"], precision=precision)
        meta = job.load(tmp_path / precision)
        assert meta["note"] == "kept beside the state" and job.steps == 2
        got = job.state_dict()
        assert got["model"].keys() == want["model"].keys()
        for name, w in want["model"].items():  # the fp32 masters under bf16: exactly
            assert got["model"][name].dtype == torch.float32 and torch.equal(got["model"][name], w), (precision, name)
        assert got["optim"].keys() == want["optim"].keys()
        for name, entry in want["optim"].items():
            for key, v in entry.items():
                assert torch.equal(got["optim"][name][key], v), (precision, name, key)


def test_a_huge_learning_rate_stops_the_run_within_a_step_naming_it(tmp_path):
    """A one-process run through the command line's `main`, in this process."""
    r = run_main("train", *TINY, "--dp", "1", "--steps", "6", "--lr", "1e6", "--warmup", "0", "--out", tmp_path)
    assert r.returncode == 3, r.stderr
    assert "meshtrain: error: step 2: the loss is nan" in r.stderr and "the gradient of embed.tok.weight" in r.stderr


class _Buffered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(4), persistent=False)  # recomputed: not state

    def forward(self, x):
        return self.lin(x) * self.scale + self.cache


def test_persistent_buffers_are_saved_and_a_module_s_cache_is_not(tmp_path):
    import meshtrain
    from meshtrain.checkpoint.dcp import INDEX
    sgd = lambda named: torch.optim.SGD((p for _, p in named), lr=0.1)  # noqa: E731
    job = meshtrain.parallelize(_Buffered(), meshtrain.init(), optimizer=sgd, loss_fn=lambda o, t: (o - t).pow(2).mean())
    job.module.scale.fill_(3.0)
    job.step(torch.ones(2, 4), torch.zeros(2, 4))
    job.save(tmp_path / "c")
    tensors = json.loads((tmp_path / "c" / INDEX).read_text())["tensors"]
    assert "buffer/scale" in tensors and "buffer/cache" not in tensors
    other = meshtrain.parallelize(_Buffered(), meshtrain.init(), optimizer=sgd, loss_fn=lambda o, t: (o - t).pow(2).mean())
    other.load(tmp_path / "c")
    assert torch.equal(other.module.scale, torch.full((4,), 3.0))
    assert torch.equal(other.module.lin.weight, job.module.lin.weight) and other.steps == 1


def test_loading_adds_at_most_two_copies_of_the_largest_tensor(tmp_path):
    """Every byte a load allocates (the profiler's CPU allocator events): DCP reads one saved
    box at a time — torch.load of it, then a copy into the rank's view — so the peak above what
    the rank keeps is at most twice the largest tensor, whatever the model's size."""
    from torch.profiler import ProfilerActivity, profile
    cfg = _cfg({}, tmp_path)
    cfg.train.steps, cfg.train.save_every = 1, 1
    result = train_run(cfg)
    job_parallel = result.parallel
    _, job = setup(cfg, Comm(Mesh.single(CPU)))
    job.load(folders.step_dir(tmp_path, 1))  # the optimizer's state exists now: what the rank keeps
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        job.load(folders.step_dir(tmp_path, 1))
    live = peak = 0
    for e in sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage
        peak = max(peak, live)
    largest = max(p.numel() * p.element_size() for p in job_parallel.module.parameters())
    assert 0 < peak <= 2 * largest, (peak, largest)


def test_sigterm_to_the_launcher_saves_the_current_step(tmp_path):
    """A scheduler's SIGTERM reaches meshtrain's own launcher: it passes it to the ranks,
    which save the step they are at, and the job exits 0."""
    import signal
    import time
    err_file = tmp_path.parent / f"{tmp_path.name}-stderr.txt"  # not in --out, which the run claims
    proc = start_cli("train", *TINY, "--dp", "2", "--steps", "5000", "--save-every", "4000", "--out", tmp_path,
                     stdout=os.devnull, stderr=err_file)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 0, err  # a clean stop, as the docs say (it was 143)
    saved = folders.steps_in_local(tmp_path)
    assert len(saved) == 1 and saved[0] >= 3, err
    assert f"stopped by SIGTERM after step {saved[0]}; saved {tmp_path}/step-{saved[0]}" in err
    assert folders.check(folders.step_dir(tmp_path, saved[0]), Comm(Mesh.single(CPU))) is None
