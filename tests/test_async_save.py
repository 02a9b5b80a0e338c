"""`--async-save`: the checkpoint a background thread writes is byte for byte the one a
synchronous save writes after the same step (the state is copied aside before the next step
changes it), the run's losses are unchanged, and a rank killed while the thread writes
leaves the previous checkpoint good: the restarted run resumes from it and ends bitwise as an
uninterrupted run."""

import json
from pathlib import Path

import torch
from helpers import TINY, last_json, run_cli
from meshtrain.checkpoint import dcp, folders
from meshtrain.checkpoint.background import Stager
from meshtrain.checkpoint.boxes import Box
from meshtrain.metrics import ActivationMeter
from meshtrain.faults import FAULT_ENV


def _run(out, *extra, env=None):
    r = run_cli("train", *TINY, "--dp", "2", "--zero", "1", "--steps", "6", "--warmup", "2", "--save-every", "2",
                "--keep", "2", "--out", out, "--json", *extra, env=env)
    assert r.returncode == 0, r.stderr
    return last_json(r.stdout), r.stderr


def _stored(folder: Path) -> dict[tuple, bytes]:
    """The bytes of every stored box but the random-number states (torch's global generator,
    which training never draws from, is seeded differently in every process), by entry."""
    index = json.loads((folder / dcp.INDEX).read_text())["storage"]
    files = {name: (folder / name).read_bytes() for name in {e[2] for e in index}}
    return {(fqn, tuple(offset)): files[name][start:start + length]
            for fqn, offset, name, start, length, _ in index if not fqn.startswith("rng/")}


def test_an_async_save_writes_the_synchronous_bytes_and_a_kill_during_it_falls_back(tmp_path):
    sync, _ = _run(tmp_path / "sync")
    in_background, err = _run(tmp_path / "async", "--async-save", "--async-save-pageable")
    assert "in the background (the step blocked" in err and "saved" in err
    assert in_background["losses"] == sync["losses"]
    assert folders.steps_in_local(tmp_path / "async") == [6, 4]  # --keep 2, pruned after each commit
    for step in (4, 6):
        a, b = folders.step_dir(tmp_path / "sync", step), folders.step_dir(tmp_path / "async", step)
        assert _stored(a) == _stored(b), step

    # rank 1 killed (SIGKILL) in the save thread of step 4, its files written, before the commit
    killed, err = _run(tmp_path / "killed", "--async-save", "--max-restarts", "1", env={FAULT_ENV: "kill-in-save:1:4"})
    assert "rank 1 failed (signal 9, SIGKILL); restart 1 of 1" in err
    assert f"resumed from {tmp_path / 'killed'}/step-2 (step 2" in err
    assert killed["losses"] == sync["losses"][2:]


def _api_background(mesh0, folder):
    """A user's own model at tp 2 · ZeRO-1 (dp 1): saved in the background after two steps,
    then stepped on before the thread may write (it waits for the steps: the race made
    certain); a fresh job loads the state of the save's moment, not the one the steps after
    it made."""
    import threading

    import meshtrain
    from meshtrain.checkpoint import background
    from test_api import OPTIMIZERS, PLAN, batches, make_model

    stepped, write = threading.Event(), background.folders.write

    def after_the_steps(*args):
        stepped.wait()
        return write(*args)
    background.folders.write = after_the_steps  # in this rank's process only

    def job():
        return meshtrain.parallelize(make_model(), meshtrain.init(tp=2), optimizer=OPTIMIZERS["adamw"],
                                     tp_plan=PLAN, zero=1)
    first = job()
    x = batches(4)
    for inputs, targets in x[:2]:
        first.step(inputs, targets)
    at_save = first.state_dict()
    blocked = first.save(folder, background=True)
    for inputs, targets in x[2:]:  # the staged copy is what gets written
        first.step(inputs, targets)
    stepped.set()
    first.wait_for_saves()
    second = job()
    second.load(folder)
    got = second.state_dict()
    return blocked, at_save, got, first.state_dict()


def test_a_background_save_of_a_user_s_model_holds_the_state_of_its_moment(tmp_path):
    import torch
    from distributed import run_ranks
    blocked, at_save, got, later = run_ranks(_api_background, 2, str(tmp_path / "c"), tp=2)[0]
    assert blocked > 0
    for name, value in at_save["model"].items():
        assert torch.equal(got["model"][name], value), name
    assert any(not torch.equal(later["model"][n], v) for n, v in at_save["model"].items())  # it did move on
    assert all(torch.equal(got["optim"][n][k], v) for n, entry in at_save["optim"].items() for k, v in entry.items())


def _boxed(views: dict[str, torch.Tensor]) -> dict:
    return {name: dcp.Boxed(tuple(v.shape), v.dtype, [Box((0,) * v.dim(), tuple(v.shape), v)])
            for name, v in views.items()}


def test_the_stager_keeps_one_arena_sized_to_the_state_and_allocates_nothing_after_the_first_save():
    """The async save's staging memory is one allocation per rank, sized to the boxes it
    holds (each at a 64-byte-aligned offset), reused save after save — not a block per box,
    each of which the caching host allocator may round up to a power of two — and allocated
    again only when the state's boxes change. (Pinned on a GPU: `Stager(pin=...)`; pageable
    here.)"""
    views = {"w": torch.randn(33, 7), "h": torch.randn(5, 3).to(torch.bfloat16), "step": torch.tensor(3),
             "ids": torch.arange(11), "e": torch.empty(0)}
    state = _boxed(views)
    stager = Stager()
    for save in range(3):
        for v in views.values():
            v.add_(1)  # a step between saves
        with ActivationMeter() as meter:
            staged = stager.stage(state)
        assert stager.allocations == 1 and (meter.peak == 0) == (save > 0), (save, meter.peak)
        for name, v in views.items():
            copy = staged[name].boxes[0].view
            assert torch.equal(copy, v)
            if v.numel():  # (an empty tensor has no address)
                assert copy.untyped_storage().data_ptr() == stager._arena.untyped_storage().data_ptr()
    sizes = [v.numel() * v.element_size() for v in views.values()]
    assert stager.bytes == sum(-(-n // 64) * 64 for n in sizes) < sum(sizes) + 64 * len(sizes)
    spans = sorted((b.view.data_ptr(), b.view.data_ptr() + b.view.numel() * b.view.element_size())
                   for e in staged.values() for b in e.boxes if b.view.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two boxes share a byte
    assert all(start % 64 == spans[0][0] % 64 for start, _ in spans)
    assert not stager._arena.is_pinned()  # the boxes are on the CPU: nothing to copy from a GPU fast
    grown = {**views, "w": torch.randn(50, 7)}
    stager.stage(_boxed(grown))  # the state changed: one arena again, the old one gone
    assert stager.allocations == 2
    assert stager.bytes == sum(-(-v.numel() * v.element_size() // 64) * 64 for v in grown.values())
