"""What `meshtrain train` leaves behind: per-rank figures gathered to rank 0, the loss
curve, the trained model, a text sample, a summary, and the JSON line of the contract."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from meshtrain.checkpoint import save_model
from meshtrain.comm import Comm
from meshtrain.config import Config, tokens_per_sample
from meshtrain.generate import sample
from meshtrain.metrics import peak_rss_mib, plot_losses
from meshtrain.parallel import full_state_dict
from meshtrain.train import RunResult


def rank_figures(result: RunResult, comm: Comm) -> list[dict]:
    """Each rank's model-state bytes, saved-activation bytes and peak RSS, in rank order."""
    mine = {"model_state": result.model_state, "activation_bytes": result.activation_bytes,
            "peak_rss_mib": round(peak_rss_mib(), 1)}
    return comm.all_gather_object(mine)


def summary_json(cfg: Config, result: RunResult, per_rank: list[dict]) -> dict:
    median = statistics.median(result.step_times)
    return {
        "steps": len(result.losses),
        "losses": result.losses,
        "final_loss": result.losses[-1],
        "step_time_median_s": median,
        "tokens_per_s": cfg.train.batch_size * tokens_per_sample(cfg) / median,
        "n_params": result.n_params,
        "layout": cfg.layout.summary(),
        "model_state_bytes_per_rank": [r["model_state"] for r in per_rank],
        "activation_bytes_per_rank": [r["activation_bytes"] for r in per_rank],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
        "comm_bytes_per_step": result.comm_per_step,
    }


def finish_training(cfg: Config, comm: Comm, result: RunResult, json_mode: bool) -> None:
    per_rank = rank_figures(result, comm)
    if not comm.mesh.is_main:
        return
    out = Path(cfg.train.out)
    human = sys.stderr if json_mode else sys.stdout
    summary = summary_json(cfg, result, per_rank)
    plot_losses(result.losses, out / "loss.png", f"{cfg.model.name}, {cfg.layout.short()}")
    state = full_state_dict(result.model)
    save_model(out, state, cfg, result.data)
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {len(result.losses)} steps; "
          f"median step {summary['step_time_median_s']:.3f} s, {summary['tokens_per_s']:,.0f} tokens/s; "
          f"{result.n_params:,} parameters", file=human)
    print(f"wrote {out}/metrics.jsonl, {out}/loss.png and the model ({out}/model.safetensors)", file=human)
    if hasattr(result.data, "decode"):
        prompt = result.data.encode("\n")
        text = result.data.decode(sample(result.model, list(prompt), cfg.train.sample_tokens,
                                         cfg.train.seq_len, seed=cfg.train.seed))
        print("sample:\n" + text.strip(), file=human)
    if json_mode:
        print(json.dumps(summary), flush=True)
