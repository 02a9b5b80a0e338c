"""The end of a command-line run (`report.gather`) in every layout family: the final weights
stream to rank 0 one tensor at a time as it writes model.safetensors, and the sharded job
samples the text itself, so no host holds more than one full tensor beyond its own shard
(the live-storage meter; the old end gathered the whole model to rank 0 and built a second
one there). The file holds the full state bit for bit, and the sample is the one the whole
model, loaded from that file in one process, samples."""

import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import cli_config
from safetensors.torch import load_file

SMALL = ("--vocab-size", "256", "--seq-len", "32", "--batch-size", "8", "--device", "cpu", "--steps", "2")
LAYOUTS = {"dp2": ("gpt-test", ["--dp", "2"], {}),
           "dp2-zero3": ("llama-test", ["--dp", "2", "--zero", "3"], {}),
           "pp2": ("gpt-test", ["--pp", "2", "--microbatches", "2"], {"pp": 2}),
           "tp2-sp": ("llama-test", ["--tp", "2", "--sp"], {"tp": 2}),
           "cp2": ("gpt-test", ["--cp", "2"], {"cp": 2})}
SAMPLE_TOKENS = 24


def _end_of_run(mesh, cfg, presets=()):
    """`presets`: (name, spec) to add in the ranks first (`benchmarks/end_of_run.py`'s model)."""
    from meshtrain import report
    from meshtrain.recipes import add_preset
    from meshtrain.cli.run_model import save_model
    from meshtrain.comm import Comm
    from meshtrain.metrics import ActivationMeter
    from meshtrain.train import train

    for name, spec in presets:
        add_preset(name, spec)
    comm = Comm(mesh)
    result = train(cfg, comm, measure_memory=False)
    sizes = [math.prod(e.shape) * e.dtype.itemsize for stage in result.parallel.entries_of("model") for e in stage]
    state = result.parallel.full_state_dict(with_optimizer=False)["model"]  # what the file must hold
    with ActivationMeter() as streaming:
        save_model(Path(cfg.train.out), result.parallel, cfg, result.data)
    with ActivationMeter() as sampling:
        text = report.sample_text(cfg, result)
    with ActivationMeter() as one_forward:  # one row of the trained length, as the sampler runs
        result.job.forward(torch.zeros(1, cfg.train.seq_len, dtype=torch.long))
    return {"streaming": streaming.peak, "sampling": sampling.peak, "one_forward": one_forward.peak,
            "largest": max(sizes), "total": sum(sizes), "text": text, "state": state if mesh.is_main else None}


