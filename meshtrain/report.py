"""What `meshtrain train` leaves behind, in two parts. `gather` is collective: every rank
hands rank 0 its figures and the full state. `write` runs on rank 0 alone after the process
group is gone, so slow disk writes and the text sample never hold other ranks in a
collective (and never meet its timeout): the loss curve, the trained model, a text sample,
a summary, and the JSON line of the contract."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from meshtrain.checkpoint.owner import METRICS_FILE
from meshtrain.cli.run_model import save_model
from meshtrain.comm import Comm
from meshtrain.cli.config import Config, tokens_per_sample
from meshtrain.recipe import is_user_model
from meshtrain.generate import sample
from meshtrain.metrics import peak_device_mib, peak_rss_mib, plot_losses, read_log
from meshtrain.recipes.build import build_model
from meshtrain.parallel.compile import compile_stats
from meshtrain.plan.cost import peak_flops
from meshtrain.recipes import family_of
from meshtrain.train import RunResult


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gather(result: RunResult, comm: Comm) -> dict | None:
    """Collective: each rank's model-state bytes, activation peak and peak RSS (rank order),
    and the full weights; rank 0 gets them, the others None."""
    mine = {"model_state": result.model_state, "activation_bytes": result.activation_bytes,
            "activation_bytes_per_layer": result.activation_bytes_per_layer, "peak_rss_mib": round(peak_rss_mib(), 1),
            "peak_device_mib": peak_device_mib(comm.mesh.device), "build_peak_bytes": result.parallel.build_peak_bytes,
            "compiled": compile_stats() if result.parallel.compiled else None}
    per_rank = comm.all_gather_object(mine)
    state = result.parallel.full_state_dict(with_optimizer=False)["model"]  # rank 0's; the optimizer's not needed
    return {"per_rank": per_rank, "state": state} if comm.mesh.is_main else None


def flops_per_step(cfg: Config, data) -> float | None:
    """Model FLOPs of one step on the global batch (the formula the planner uses; None for a
    user's own model, which has no formula)."""
    if is_user_model(cfg.model.name):
        return None
    spec = cfg.model.spec()
    facts = {k: getattr(data, k) for k in ("vocab_size", "n_inputs", "n_classes") if hasattr(data, k)}
    return family_of(spec).flops_per_step(spec, cfg.train.batch_size, cfg.train.seq_len, **facts)


def summary_json(cfg: Config, result: RunResult, per_rank: list[dict], device: torch.device) -> dict:
    median = statistics.median(result.step_times)
    flops = flops_per_step(cfg, result.data)
    peak = peak_flops(device_name(device), cfg.layout.precision)
    return {
        "steps": len(result.losses),
        "losses": result.losses,
        "first_step": result.first_step,  # 1, or the step after the checkpoint a resumed run began from
        **({"val_loss": result.val_losses[-1][1], "val_losses": [list(v) for v in result.val_losses]}
           if result.val_losses else {}),
        "final_loss": result.losses[-1],
        "step_time_median_s": median,
        "tokens_per_s": cfg.train.batch_size * tokens_per_sample(cfg) / median,
        "n_params": result.n_params,
        "layout": cfg.layout.summary(),
        "model_state_bytes_per_rank": [r["model_state"] for r in per_rank],
        "activation_bytes_per_rank": [r["activation_bytes"] for r in per_rank],
        # what one block's forward leaves alive (block 0, first micro-batch): the formulas' per-layer figure
        "activation_bytes_per_layer_per_rank": [r["activation_bytes_per_layer"] for r in per_rank],
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in per_rank],
        # every byte a rank allocated while it built its part of the model (parallel.materialize: no
        # rank builds the whole model)
        "build_peak_bytes_per_rank": [r["build_peak_bytes"] for r in per_rank],
        **({"peak_device_mib_per_rank": [r["peak_device_mib"] for r in per_rank]}
           if per_rank[0].get("peak_device_mib") is not None else {}),  # CUDA: the allocator's peak
        **({"compile": {"backend": cfg.layout.compile_backend,
                        "graphs_per_rank": [r["compiled"]["graphs"] for r in per_rank],
                        "graph_breaks_per_rank": [r["compiled"]["graph_breaks"] for r in per_rank],
                        "break_reasons": per_rank[0]["compiled"]["break_reasons"]}}
           if per_rank[0].get("compiled") is not None else {}),  # what dynamo made of the blocks
        "comm_bytes_per_step": result.comm_per_step,
        "comm_bytes_detail": result.comm_detail_per_step,  # each axis by collective
        "skipped_steps": result.skipped_steps,
        **(_expert_balance(result.expert_load_max_over_mean) if result.expert_load_max_over_mean else {}),
        "device": device_name(device),
        "model_flops_per_step": flops,
        # Model FLOPs per second over the devices' dense peak; None where the peak is unknown (CPUs).
        "mfu": flops / median / (peak * cfg.layout.world_size) if peak and flops else None,
    }


def _expert_balance(ratios: list[list[float]]) -> dict:
    """A mixture of experts' load: each router's busiest expert over the mean, at the last step
    and over the last tenth of the run (1 is perfectly balanced)."""
    tail = ratios[-max(1, len(ratios) // 10):]
    return {"expert_load_max_over_mean": max(ratios[-1]),
            "expert_load_max_over_mean_per_layer": ratios[-1],
            "expert_load_max_over_mean_tail_mean": statistics.mean(max(r) for r in tail)}


def plot_run(result: RunResult, out: Path, title: str) -> None:
    """OUT/loss.png of the whole run from its log: a resumed run's earlier steps included."""
    log = [r for r in read_log(out / METRICS_FILE) if "loss" in r]
    if log:
        steps, losses = [r["step"] for r in log], [r["loss"] for r in log]
        val_losses = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    else:
        steps = list(range(result.first_step, result.first_step + len(result.losses)))
        losses, val_losses = result.losses, result.val_losses
    plot_losses(steps, losses, out / "loss.png", title, val_losses=val_losses)


def write(cfg: Config, result: RunResult, gathered: dict, device: torch.device, json_mode: bool) -> int:
    """Rank 0, after the process group is gone: files, summary, sample, JSON line."""
    out = Path(cfg.train.out)
    human = sys.stderr if json_mode else sys.stdout
    summary = summary_json(cfg, result, gathered["per_rank"], device)
    plot_run(result, out, f"{cfg.model.name}, {cfg.layout.short()}")
    save_model(out, gathered["state"], cfg, result.data)
    mfu = f", MFU {summary['mfu']:.1%}" if summary["mfu"] is not None else ""
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {len(result.losses)} steps; "
          f"median step {summary['step_time_median_s']:.3f} s, {summary['tokens_per_s']:,.0f} tokens/s{mfu}; "
          f"{result.n_params:,} parameters", file=human)
    print(f"wrote {out}/metrics.jsonl, {out}/loss.png and the model ({out}/model.safetensors)", file=human)
    if hasattr(result.data, "decode") and not is_user_model(cfg.model.name):
        model = build_model(cfg.model.name, cfg.train.seed, vocab_size=result.data.vocab_size,
                            dropout=cfg.model.dropout, attention=cfg.model.attention, moe=cfg.model.moe_options())
        model.load_state_dict(gathered["state"])
        prompt = result.data.encode("\n")
        text = result.data.decode(sample(model.to(device), list(prompt), cfg.train.sample_tokens,
                                         cfg.train.seq_len, seed=cfg.train.seed))
        print("sample:\n" + text.strip(), file=human)
    if json_mode:
        print(json.dumps(summary), flush=True)
    return 0
