"""`meshtrain bench --vs PEER`: this project and PyTorch's native equivalent on the same
model, data, world size and process group, interleaved step by step in one process tree
(which of the two goes first alternates), so that a noisy machine slows both alike.
Reports medians and their ratio (ours / peer); the first steps are warm-up and not timed.

It takes typed options (`BenchOptions`, `PeerOptions`), not the command line's `Config`:
the command line fills them and hands in its train loop's pieces — how ours is built, how a
peer's strategies become a `Job` running the same loop, and one step of that loop."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

from meshtrain.bench.ddp import ddp_setup
from meshtrain.bench.dtensor_tp import dtensor_tp_setup
from meshtrain.bench.fsdp2 import fsdp2_setup
from meshtrain.bench.options import PeerOptions
from meshtrain.bench.torch_pp import torch_pp_setup
from meshtrain.bench.zero1 import zero1_setup
from meshtrain.comm import Comm
from meshtrain.job import Job
from meshtrain.parallel.compose import Parallelized
from meshtrain.step_output import StepOutput

PEERS = {"ddp": ddp_setup, "zero1": zero1_setup, "fsdp2": fsdp2_setup, "dtensor-tp": dtensor_tp_setup,
         "torch-pp": torch_pp_setup}
WARMUP_STEPS = 2

Step = Callable[[Job, object, int], StepOutput]  # one step of the train loop: (job, data, 0-based step)


@dataclass(frozen=True)
class BenchOptions:
    """What `run_bench` compares: the peer's options, and the train loop's pieces ours and the
    peer run in (the command line's: `cli.bench.bench_options`)."""
    peer: PeerOptions
    ours: Callable[[Comm], tuple[object, Job]]  # collective: the data, and our job on this layout
    as_job: Callable[[Parallelized], Job]  # a peer's strategies in a Job that runs our loop
    step: Step
    steps: int  # timed steps, after `WARMUP_STEPS`
    model: str  # the model's name, for the report


@dataclass
class Interleaved:
    """Per set-up: step times (after the warm-up), losses, and the bytes sent per step by axis."""
    times: dict[str, list[float]]
    losses: dict[str, list[float]]
    sent: dict[str, list[dict[str, float]]]


def interleaved(runs: dict[str, Job], data, step: Step, steps: int, comm: Comm, desc: str) -> Interleaved:
    """Collective: `steps` steps (after `WARMUP_STEPS`) of every set-up in the same ranks, one
    after the other, the order rotating every step, so that a noisy machine slows all alike;
    each runs `step(job, data, i)`."""
    names = list(runs)
    out = Interleaved({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names})
    bar = None
    if comm.mesh.is_main:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc=desc, file=sys.stderr, unit="round")
    for i in range(WARMUP_STEPS + steps):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            before = comm.totals()
            comm.barrier()
            t0 = time.perf_counter()
            loss = step(runs[name], data, i).loss
            elapsed = time.perf_counter() - t0
            out.losses[name].append(loss)
            if i >= WARMUP_STEPS:
                out.times[name].append(elapsed)
                out.sent[name].append({k: v - before.get(k, 0.0) for k, v in comm.totals().items()})
        if bar is not None and i >= WARMUP_STEPS:
            bar.update()
    if bar is not None:
        bar.close()
    return out


def run_bench(options: BenchOptions, comm: Comm, peer: str) -> dict | None:
    """Collective: both setups in the same ranks, steps alternated; rank 0 gets the result."""
    data, ours = options.ours(comm)
    theirs = options.as_job(PEERS[peer](options.peer, comm))  # the same loop as ours
    measured = interleaved({"ours": ours, "peer": theirs}, data, options.step, options.steps, comm, f"bench vs {peer}")
    times, losses = measured.times, measured.losses
    ours_state, peer_state = ours.parallel.model_state_bytes(), theirs.parallel.model_state_bytes()
    if not comm.mesh.is_main:
        return None
    ours_median, peer_median = statistics.median(times["ours"]), statistics.median(times["peer"])
    return {
        "peer": peer,
        "layout": options.peer.layout.summary(),
        "model": options.model,
        "steps": options.steps,
        "ours_step_time_median_s": ours_median,
        "peer_step_time_median_s": peer_median,
        "ratio": ours_median / peer_median,
        "pairwise_ratio_median": statistics.median(a / b for a, b in zip(times["ours"], times["peer"])),
        # both train the same model on the same batches: their losses agree to rounding
        "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["peer"])),
        "ours_model_state_bytes": ours_state,
        "peer_model_state_bytes": peer_state,
        # what each rank keeps between steps (ZeRO-3's gathered blocks, which FSDP2 also
        # gathers and frees, are reported by ours but cannot be read from FSDP2 on a CPU)
        "model_state_ratio": _kept(ours_state) / _kept(peer_state),
    }


def _kept(state: dict) -> int:
    return state["total"] - state.get("gathered", 0)


def report(options: BenchOptions, result: dict, json_mode: bool) -> int:
    out = sys.stderr if json_mode else sys.stdout
    peer = result["peer"]
    print(f"{options.model}, {options.peer.layout.world_size} ranks, {options.steps} interleaved steps: "
          f"ours {result['ours_step_time_median_s'] * 1e3:.1f} ms, {peer} {result['peer_step_time_median_s'] * 1e3:.1f} ms, "
          f"ratio {result['ratio']:.3f} (pairwise median {result['pairwise_ratio_median']:.3f}); model-state "
          f"bytes/rank kept between steps ours {_kept(result['ours_model_state_bytes']):,}, {peer} "
          f"{_kept(result['peer_model_state_bytes']):,} (ratio {result['model_state_ratio']:.3f})", file=out)
    if json_mode:
        print(json.dumps(result), flush=True)
    return 0
