"""Held-out validation: the split is never trained on, and `job.evaluate` gives the same
held-out loss in every layout as one process."""

import json

import numpy as np
import torch
from distributed import run_ranks
from helpers import TINY, last_json, run_cli

from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.data.datasets import DigitsData, open_dataset
from meshtrain.mesh import Mesh
from meshtrain.train import train
from meshtrain.verifier import STEP_LOSS_TOLERANCE

CPU = torch.device("cpu")
LAYOUTS = [{"dp": 2}, {"tp": 2, "sp": True}, {"pp": 2, "microbatches": 2}, {"dp": 2, "zero": 3}]


def test_training_never_samples_the_held_out_tail():
    data = open_dataset("shakespeare", "gpt", 256, 64, seed=0)
    n = len(data.tokens)
    assert data.split == n - n // 100
    tail = torch.from_numpy(np.asarray(data.tokens[data.split:]).astype(np.int64))
    for step in range(200):  # a training window's last token is before the split
        x, y = data.batch(step, 16, slice(0, 16))
        rows = torch.cat([x, y[:, -1:]], dim=1)
        assert all(_find(tail, r) is None for r in rows[:2])
    x, y = data.val_batch(0, 8, slice(0, 8))
    assert all(_find(tail, torch.cat([r, t[-1:]])) is not None for r, t in zip(x, y))
    assert torch.equal(data.val_batch(3, 8, slice(0, 8))[0], data.val_batch(3, 8, slice(0, 8))[0])
    digits = DigitsData(seed=0)
    assert digits.split == 1797 - 17
    first = {tuple(r.tolist()) for r in digits.x[:digits.split]}
    trained = {tuple(r.tolist()) for step in range(100) for r in digits.batch(step, 32, slice(0, 32))[0]}
    held = {tuple(r.tolist()) for r in digits.val_batch(0, 64, slice(0, 64))[0]}
    assert trained <= first and not held & first


def _find(haystack: torch.Tensor, needle: torch.Tensor):
    """Where `needle` first occurs in `haystack` (None: nowhere): each place its first token
    is, compared whole."""
    n = len(needle)
    for start in (haystack[:len(haystack) - n + 1] == needle[0]).nonzero().flatten().tolist():
        if torch.equal(haystack[start:start + n], needle):
            return start
    return None


def _cfg(layout: dict) -> Config:
    c = Config()
    c.model.name = "gpt-test"
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = 2, 8, 32, 256, "cpu"
    c.train.eval_every, c.train.eval_batches = 1, 2
    for k, v in layout.items():
        setattr(c.layout, k, v)
    c.layout.dp = c.layout.dp or 1
    return c


def _held_out_losses(mesh0):
    out = []
    for layout in LAYOUTS:
        mesh = Mesh.build(layout.get("pp", 1), layout.get("dp", 1), layout.get("tp", 1), CPU)
        out.append(train(_cfg(layout), Comm(mesh)).val_losses)
    return out


def test_the_held_out_loss_is_the_one_process_loss_in_every_layout():
    want = train(_cfg({}), Comm(Mesh.single(CPU))).val_losses
    assert [s for s, _ in want] == [1, 2]
    for layout, got in zip(LAYOUTS, run_ranks(_held_out_losses, 2, timeout=300)[0]):
        assert [s for s, _ in got] == [1, 2], layout
        for (_, a), (_, b) in zip(got, want):
            assert abs(a - b) / b <= STEP_LOSS_TOLERANCE, (layout, a, b)


def test_val_loss_in_the_json_and_metrics(tmp_path):
    r = run_cli("train", *TINY, "--dp", "2", "--steps", "3", "--eval-every", "2", "--out", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    j = last_json(r.stdout)
    assert [s for s, _ in j["val_losses"]] == [2, 3] and j["val_loss"] == j["val_losses"][-1][1]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["val_loss" in x for x in lines] == [False, True, True]


def test_tensorboard_events_hold_the_curves(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    r = run_cli("train", *TINY, "--dp", "2", "--steps", "3", "--eval-every", "3", "--tensorboard", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/train", "loss/held_out", "lr", "tokens_per_s", "grad_norm", "memory_mib/rank0",
            "memory_mib/rank1"} <= tags
    assert [e.step for e in events.Scalars("loss/train")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("loss/held_out")] == [3]


def test_tensorboard_missing_is_one_line(monkeypatch, capsys, tmp_path):
    from meshtrain import board, cli
    monkeypatch.setattr(board, "available", lambda: False)
    assert cli.main(["train", *TINY, "--tensorboard", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"meshtrain: error: {board.MISSING}"
