"""Each byte read once: a load reads each stored box it needs once, checks the box's CRC-32
on exactly the bytes it read (so a flipped byte anywhere a rank reads is caught, while the
resume reads nothing twice: no whole-file checksum pass before the load), and under ZeRO-1
and 2 the data-parallel ranks read the weights once between them and all-gather them."""

import json
from pathlib import Path

import pytest
import torch

from distributed import run_ranks
from meshtrain.checkpoint import dcp, folders, sharded
from meshtrain.checkpoint.folders import CorruptCheckpoint
from meshtrain.comm import Comm
from meshtrain.cli.config import Config
from meshtrain.mesh import Mesh
from meshtrain.train import setup

CPU = torch.device("cpu")
TEXT = str(Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "hamlet.txt")  # no corpus package needed


def _job(layout: dict):
    c = Config()
    c.model.name, c.train.data = "gpt-test", TEXT
    c.train.steps, c.train.batch_size, c.train.seq_len, c.train.vocab_size, c.train.device = 1, 4, 16, 256, "cpu"
    for k, v in layout.items():
        setattr(c.layout, k, v)
    mesh = Mesh.build(layout.get("pp", 1), layout.get("dp", 1), layout.get("tp", 1), CPU)
    _, job = setup(c, Comm(mesh))
    return job


def _step(job) -> None:
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    job.step(x[:, :-1], x[:, 1:])  # the global batch


def _save_then_load(mesh0, saved: dict, loaded: dict, folder: str):
    """Rank's reads of a load in layout `loaded` of a checkpoint saved in layout `saved`,
    and the weights it holds after the load against those the saving job held."""
    job = _job(saved)
    _step(job)
    job.save(folder)
    want = job.parallel.full_state_dict(with_optimizer=False)["model"]
    other = _job(loaded)
    reads: list = []
    sharded.load(other.parallel, folder, reads=reads)
    got = other.parallel.full_state_dict(with_optimizer=False)["model"]
    return reads, want, got


def _stored(folder) -> dict[tuple[str, int], tuple[str, int]]:
    """(file, offset) -> (entry, length) of every stored box, from the index."""
    raw = json.loads((folder / dcp.INDEX).read_text())
    return {(path, start): (fqn, length) for fqn, _, path, start, length, _ in raw["storage"]}


@pytest.mark.parametrize("saved,loaded", [({"dp": 2, "zero": 3}, {"tp": 2}), ({"tp": 2}, {"dp": 2, "zero": 1})],
                         ids=["zero3-to-tp2", "tp2-to-zero1"])
def test_a_resharding_load_reads_each_stored_box_once_and_zero_ranks_split_the_weights(saved, loaded, tmp_path):
    results = run_ranks(_save_then_load, 2, saved, loaded, str(tmp_path / "c"), tp=2 if "tp" in loaded else 1)
    stored = _stored(tmp_path / "c")
    for reads, want, got in results:
        assert len(reads) == len(set(reads)), "a stored box read twice on one rank"
        for path, start, length in reads:  # whole stored boxes, as the index has them
            assert stored[(path, start)][1] == length
    want, got = results[0][1], results[0][2]
    assert all(torch.equal(want[k], got[k]) for k in want)
    model = {key: length for key, (fqn, length) in stored.items() if fqn.startswith("model/")}
    read_model = [sum(model.get((p, s), 0) for p, s, _ in reads) for reads, _, _ in results]
    if loaded.get("zero") == 1:  # the weights once between the two ranks (a box on the cut: both)
        assert sum(read_model) < 1.25 * sum(model.values()), (read_model, sum(model.values()))
        assert all(0 < r < 0.75 * sum(model.values()) for r in read_model), read_model


