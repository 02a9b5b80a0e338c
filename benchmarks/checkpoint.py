"""Sharded checkpoints: save and load time and size per layout; the save beside writing the
same bytes (the whole state: weights and optimizer moments) as one safetensors file from one
process, fsynced as ours are, and beside each rank writing its own data file's bytes raw in
one sequential write (fsynced, before the save on odd repetitions and after it on even
ones): the save's throughput as a fraction of the disk's; and
`--async-save`'s blocking time (the step waits while the state is copied aside) and its time
until committed. Each repetition runs all of them in turn, so machine noise falls on all
alike.

    python benchmarks/checkpoint.py --out benchmarks/results/checkpoint.json

Every layout runs on its own real ranks (gloo, CPU), after one training step (so the
optimizer's moments exist)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

LAYOUTS = {  # name: (model, layout)
    "gpt-small dp2": ("gpt-small", {"dp": 2}),
    "gpt-small tp2": ("gpt-small", {"tp": 2}),
    "gpt-small dp2 zero3": ("gpt-small", {"dp": 2, "zero": 3}),
    "gpt2 dp2 zero3": ("gpt2", {"dp": 2, "zero": 3}),
}


def _measure(mesh0, model: str, layout: dict, folder: str, repeats: int):
    import torch
    from safetensors.torch import save_file

    from meshtrain.comm import Comm
    from meshtrain.cli.config import Config
    from meshtrain.mesh import Mesh
    from meshtrain.train import setup, train_step

    cfg = Config()
    cfg.model.name = model
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.vocab_size, cfg.train.device = 2, 64, 256, "cpu"
    for k, v in layout.items():
        setattr(cfg.layout, k, v)
    cfg.layout.dp = cfg.layout.dp or 1
    mesh = Mesh.build(1, cfg.layout.dp, cfg.layout.tp, torch.device("cpu"))
    comm = Comm(mesh)
    data, job = setup(cfg, comm)
    train_step(job, data, 0, cfg)
    full = job.state_dict()  # the same bytes, whole, on rank 0 (not timed)
    flat = {**{f"model/{k}": v for k, v in full["model"].items()},
            **{f"optim/{n}/{k}": v for n, e in full["optim"].items() for k, v in e.items()}} if mesh.is_main else {}
    saves, baselines, loads, raws, blocked, committed = [], [], [], [], [], []
    mine = None  # this rank's data file's bytes, from the first save (read untimed)

    def raw_write() -> None:
        comm.barrier()
        t0 = time.perf_counter()
        with open(Path(folder, f"raw-{mesh.rank}"), "wb") as f:
            f.write(mine)
            os.fsync(f.fileno())
        comm.barrier()  # every rank's write done: the slowest's time, as a save's
        raws.append(time.perf_counter() - t0)
        Path(folder, f"raw-{mesh.rank}").unlink()

    for i in range(repeats):
        target = Path(folder, f"ours-{i}")
        if mine is not None and i % 2:
            raw_write()  # before the save on odd repetitions: the disk's lag falls on both alike
        comm.barrier()
        t0 = time.perf_counter()
        job.save(target)
        saves.append(time.perf_counter() - t0)
        if mine is None:
            mine = (target / f"__{mesh.rank}_0.distcp").read_bytes()
        if i % 2 == 0:
            raw_write()
        comm.barrier()
        t0 = time.perf_counter()
        blocked.append(job.save(Path(folder, f"async-{i}"), background=True))
        job.wait_for_saves()
        committed.append(time.perf_counter() - t0)
        comm.barrier()
        if mesh.is_main:
            shutil.rmtree(Path(folder, f"async-{i}"))
        if mesh.is_main:
            t0 = time.perf_counter()
            path = Path(folder, f"baseline-{i}.safetensors")
            save_file(flat, str(path))
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            baselines.append(time.perf_counter() - t0)
            baseline_bytes = path.stat().st_size
            path.unlink()
        comm.barrier()
        t0 = time.perf_counter()
        job.load(target)
        loads.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in target.iterdir())
        comm.barrier()
        if mesh.is_main:
            shutil.rmtree(target)
    if not mesh.is_main:
        return None
    return {"save_s": saves, "load_s": loads, "baseline_save_s": baselines, "raw_write_s": raws,
            "async_blocked_s": blocked, "async_committed_s": committed, "checkpoint_bytes": size,
            "staging_bytes_rank0": job._saver.stager.bytes, "baseline_bytes": baseline_bytes,
            "n_params": job.parallel.n_params}


def main() -> None:
    from distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names of: " + ", ".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {}
    for name in args.layouts.split(","):
        model, layout = LAYOUTS[name]
        world = layout.get("dp", 1) * layout.get("tp", 1)
        with tempfile.TemporaryDirectory(prefix="meshtrain-ckpt-bench-", dir=os.environ.get("BENCH_DIR")) as folder:
            r = run_ranks(_measure, world, model, layout, folder, args.repeats, tp=layout.get("tp", 1),
                          timeout=3600)[0]
        med = {k: statistics.median(r[k]) for k in ("save_s", "load_s", "baseline_save_s", "raw_write_s",
                                                      "async_blocked_s", "async_committed_s")}
        r.update({f"{k}_median": v for k, v in med.items()}, ratio_save_to_baseline=med["save_s"] / med["baseline_save_s"],
                 throughput_of_raw_write=med["raw_write_s"] / med["save_s"])
        results[name] = r
        print(f"{name}: {r['checkpoint_bytes'] / 1e6:,.1f} MB; save {med['save_s']:.2f} s, load {med['load_s']:.2f} s; "
              f"one safetensors file of the same state {med['baseline_save_s']:.2f} s "
              f"({r['baseline_bytes'] / 1e6:,.1f} MB): ratio {r['ratio_save_to_baseline']:.2f}; raw sequential write of "
              f"each rank's bytes {med['raw_write_s']:.2f} s: the save runs at {r['throughput_of_raw_write']:.0%} of it; "
              f"--async-save blocks {med['async_blocked_s']:.3f} s, committed after {med['async_committed_s']:.2f} s "
              f"(staging {r['staging_bytes_rank0'] / 1e6:,.1f} MB on rank 0)", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
