"""`meshtrain bench --vs PEER`: this project and PyTorch's native equivalent on the same
model, data, world size and process group, interleaved step by step in one process tree
(which of the two goes first alternates), so that a noisy machine slows both alike.
Reports medians and their ratio (ours / peer); the first steps are warm-up and not timed."""

from __future__ import annotations

import json
import statistics
import sys
import time

from meshtrain.bench.ddp import ddp_setup
from meshtrain.bench.dtensor_tp import dtensor_tp_setup
from meshtrain.bench.fsdp2 import fsdp2_setup
from meshtrain.bench.torch_pp import torch_pp_setup
from meshtrain.bench.zero1 import zero1_setup
from meshtrain.comm import Comm
from meshtrain.config import Config
from meshtrain.train import setup, train_step

PEERS = {"ddp": ddp_setup, "zero1": zero1_setup, "fsdp2": fsdp2_setup, "dtensor-tp": dtensor_tp_setup,
         "torch-pp": torch_pp_setup}
WARMUP_STEPS = 2


def run_bench(cfg: Config, comm: Comm, peer: str) -> dict | None:
    """Collective: both setups in the same ranks, steps alternated; rank 0 gets the result."""
    data, ours = setup(cfg, comm)
    theirs = PEERS[peer](cfg, comm)
    times, losses = {"ours": [], "peer": []}, {"ours": [], "peer": []}
    runs = [("ours", ours), ("peer", theirs)]
    bar = None
    if comm.mesh.is_main:
        from tqdm import tqdm
        bar = tqdm(total=cfg.train.steps, desc=f"bench vs {peer}", file=sys.stderr, unit="pair")
    for step in range(WARMUP_STEPS + cfg.train.steps):
        for name, s in (runs if step % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            loss, _ = train_step(s, data, step, cfg)
            if step >= WARMUP_STEPS:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
        if bar is not None and step >= WARMUP_STEPS:
            bar.update()
    if bar is not None:
        bar.close()
    ours_state, peer_state = ours.model_state_bytes(), theirs.model_state_bytes()
    if not comm.mesh.is_main:
        return None
    ours_median, peer_median = statistics.median(times["ours"]), statistics.median(times["peer"])
    return {
        "peer": peer,
        "layout": cfg.layout.summary(),
        "model": cfg.model.name,
        "steps": cfg.train.steps,
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


def report(cfg: Config, result: dict, json_mode: bool) -> int:
    out = sys.stderr if json_mode else sys.stdout
    peer = result["peer"]
    print(f"{cfg.model.name}, {cfg.layout.world_size} ranks, {cfg.train.steps} interleaved steps: "
          f"ours {result['ours_step_time_median_s'] * 1e3:.1f} ms, {peer} {result['peer_step_time_median_s'] * 1e3:.1f} ms, "
          f"ratio {result['ratio']:.3f} (pairwise median {result['pairwise_ratio_median']:.3f}); model-state "
          f"bytes/rank kept between steps ours {_kept(result['ours_model_state_bytes']):,}, {peer} "
          f"{_kept(result['peer_model_state_bytes']):,} (ratio {result['model_state_ratio']:.3f})", file=out)
    if json_mode:
        print(json.dumps(result), flush=True)
    return 0