def _flipped_load(mesh0, folder: str):
    """Save in dp2·ZeRO-3, flip one bit in the middle of the largest stored box, load in tp2:
    the error each rank raises (None: the load passed)."""
    job, folder = _job({"dp": 2, "zero": 3}), Path(folder)
    _step(job)
    job.save(folder)
    if job.mesh.rank == 0:
        (path, start), (_, length) = max(_stored(folder).items(), key=lambda kv: kv[1][1])
        raw = bytearray((folder / path).read_bytes())
        raw[start + length // 2] ^= 0x10
        (folder / path).write_bytes(bytes(raw))
    job.parallel.comm.barrier()  # the flip is on disk before any rank loads
    other = _job({"tp": 2})
    try:
        sharded.load(other.parallel, folder)
    except CorruptCheckpoint as e:
        return str(e)
    return None


def test_a_flipped_byte_in_a_box_a_rank_reads_fails_the_load_on_every_rank(tmp_path):
    errors = run_ranks(_flipped_load, 2, str(tmp_path / "c"), tp=2)
    assert all(e is not None and "fails its checksum" in e and ".distcp" in e for e in errors), errors
    assert errors[0] == errors[1]


def _as_format_1(folder: Path) -> None:
    """Rewrite a checkpoint as meshtrain wrote it before format 2: each box a `torch.save`
    record, the index's last field DCP's transforms (None), each rank's RNG state in
    state.json (base64), the marker with whole-file CRCs."""
    import base64
    import io
    raw = json.loads((folder / dcp.INDEX).read_text())
    data = {name: (folder / name).read_bytes() for name in {e[2] for e in raw["storage"]}}
    records: dict[str, bytearray] = {name: bytearray() for name in data}
    storage, rng = [], {}
    for fqn, offset, name, start, length, _ in raw["storage"]:
        if fqn.startswith("rng/"):
            _, rank, device = fqn.split("/")
            rng.setdefault(int(rank), {})[device] = base64.b64encode(data[name][start:start + length]).decode()
            del raw["tensors"][fqn]
            continue
        chunk = next(s for o, s in raw["tensors"][fqn]["chunks"] if o == offset)
        t = torch.frombuffer(bytearray(data[name][start:start + length]), dtype=dcp.DTYPES[raw["tensors"][fqn]["dtype"]])
        buf = io.BytesIO()
        torch.save(t.view(chunk).clone(), buf)
        storage.append([fqn, offset, name, len(records[name]), len(buf.getvalue()), None])
        records[name] += buf.getvalue()
    for name, record in records.items():
        (folder / name).write_bytes(bytes(record))
    (folder / dcp.INDEX).write_text(json.dumps({**raw, "format": "meshtrain-dcp-1", "storage": storage}))
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "rng": [rng[r] for r in sorted(rng)]}))
    marker = json.loads((folder / "COMPLETE").read_text())
    marker["files"] = {name: {"bytes": (folder / name).stat().st_size, "crc32": folders.file_crc(folder / name)}
                       for name in marker["files"]}
    (folder / "COMPLETE").write_text(json.dumps(marker))


def test_a_checkpoint_of_format_1_still_loads(tmp_path):
    import meshtrain
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    job = meshtrain.parallelize(model, meshtrain.init(device="cpu"), loss_fn=torch.nn.functional.mse_loss,
                                optimizer=lambda named: torch.optim.AdamW((p for _, p in named), lr=1e-2))
    job.step(torch.randn(3, 4), torch.zeros(3, 2))
    job.save(tmp_path / "c")
    want, rng = {k: v.clone() for k, v in job.state_dict()["model"].items()}, torch.get_rng_state()
    _as_format_1(tmp_path / "c")
    job.step(torch.randn(3, 4), torch.zeros(3, 2))  # moved on: the load must bring it back
    job.load(tmp_path / "c")
    assert all(torch.equal(want[k], v) for k, v in job.state_dict()["model"].items())
    assert torch.equal(torch.get_rng_state(), rng)


def _rng_round_trip(mesh0, folder: str):
    """Each rank's RNG state as saved, and as a load in the same layout brings it back."""
    job = _job({"dp": 2, "zero": 1})
    torch.manual_seed(100 + job.mesh.rank)  # a state of its own on each rank
    saved = torch.get_rng_state()
    job.save(folder)
    torch.rand(10)  # moved on
    sharded.load(job.parallel, Path(folder))
    return saved, torch.get_rng_state()


def test_each_rank_s_random_state_is_its_own_entry_and_comes_back_in_the_same_layout(tmp_path):
    results = run_ranks(_rng_round_trip, 2, str(tmp_path / "c"))
    assert all(torch.equal(saved, back) for saved, back in results)
    assert not torch.equal(results[0][0], results[1][0])
    index = json.loads((tmp_path / "c" / dcp.INDEX).read_text())
    assert {"rng/0/cpu", "rng/1/cpu"} <= set(index["tensors"])
    assert "rng" not in json.loads((tmp_path / "c" / "state.json").read_text())  # nothing gathered