@pytest.fixture(scope="module")
def ends(tmp_path_factory):
    found = {}
    for name, (model, flags, axes) in LAYOUTS.items():
        out = tmp_path_factory.mktemp(name)
        cfg = cli_config("train", "--model", model, *SMALL, *flags, "--out", out)
        cfg.train.sample_tokens = SAMPLE_TOKENS
        found[name] = (cfg, run_ranks(_end_of_run, 2, cfg, **axes))
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_host_holds_more_than_one_tensor_beyond_its_shard(ends, layout):
    """Streaming the weights holds less than two full tensors on any rank (the largest, and
    a piece being gathered), where the model is many times that; sampling holds what a
    forward of one row holds."""
    _, ranks = ends[layout]
    for rank, r in enumerate(ranks):
        assert r["total"] > 8 * r["largest"], r  # a bound that tells one tensor from the model
        assert r["streaming"] < 2 * r["largest"], (rank, r["streaming"], r["largest"])
        # what a forward of one row holds (twice: gloo's thread lets a collective's buffers go a
        # moment after the caller wakes, and the meter may see them), never the model
        assert r["sampling"] <= 2 * r["one_forward"] < r["total"], (rank, r["sampling"], r["one_forward"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_file_holds_the_full_state_and_the_job_samples_what_the_whole_model_samples(ends, layout):
    from meshtrain.cli.run_model import load_model
    from meshtrain.generate import sample

    cfg, ranks = ends[layout]
    saved = load_file(str(Path(cfg.train.out) / "model.safetensors"))
    state = ranks[0]["state"]
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)
    model, tokenizer, _ = load_model(Path(cfg.train.out))
    prompt = [int(i) for i in tokenizer.encode("\n")]
    whole = tokenizer.decode(sample(model, prompt, SAMPLE_TOKENS, cfg.train.seq_len, seed=cfg.train.seed))
    assert ranks[0]["text"] == whole
    assert all(r["text"] is None for r in ranks[1:])


def _gathered_in_blocks(mesh):
    from meshtrain.comm import Comm
    from meshtrain.parallel import state
    state.PIECE_BYTES = 3 * 8 * 4  # three rows of a [12, 8] fp32 chunk at a time: four blocks a rank
    comm, r = Comm(mesh), mesh.coord("tp")
    full = torch.arange(12 * 16, dtype=torch.float32).view(12, 16)
    fused = ("tp", 1, (6, 10))  # two sections along dim 1, each split over tp
    mine = full[:, state.shard_positions(fused, 8, r, 2)].clone()
    return {"columns": state.gather_full(full[:, r * 8:(r + 1) * 8].clone(), ("tp", 1), comm),
            "sections": state.gather_full(mine, fused, comm),
            "passed on": state.gather_full(full[:, r * 8:(r + 1) * 8].clone(), ("tp", 1), comm, keep=False),
            "rows": state.gather_full(full[r * 6:(r + 1) * 6].clone(), ("tp", 0), comm)}


def test_a_chunk_too_large_to_move_at_once_arrives_in_blocks_into_its_place():
    """A tensor split along a dimension other than the first reaches the collector in blocks
    of at most `state.PIECE_BYTES` (so a rank never holds more than the tensor and a block),
    each straight into its place — fused sections too; a rank that does not keep it only
    passes its chunk on."""
    full = torch.arange(12 * 16, dtype=torch.float32).view(12, 16)
    for out in run_ranks(_gathered_in_blocks, 2, tp=2):
        assert torch.equal(out["columns"], full) and torch.equal(out["sections"], full)
        assert torch.equal(out["rows"], full) and out["passed on"] is None


def _batched_and_one_at_a_time(mesh, cfg):
    from meshtrain.comm import Comm
    from meshtrain.train import train

    p = train(cfg, Comm(mesh), measure_memory=False).parallel
    out = {}
    for kind in ("model", "optim"):
        entries = p.entries_of(kind)
        one = {(e.name, e.key): t for e, t in p.stream_to_main(kind, entries) if t is not None}
        out[kind] = (p.to_main(kind), one)
    return out if mesh.is_main else None


@pytest.mark.parametrize("flags, axes", [(["--tp", "2", "--pp", "2", "--microbatches", "2"], {"tp": 2, "pp": 2}),
                                         (["--dp", "2", "--tp", "2", "--sp", "--zero", "3", "--precision", "bf16"],
                                          {"tp": 2})],
                         ids=["tp2-pp2", "dp2-tp2-sp-zero3-bf16"])
def test_the_small_tensors_moved_in_batches_are_the_ones_moved_one_at_a_time(flags, axes):
    """What verify reads (`to_main`: consecutive small tensors gathered over tp, and sent
    from a stage to rank 0, ZeRO's pieces from each dp rank, a batch of up to `PIECE_BYTES`
    a message) is, bit for bit and key for key, what the one-at-a-time stream gives: fused
    and row- and column-split tensors, tensors whole between them, ZeRO-3's pieces with
    fp32 masters, every stage's."""
    cfg = cli_config("train", "--model", "llama-test", *SMALL, *flags, "--out", "unused")
    found = run_ranks(_batched_and_one_at_a_time, 4, cfg, **axes)[0]
    for kind, (batched, one) in found.items():
        assert list(batched) == list(one) and len(one) > 10, kind
        for key in one:
            assert batched[key].dtype == one[key].dtype and torch.equal(batched[key], one[key]), (kind, key)
